"""What a pretraining run validates on besides its training corpus's held-out documents: a bound
on every validation set (`datamodule.val_max_tokens`), and named extra sets
(`datamodule.extra_validation`), such as an out-of-domain corpus.

Bound. A validation set reads the first `val_max_tokens` tokens of its documents, in their fixed
order: the held-out documents in store order (the same for every run of the corpus and seed), a
validation corpus's or an extra set's in corpus order, each source of a mixture on its own, a
stream's held-out documents in file order. The document where the bound falls is cut there
(BERT: inside the sentence it falls in). The cut text is copied into memory (`first_tokens`):
at most `val_max_tokens` tokens per set. `ValidationBatchMaker` applies it to every validation
set the datamodule and a stream make, so the batches stay a pure function of the text, the
seed and the bound: the same for any number of loader workers and after a resume.

Extra sets. Each named corpus is read into a token store with the run's tokenizer (cached like
the training store, then bounded), made into the first phase's validation batches, and handed
out by a loader of its own after the run's own validation loader. Its batches carry the set's
index (`VAL_SET`), so that the LightningModule logs them under `val/<name>/` only: `val/loss`
stays the run's own validation, which checkpoints and early stopping follow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from datamodules.corpora.corpus import CorpusError, DataSetupError
from datamodules.objectives.batches import VAL, BatchMaker, EpochBatches
from datamodules.run_stores import RunStores
from datamodules.stores.store import OFFSET_DTYPE
from datamodules.streaming.read import MemoryStore

VAL_SET = "val_set"  # key of an extra validation set's batch: the set's index (a 0-d array)


def check_validation(val_fraction: float, val_corpus: Any, extra: Mapping | None) -> None:
    """Raise `DataSetupError` unless `datamodule.val_fraction` is in [0, 1), and unless a run
    with extra validation sets has its own validation too (its language-model loss, `val/loss`
    or BERT's `val/mlm_loss`, is what the best checkpoints and the end-of-run summary go by)."""
    if not 0 <= val_fraction < 1:
        raise DataSetupError(
            f"datamodule.val_fraction={val_fraction!r} is not in [0, 1): it is the share of "
            "documents held out for validation; e.g. datamodule.val_fraction=0.05, or "
            "datamodule.val_fraction=0 for no validation"
        )
    if extra and val_fraction == 0 and val_corpus is None:
        raise DataSetupError(
            "datamodule.extra_validation needs the run's own validation beside it (the "
            "held-out loss the best checkpoints go by), and datamodule.val_fraction=0 holds "
            "none out; e.g. datamodule.val_fraction=0.05"
        )


def check_val_max_tokens(value: Any) -> int | None:
    """`datamodule.val_max_tokens` as an int (None: no bound).

    Raises:
        DataSetupError: not a whole number of tokens above 0.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise DataSetupError(
            f"datamodule.val_max_tokens={value!r} is not a number of tokens above 0: it bounds "
            "the tokens each validation set reads; e.g. datamodule.val_max_tokens=200000, or "
            "datamodule.val_max_tokens=null for no bound"
        )
    return int(value)


def first_tokens(store, documents: np.ndarray, max_tokens: int) -> tuple[Any, np.ndarray]:
    """(store, documents) of the first `max_tokens` tokens of `store`'s `documents` in their
    order: unchanged when they hold no more, else a `MemoryStore` of the documents before the
    bound and the one it cuts (its sentences cut likewise), and their indices in it."""
    documents = np.asarray(documents, dtype=np.int64)
    lengths = np.diff(store.doc_offsets)[documents]
    ends = np.cumsum(lengths)
    if len(ends) == 0 or ends[-1] <= max_tokens:
        return store, documents
    kept = int(np.searchsorted(ends, max_tokens)) + 1  # the last one cut at the bound
    lengths = lengths[:kept].copy()
    lengths[-1] -= int(ends[kept - 1]) - max_tokens
    tokens = np.concatenate([store.document(int(d)) for d in documents[:kept]])[:max_tokens]
    sentence_offsets = doc_sentences = None
    if store.sentence_offsets is not None:
        sentences, counts = _sentences_of(store, documents[:kept], max_tokens)
        sentence_offsets, doc_sentences = _offsets(sentences), _offsets(counts)
    capped = MemoryStore(
        tokens,
        _offsets(lengths),
        sentence_offsets,
        doc_sentences,
        eos_id=store.eos_id,
        path=f"the first {max_tokens:,} tokens of {store.path}",
    )
    return capped, np.arange(kept)


def _sentences_of(store, documents: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(sentence lengths, sentences per document) of `documents` cut after `max_tokens` tokens."""
    lengths, counts = [], []
    for d in documents:
        first, stop = store.doc_sentences[d], store.doc_sentences[d + 1]
        lengths.append(np.diff(store.sentence_offsets[first : stop + 1]))
        counts.append(stop - first)
    flat = np.concatenate(lengths)
    ends = np.cumsum(flat)
    kept = int(np.searchsorted(ends, max_tokens)) + 1
    flat = flat[:kept].copy()
    flat[-1] -= int(ends[kept - 1]) - max_tokens
    counts = np.array(counts, dtype=np.int64)
    counts[-1] -= int(counts.sum()) - kept  # the last document loses the sentences past the cut
    return flat, counts


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(OFFSET_DTYPE)


class ValidationBatchMaker(BatchMaker):
    """A `BatchMaker` whose validation batches read at most `max_tokens` tokens of their
    documents (`first_tokens`); training batches are made as `BatchMaker` makes them.

    Args:
        tokenizer: the run's tokenizer.
        max_tokens: `datamodule.val_max_tokens` (None: no bound), checked here.
    """

    def __init__(self, tokenizer, max_tokens: Any = None) -> None:
        super().__init__(tokenizer)
        self.max_tokens = check_val_max_tokens(max_tokens)

    def __call__(self, store, documents: np.ndarray, objective, **shard) -> EpochBatches:
        if shard.get("split") == VAL and self.max_tokens is not None:
            capped, documents = first_tokens(store, documents, self.max_tokens)
            if capped is not store:  # cut at the bound (between documents or inside one)
                self._check_bounded(capped, documents, objective, shard["world_size"])
            store = capped
        return super().__call__(store, documents, objective, **shard)

    def _check_bounded(self, store, documents: np.ndarray, objective, world_size: int) -> None:
        """Raise `DataSetupError` when the bound leaves too little for the objective's
        validation (a window per process, or NSP's 2 documents)."""
        need_tokens = objective.validation_tokens(world_size)
        need_documents = objective.documents_per_split
        if self.max_tokens >= need_tokens and len(documents) >= need_documents:
            return
        raise DataSetupError(
            f"datamodule.val_max_tokens={self.max_tokens} leaves a validation set "
            f"{len(documents)} document(s), and validation needs at least {need_documents} "
            f"document(s) and {need_tokens:,} tokens (a window per process, or next-sentence "
            "pairs); raise datamodule.val_max_tokens, or set it to null"
        )


class TaggedBatches(Dataset):
    """An extra validation set's batches, each carrying the set's index (`VAL_SET`). Keyed
    like `EpochBatches` by (epoch, batch index)."""

    def __init__(self, batches: EpochBatches, index: int) -> None:
        self.batches = batches
        self.index = index

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        return self.batches[key] | {VAL_SET: np.array(self.index, dtype=np.int64)}


class ExtraValidation:
    """The named extra validation sets of a run (`datamodule.extra_validation`).

    Args:
        corpora: set name -> corpus (`datamodules.corpora.corpus`), in logging order.
        source_names: the run's mixture sources, whose `val/<source>/` names a set may not take.

    Raises:
        DataSetupError: a name that is empty, holds "/", or is a mixture source's.
    """

    def __init__(self, corpora: Mapping[str, Any] | None, source_names: list[str]) -> None:
        self.corpora = dict(corpora or {})
        for name in self.corpora:
            if not isinstance(name, str) or not name or "/" in name:
                raise DataSetupError(
                    f"datamodule.extra_validation has a set named {name!r}: a name is logged as "
                    "val/<name>/loss and must be a non-empty word without '/'; rename it, e.g. "
                    "datamodule.extra_validation.wikitext2_test"
                )
            if name in source_names:
                raise DataSetupError(
                    f"datamodule.extra_validation.{name} takes the name of the mixture's source "
                    f"{name}, whose validation is logged as val/{name}/; rename the set, e.g. "
                    f"datamodule.extra_validation.{name}_extra"
                )
        self.names = list(self.corpora)
        self.sets: list[TaggedBatches] = []  # this rank's batches of each set (`make`)
        self.stats: list = []  # `StoreStats` of the sets' stores

    def make(self, stores, may_build: bool, maker: BatchMaker, objective, shard: dict) -> None:
        """Each set's validation batches of `objective` for this rank (`shard`: rank,
        world_size, seed), tagged with its index, in `sets`; its store opened, built here when
        `may_build`, or waited for (`stores`: the run's `RunStores`, whose settings it shares;
        the sets' stores are listed in `stats`)."""
        own = RunStores(
            stores.tokenizer,
            stores.settings,
            stores.cache_dir,
            None,
            stores.chunk_mb,
            stores.wait_timeout_s,
        )
        self.stats = own.stats  # filled as the sets' stores are opened
        val = {"split": VAL, "shuffle": False, **shard}
        self.sets = []
        for index, (name, corpus) in enumerate(self.corpora.items()):
            with naming(name):
                store = own.open(corpus, may_build)
                batches = maker(store, np.arange(store.num_documents), objective, **val)
            self.sets.append(TaggedBatches(batches, index))


@contextlib.contextmanager
def naming(name: str) -> Iterator[None]:
    """Errors about extra validation set `name` (bad input, too little text) name it."""
    try:
        yield
    except (CorpusError, DataSetupError) as err:
        raise type(err)(f"datamodule.extra_validation.{name}: {err}") from None
