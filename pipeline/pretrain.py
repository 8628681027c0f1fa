"""`make pretrain`: pretrain a BERT or GPT on a corpus.

python -m pipeline.pretrain model=gpt trainer.max_steps=50
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from pipeline.cli import entry_point, user_errors
from pipeline.config import check_config
from tokenizer import get_tokenizer

log = logging.getLogger(__name__)

NOT_YET = (
    "the config is valid and the tokenizer is ready, but this version has no training loop "
    "yet: the models, the token-store data pipeline and the LightningModules are still being "
    "built (see 'Status' in the README). `make tokenizer` works today."
)


@hydra.main(config_path="../conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg)
        tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
        log.info(
            "%s run, tokenizer vocab %d, corpus %s",
            plan.family,
            tokenizer.get_vocab_size(),
            plan.corpus.describe(),
        )
    print(f"make pretrain: {NOT_YET}", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    entry_point(main)
