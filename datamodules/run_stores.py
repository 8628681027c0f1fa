"""The token stores a run reads, one per corpus (a mixture's sources each have their own), and
building them ahead of training (`make prepare`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from datamodules.mixture import MixtureCorpus
from datamodules.objective import CausalLMObjective, MaskedLMObjective, Objective
from datamodules.store import StoreSettings, StoreStats
from datamodules.store_build import open_or_build_store
from datamodules.store_parallel import build_in_parallel
from tokenizer import special_ids, tokenizer_kind


def store_settings(objective: Objective, tokenizer: Tokenizer) -> StoreSettings:
    """What the objective needs in a store: sentences for NSP, EOS separators for packing."""
    special = special_ids(tokenizer)
    if isinstance(objective, MaskedLMObjective):
        if (kind := tokenizer_kind(tokenizer)) != "wordpiece":
            raise ValueError(
                f"the masked-LM objective needs a wordpiece tokenizer ([CLS], [SEP], [MASK]), "
                f"got a {kind} tokenizer; use tokenizer=wordpiece"
            )
        return StoreSettings(sentences=True)
    if isinstance(objective, CausalLMObjective):
        return StoreSettings(sentences=False, eos_id=special.document_separator)
    raise TypeError(f"unknown objective {type(objective).__name__}")


def prepare_stores(
    corpus,
    tokenizer: Tokenizer,
    objective: Objective,
    cache_dir: str | os.PathLike,
    *,
    val_corpus=None,
    chunk_mb: float = 4.0,
    workers: int = 1,
    rank: int = 0,
    ranks: int = 1,
) -> list[StoreStats]:
    """Build (or reuse) the token stores of a run ahead of training.

    Args:
        corpus: the training corpus (`datamodules.corpus`).
        tokenizer: the run's tokenizer.
        objective: the run's objective (decides the store layout).
        cache_dir: root of the caches (stores go to `<cache_dir>/token_stores/`).
        val_corpus: a separate validation corpus, if any.
        chunk_mb: text per encoding chunk (bounds memory).
        workers: processes that tokenize on this machine (`datamodules.store_parallel`).
        rank, ranks: this process's rank among the launcher's (torchrun, srun): each builds
            its share of the parts, rank 0 joins them.

    Returns:
        Stats of each store (training first): documents, tokens, MB/s, path, built or reused.
    """
    settings = store_settings(objective, tokenizer)
    corpora = corpora_of(corpus) + ([] if val_corpus is None else [val_corpus])
    if workers == 1 and ranks == 1:
        return [
            open_or_build_store(c, tokenizer, settings, cache_dir, chunk_mb=chunk_mb)[1]
            for c in corpora
        ]
    shares = {"workers": workers, "rank": rank, "ranks": ranks, "chunk_mb": chunk_mb}
    return [build_in_parallel(c, tokenizer, settings, cache_dir, **shares)[1] for c in corpora]


def corpora_of(corpus) -> list:
    """The corpora a run reads, each into its own store: a mixture's sources, or the corpus."""
    return list(corpus.sources.values()) if isinstance(corpus, MixtureCorpus) else [corpus]


def check_ranks_agree(path: Path) -> None:
    """In a distributed run, fail fast (instead of waiting hours for a store nobody builds)
    when the ranks' corpus or tokenizer differ, so that they would read different stores."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    paths: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(paths, str(path))
    if len(set(paths)) > 1:
        raise RuntimeError(
            f"the ranks would read different token stores ({sorted(set(paths))}): their corpus "
            "or tokenizer differ. Give every rank the same tokenizer: train it once (on rank 0, "
            "or with `make tokenizer`) and load it from the cache; WordPiece training is not "
            "reproducible across processes"
        )
