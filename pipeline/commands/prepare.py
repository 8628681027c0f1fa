"""`make prepare`: build the run's token store ahead of training (training builds it on demand
otherwise) and print documents, tokens, throughput and the cache path. For a streamed run
(`datamodule.streaming=true`) it trains and caches the tokenizer only.

    python -m pipeline.commands.prepare model=gpt data=text_files data.paths='corpus/*.txt'
    make prepare ... prepare.workers=8        # 8 tokenizing processes (datamodules/stores/parallel.py)
    torchrun --nnodes 4 ... -m pipeline.commands.prepare ... prepare.workers=8   # and 4 nodes

Ctrl-C ends it with one line and exit status 130: every cache file is written atomically (a
store's manifest last), so what is there is complete or ignored, and the same command goes on
from it. A part's process killed by the system (out of memory) ends it with one line naming the
part and the command with fewer `prepare.workers`.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from datamodules.run_stores import prepare_stores
from datamodules.stores.parallel import PartBuildError
from pipeline.pretrain.checks import check_config
from pipeline.run.cli import entry_point, make_command, user_errors
from pipeline.run.errors import ConfigError
from pipeline.run.launcher import (
    command_overrides,
    group_choices,
    launcher_rank,
    launcher_world_size,
    override_key,
    relaunch_command,
)
from tokenizer import get_tokenizer, tokenizer_cache_path


def same_command(*changed: str) -> str:
    """This command with its overrides, `changed` (`key=value`) replacing those of the same
    keys: as `make prepare`, or as the launcher's line (torchrun, srun) that started it."""
    keys = {override_key(c) for c in changed}
    overrides = [*(o for o in command_overrides() if override_key(o) not in keys), *changed]
    return relaunch_command(
        make_command("prepare", overrides), "pipeline.commands.prepare", overrides
    )


@hydra.main(config_path="../../conf", config_name="prepare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        prepare(cfg)
    except KeyboardInterrupt:
        print(
            "\ninterrupted: the cache is consistent (the tokenizer, stores and parts finished "
            "so far are complete, nothing half-written is kept); the same command goes on from "
            f"there: {same_command()}",
            file=sys.stderr,
        )
        sys.exit(130)
    except PartBuildError as err:
        print(f"error: {err}", file=sys.stderr)
        fewer = same_command(f"prepare.workers={err.fewer_workers}")
        print(f"run again with: {fewer}", file=sys.stderr)
        sys.exit(1)


def prepare(cfg: DictConfig) -> None:
    """Build the caches and print what they hold."""
    with user_errors():
        plan = check_config(cfg, group_choices())
        workers = cfg.prepare.workers
        if not (isinstance(workers, int) and workers >= 1):
            raise ConfigError(
                f"prepare.workers={workers!r} is not a whole number >= 1: it is the number of "
                "processes that tokenize on this machine; e.g. prepare.workers=4"
            )
        # under a launcher, rank 0 trains the tokenizer and the others read it from the cache
        rank = launcher_rank()
        tokenizer = get_tokenizer(
            plan.tokenizer, plan.corpus, cfg.paths.cache_dir, may_train=rank == 0
        )
        if cfg.datamodule.get("streaming"):  # the tokenizer is all a streamed run prepares
            print(
                f"tokenizer    {tokenizer_cache_path(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)}"
                "\ntoken store  none: datamodule.streaming=true tokenizes as it trains"
            )
            return
        stats = prepare_stores(
            plan.corpus,
            tokenizer,
            plan.objective,
            cfg.paths.cache_dir,
            workers=workers,
            rank=rank,
            ranks=launcher_world_size(),
        )
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
