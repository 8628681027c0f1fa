"""`make predict`: label unlabelled texts with a fine-tuned model (see
`pipeline.finetune.evaluation.predict`).

    python -m pipeline.commands.predict ckpt=outputs/finetune/sst2/<run>
    python -m pipeline.commands.predict ckpt=outputs/finetune/imdb_long/<run> predict.file=reviews.jsonl
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT for the registry)
from pipeline.finetune.evaluation import predict
from pipeline.run.cli import entry_point, user_errors


@hydra.main(config_path="../../conf", config_name="predict", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        predict(cfg)


if __name__ == "__main__":
    entry_point(main, amends=("task",))
