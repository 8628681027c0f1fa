"""`make prepare`: build the run's token store ahead of training (training builds it on demand
otherwise) and print documents, tokens, throughput and the cache path.

    python -m pipeline.commands.prepare model=gpt data=text_files data.paths='corpus/*.txt'
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from datamodules.pretrain import prepare_stores
from pipeline.pretrain.checks import check_config
from pipeline.run.cli import entry_point, user_errors
from tokenizer import get_tokenizer


@hydra.main(config_path="../../conf", config_name="prepare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg)
        tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
        stats = prepare_stores(plan.corpus, tokenizer, plan.objective, cfg.paths.cache_dir)
    for store in stats:
        how = "built" if store.built else "reused (built earlier)"
        speed = store.text_bytes / 1e6 / store.seconds if store.seconds > 0 else float("nan")
        print(f"token store  {store.path} ({how})")
        print(
            f"  documents  {store.documents:,}"
            + (f" ({store.skipped_documents:,} empty, skipped)" if store.skipped_documents else "")
        )
        if store.sentences:
            print(f"  sentences  {store.sentences:,}")
        print(f"  tokens     {store.tokens:,}")
        print(
            f"  text       {store.text_bytes / 1e6:.2f} MB in {store.seconds:.2f} s "
            f"({speed:.2f} MB/s)"
        )


if __name__ == "__main__":
    entry_point(main)
