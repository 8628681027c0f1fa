"""`make evaluate`: the dev metrics of a fine-tuned model (see `pipeline.finetune.evaluation.evaluate`).

python -m pipeline.commands.evaluate ckpt=outputs/finetune/sst2/<run>
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT for the registry)
from pipeline.finetune.evaluation import evaluate
from pipeline.run.cli import entry_point, user_errors


@hydra.main(config_path="../../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        evaluate(cfg)


if __name__ == "__main__":
    entry_point(main, amends=("task",))
