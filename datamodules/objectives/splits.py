"""Which documents of its stores a run trains and validates on (`RunDocuments`): whole
documents held out for validation, as many as the run's objective needs
(`Objective.documents_per_split`, `Objective.validation_tokens`), or all of them beside a
separate validation corpus. When a corpus is too few for that, one error says how many
documents or tokens the run needs, why, and the settings that fix it (the objective's own words
first: `Objective.too_few_documents`); `RunDocuments.check` says it before a run writes
anything."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.batches import TRAIN
from datamodules.objectives.sharding import TooFewDocuments, split_documents
from datamodules.stores.store import TokenStore

# The version of which documents `PretrainDataModule.training_documents` yields for a corpus and
# its settings: bump it with any change to how validation documents are held out (a store's
# split, `datamodules.objectives.sharding.split_documents`; a stream's first-file hold-out,
# `datamodules.streaming.read.held_out_count` and the streams' `training_documents`), so that
# what is cached from a run's training text (the n-gram scores, pipeline/pretrain/documents.py)
# is counted again.
TRAINING_DOCUMENTS_FORMAT = 1


@dataclass(frozen=True)
class Shortage:
    """A corpus too few for a run's split, in the words its error needs.

    Attributes:
        err: what `split_documents` could not do (documents, held out, least for training).
        tokens: tokens of the whole corpus.
        corpus: the corpus's description.
        val_fraction: the run's `datamodule.val_fraction`.
    """

    err: TooFewDocuments
    tokens: int
    corpus: str
    val_fraction: float

    @property
    def have(self) -> str:
        documents = self.err.documents
        return (
            f"the corpus ({self.corpus}) has {documents} document{'s' * (documents != 1)} "
            f"({self.tokens:,} tokens)"
        )

    @property
    def held_out(self) -> str:
        return f"datamodule.val_fraction={self.val_fraction} holds out whole documents"


def split_store(
    lengths: np.ndarray,
    objective,
    *,
    val_fraction: float,
    seed: int,
    world_size: int,
    corpus: str,
) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of a store's documents of `lengths` tokens each, for a
    run of `objective` (an `Objective`: its first phase) on `world_size` processes.

    Raises:
        DataSetupError: the corpus (`corpus`: its description) is too few for the split,
            naming how many documents or tokens the run needs, why, and the fix.
    """
    need = objective.documents_per_split
    val_tokens = objective.validation_tokens(world_size)
    try:
        return split_documents(
            lengths,
            val_fraction,
            seed,
            min_val=need,
            min_val_tokens=val_tokens,
            min_train=need,
        )
    except TooFewDocuments as err:
        short = Shortage(err, int(lengths.sum()), corpus, val_fraction)
        said = objective.too_few_documents(short) or validation_too_few(short, val_tokens)
        raise DataSetupError(said) from None


def validation_too_few(short: Shortage, val_tokens: int) -> str:
    """What to say when the validation documents held out (at least one, and `val_tokens`
    tokens) leave none for training."""
    return (
        f"{short.have}: validation needs at least 1 document and {val_tokens:,} tokens "
        f"({short.held_out}), here {short.err.held_out}, which leaves none for training. Add "
        "documents, or train without validation: datamodule.val_fraction=0"
    )


class RunDocuments:
    """The documents of a run's stores that it trains and validates on; a mixture's sources
    are split each on its own.

    Args:
        stores: the run's stores (`datamodules.run_stores.RunStores`: `open`, `naming`).
        corpora: the corpora it trains on, each in its own store (`run_stores.corpora_of`).
        val_corpus: a separate validation corpus (all training documents are then used).
        objective: the objective of the run's first phase (what a split needs).
        val_fraction, seed: the share held out for validation, and the data seed.
    """

    def __init__(self, stores, corpora: list, val_corpus, objective, val_fraction, seed) -> None:
        self.stores = stores
        self.corpora = corpora
        self.val_corpus = val_corpus
        self.objective = objective
        self.val_fraction = val_fraction
        self.seed = seed

    def split(self, store: TokenStore, corpus, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(training, validation) documents of `corpus`'s `store`, without a validation
        corpus, for a run of `world_size` processes."""
        with self.stores.naming(corpus):
            return split_store(
                np.diff(store.doc_offsets),
                self.objective,
                val_fraction=self.val_fraction,
                seed=self.seed,
                world_size=world_size,
                corpus=corpus.describe(),
            )

    def splits(self, world_size: int, may_build: bool) -> list[tuple]:
        """Per training corpus: (its store, training documents, validation store, validation
        documents); stores are built here only when `may_build`."""
        splits = []
        for corpus in self.corpora:
            store = self.stores.open(corpus, may_build)
            if self.val_corpus is None:
                train, val = self.split(store, corpus, world_size)
                splits.append((store, train, store, val))
                continue
            val_store = self.stores.open(self.val_corpus, may_build)
            val = np.arange(val_store.num_documents)
            splits.append((store, np.arange(store.num_documents), val_store, val))
        return splits

    def check(self, world_size: int, objectives: list) -> None:
        """Build (or reuse) the training stores and check that their documents make the run's
        splits, and training items of each phase's objective in `objectives` (from document
        lengths only: cheap)."""
        if self.val_corpus is not None:
            return
        for corpus in self.corpora:
            store = self.stores.open(corpus, may_build=True)
            train, _ = self.split(store, corpus, world_size)
            with self.stores.naming(corpus):
                for objective in objectives:
                    objective.check_split(TRAIN, store, train)

    def training(self, world_size: int) -> Iterator[np.ndarray]:
        """The token ids of every training document, in store order, for a run of
        `world_size` processes (stores are built if they are not in the cache)."""
        for corpus in self.corpora:
            store = self.stores.open(corpus, may_build=True)
            if self.val_corpus is not None:
                documents = np.arange(store.num_documents)
            else:
                documents, _ = self.split(store, corpus, world_size)
            yield from (store.document(int(i)) for i in documents)
