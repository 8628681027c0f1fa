"""`make finetune`: fine-tune a pretrained model on a task (pipeline/finetune/run.py).

    python -m pipeline.commands.finetune task=sst2 ckpt=outputs/bert/<run>
    python -m pipeline.commands.finetune task=rte ckpt=... -m optim.lr=2e-5,3e-5 seed=1,2,3

Returns the main dev metric, for Hydra sweepers that optimize it.
"""

from __future__ import annotations

import math

import hydra
from omegaconf import DictConfig

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT for the registry)
from pipeline.finetune.run import finetune
from pipeline.run.cli import entry_point, user_errors


@hydra.main(config_path="../../conf", config_name="finetune", version_base="1.3")
def main(cfg: DictConfig) -> float:
    with user_errors():
        value = finetune(cfg).main_score()
        return value if value is not None and math.isfinite(value) else float("nan")


if __name__ == "__main__":
    entry_point(main)
