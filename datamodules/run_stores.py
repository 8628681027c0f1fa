"""The token stores a run reads, one per corpus (a mixture's sources each have their own), and
building them ahead of training (`make prepare`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from datamodules.corpora.mixture import MixtureCorpus
from datamodules.objectives.objective import Objective
from datamodules.stores.build import open_or_build_store, store_path
from datamodules.stores.parallel import build_in_parallel
from datamodules.stores.store import StoreSettings, StoreStats, TokenStore


def store_settings(objective: Objective, tokenizer: Tokenizer) -> StoreSettings:
    """The layout of a run's stores: what its objective needs of them (sentences for NSP,
    separators for packing: `Objective.store_settings`)."""
    return objective.store_settings(tokenizer)


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
        corpus: the training corpus (`datamodules.corpora.corpus`).
        tokenizer: the run's tokenizer.
        objective: the run's objective (decides the store layout).
        cache_dir: root of the caches (stores go to `<cache_dir>/token_stores/`).
        val_corpus: a separate validation corpus, if any.
        chunk_mb: text per encoding chunk (bounds memory).
        workers: processes that tokenize on this machine (`datamodules.stores.parallel`).
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


class RunStores:
    """Opens the stores of a run's corpora, once each: reused, built (when this process may
    build), or waited for; `stats` lists them. Errors about a mixture's source name it.

    Args:
        tokenizer, settings: the run's tokenizer and store layout.
        cache_dir: root of the caches.
        mixture: the run's mixture, if it reads one.
        chunk_mb: text per encoding chunk when building.
        wait_timeout_s: how long a process that may not build waits for the builder.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        settings: StoreSettings,
        cache_dir: str | os.PathLike,
        mixture: MixtureCorpus | None,
        chunk_mb: float,
        wait_timeout_s: float,
    ) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.cache_dir = cache_dir
        self.mixture = mixture
        self.chunk_mb = chunk_mb
        self.wait_timeout_s = wait_timeout_s
        self.stats: list[StoreStats] = []
        self._stores: dict[Path, TokenStore] = {}  # opened stores, by path

    def open(self, corpus, may_build: bool) -> TokenStore:
        """The store of `corpus` (built here only when `may_build`)."""
        with self.naming(corpus):
            fingerprint = corpus.fingerprint()
            path = store_path(fingerprint, self.tokenizer, self.settings, self.cache_dir)
            check_ranks_agree(path)
            if path in self._stores:  # opened by `check_documents`: verified once is enough
                return self._stores[path]
            store, stats = open_or_build_store(
                corpus,
                self.tokenizer,
                self.settings,
                self.cache_dir,
                may_build=may_build,
                chunk_mb=self.chunk_mb,
                wait_timeout_s=self.wait_timeout_s,
                fingerprint=fingerprint,
            )
            if not any(s.path == stats.path for s in self.stats):
                self.stats.append(stats)
            self._stores[path] = store
            return store

    @contextlib.contextmanager
    def naming(self, corpus) -> Iterator[None]:
        """Errors about one source of a mixture name the source and its keys
        (`MixtureCorpus.naming`)."""
        if self.mixture is None:
            yield
            return
        with self.mixture.naming(corpus):
            yield


def check_ranks_agree(path: Path) -> None:
    """In a distributed run, fail fast (instead of waiting hours for a store nobody builds)
    when the ranks' corpus or tokenizer differ, so that they would read different stores.
    The store's name is its key: nodes with caches of their own may keep them in different
    folders (`LMPIPE_CACHE` on each node's local disk)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    paths: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(paths, str(path))
    if len({Path(p).name for p in paths}) > 1:
        raise RuntimeError(
            f"the ranks would read different token stores ({sorted(set(paths))}): their corpus "
            "or tokenizer differ. Give every rank the same tokenizer: train it once (on rank 0, "
            "or with `make tokenizer`) and load it from the cache; WordPiece training is not "
            "reproducible across processes"
        )
