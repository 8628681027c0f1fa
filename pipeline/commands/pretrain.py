"""`make pretrain`: pretrain a BERT or GPT on a corpus (pipeline/pretraining.py).

python -m pipeline.commands.pretrain model=gpt trainer.max_steps=50
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.cli import entry_point, user_errors
from pipeline.config import check_config
from pipeline.pretraining import train

log = logging.getLogger(__name__)


@hydra.main(config_path="../../conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg)
        log.info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        train(cfg, plan)


if __name__ == "__main__":
    entry_point(main)
