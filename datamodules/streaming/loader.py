"""A streamed run's data (`datamodule.streaming=true`, `datamodules.streaming.read`): its loader,
the readers' positions, and what `PretrainDataModule` asks of it.

The loader hands out the steps of its workers in turn (worker s mod W gives step s), whatever
worker the DataLoader hears from first, so a resumed loader continues the uninterrupted order.
Every step handed out moves its reader's state (`StreamPosition`); the state saved is that of
the steps the Trainer consumed (Lightning fetches ahead), gathered from every rank.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from datamodules.corpora.corpus import DataSetupError
from datamodules.corpora.mixture import MixtureCorpus, mixture_changed, resume_overrides
from datamodules.corpora.pieces import file_pieces
from datamodules.objectives.batches import BatchMaker
from datamodules.objectives.loaders import ResumableLoader
from datamodules.objectives.objective import Objective
from datamodules.stores.encoding import BlockEncoder
from datamodules.stores.resume_text import text_changed
from datamodules.stores.store import StoreSettings
from datamodules.streaming.read import (
    MemoryStore,
    ReaderState,
    StepRecord,
    StreamBatches,
    held_out_count,
)

log = logging.getLogger(__name__)

_HISTORY = 64  # steps handed out whose states are kept (Lightning fetches one batch ahead)
# What each entry of `StreamedData.settings_key` is, in the words of the settings that fix it.
_SETTINGS_MEANING = {
    "seed": "seed",
    "readers": "processes x datamodule.num_workers",
    "workers": "datamodule.num_workers",
    "micro_batches": "trainer.accumulate_grad_batches",
    "batch_size": "objective.batch_size",
    "seq_len": "objective.seq_len",
    "block_bytes": "bytes per block: datamodule.shuffle_buffer_mb, at least 8 steps of text",
    "held_out": "validation documents: datamodule.val_fraction of the first file",
    "units": "files (Parquet row groups) x the ways each is shared",
}


def streaming_refusal(corpus, objective: Objective) -> str | None:
    """Why `corpus` and `objective` cannot be streamed (yet); None when they can."""
    if objective.phases:
        return (
            "datamodule.streaming=true reads one batch layout: not objective.phases (not "
            "supported yet); drop objective.phases, or add datamodule.streaming=false"
        )
    if isinstance(corpus, MixtureCorpus) and corpus.by_epochs:
        weights = {"by": "weights", "sources": corpus.names, "amounts": [1] * len(corpus.names)}
        return (
            "datamodule.streaming=true draws a mixture's sources by weight, and a stream has no "
            "epoch length for data.epochs to count passes in; give each source a share "
            f"instead, e.g. {resume_overrides(weights)}"
        )
    return None


class StreamPosition:
    """The states of one rank's readers after every step handed out (the last `_HISTORY`).

    Args:
        states: each reader's state before the first step (fresh, or resumed).
        step: steps handed out before (a resumed run's position).
    """

    def __init__(self, states: dict[int, ReaderState], step: int) -> None:
        self.restart(states, step)

    def restart(self, states: dict[int, ReaderState], step: int) -> None:
        """Start again from `states` after `step` steps (a resume: in place, since the
        loader holds this object)."""
        self.states = dict(states)
        self.handed = step
        self._history: deque = deque([(step, dict(states))], maxlen=_HISTORY)

    def advance(self, record: StepRecord) -> None:
        """Count a step handed out, with its reader's state after it."""
        self.states[record.reader] = record.after(self.states[record.reader])
        self.handed += 1
        self._history.append((self.handed, dict(self.states)))

    def at(self, steps: int) -> dict[int, ReaderState]:
        """The readers' states after the first `steps` steps."""
        for handed, states in self._history:
            if handed == steps:
                return states
        raise RuntimeError(
            f"no reader state for step {steps} (kept: steps {self._history[0][0]} to "
            f"{self.handed}); the Trainer consumed steps the loader did not hand out"
        )


class StreamLoader(ResumableLoader):
    """The training loader of a streamed run (its dataset is `StreamBatches`)."""

    position: StreamPosition

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # A new iterator (a Trainer's next epoch, when limit_train_batches ends one) goes on
        # after the steps consumed, not those handed out and lost with the old iterator.
        consumed = self.datamodule.position()[1]
        if consumed != self.position.handed:
            self.position.restart(self.position.at(consumed), consumed)
        self.dataset.resume = dict(self.position.states)
        workers = self.dataset.workers
        iterator = DataLoader.__iter__(self)
        waiting: dict[int, deque] = {w: deque() for w in range(workers)}
        turn = self.position.handed % workers
        while True:
            while not waiting[turn]:
                record, step = next(iterator)
                waiting[record.worker].append((record, step))
            record, step = waiting[turn].popleft()
            self.position.advance(record)
            yield from self.tensors(step)
            turn = (turn + 1) % workers

    def __len__(self) -> int:
        raise TypeError("a streamed run's loader has no length")


class StreamedData:
    """The training stream and validation documents of a streamed run (of one corpus; a
    mixture's: `datamodules.streaming.mixed.MixedStreamedData`).

    Args:
        corpus, tokenizer, settings, objective: the run's.
        seed: the data seed.
        micro_batches: batches per optimizer step.
        num_workers: loader workers per rank (each a reader).
        val_fraction: share of the first file's documents held out for validation.
        block_mb: text per block, the shuffle buffer (`StreamBatches`).
    """

    def __init__(
        self,
        corpus,
        tokenizer: Tokenizer,
        settings: StoreSettings,
        objective: Objective,
        *,
        seed: int,
        micro_batches: int,
        num_workers: int,
        val_fraction: float,
        block_mb: float,
    ) -> None:
        self.corpus = corpus
        self.tokenizer = tokenizer
        self.settings = settings
        self.objective = objective
        self.seed = seed
        self.micro_batches = micro_batches
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.block_mb = block_mb
        self.least = objective.documents_per_split
        # held-out validation documents by world size: `check_documents` and `setup` both ask
        self._validation: dict[int, tuple[MemoryStore | None, int]] = {}
        self.dataset: StreamBatches | None = None
        self.position: StreamPosition | None = None
        self._pending: dict[str, Any] | None = None

    state_type = ReaderState  # a reader's state, as `_apply` reads it back

    def setup(self, rank: int, world_size: int, validate: bool) -> list[MemoryStore]:
        """Hold out the validation documents (when `validate`: no separate validation corpus)
        and make this rank's stream; returns the validation documents (none, or one store)."""
        val_store, held_out = None, 0
        if validate:
            val_store, held_out = self.validation_documents(world_size)
        self.dataset = StreamBatches(
            self.pieces,
            self.corpus.describe(),
            self.tokenizer,
            self.settings,
            self.objective,
            seed=self.seed,
            rank=rank,
            world_size=world_size,
            num_workers=self.num_workers,
            micro_batches=self.micro_batches,
            held_out=held_out,
            block_mb=self.block_mb,
        )
        mine = range(rank * self.dataset.workers, (rank + 1) * self.dataset.workers)
        self.position = StreamPosition({r: ReaderState() for r in mine}, 0)
        log.info(
            "streaming: rank %d/%d, %d reader(s) of %d over %d unit(s) of %d file(s); blocks "
            "of %.3g MB of text; %d validation documents held out",
            rank,
            world_size,
            self.dataset.workers,
            self.dataset.readers,
            len(self.dataset.units),
            len(self.dataset.pieces),
            self.dataset.block_bytes / 1e6,
            held_out,
        )
        if self._pending is not None:
            self._apply(self._pending)
        return [] if val_store is None else [val_store]

    def validation_set(self, stores: list, make: BatchMaker, val: dict[str, Any]):
        """The validation batches (an `EpochBatches`, or None) of `stores` (`setup`'s, or a
        separate validation corpus's), made by `make` with `val` (`EpochBatches` keywords)."""
        sets = [make(s, np.arange(s.num_documents), self.objective, **val) for s in stores]
        return sets[0] if sets else None

    def progress(self, steps: int) -> dict[str, dict[str, float]]:
        """Per source of a mixture, what training has read by step `steps`: none here."""
        return {}

    def validation_documents(self, world_size: int) -> tuple[MemoryStore | None, int]:
        """The first file's first documents, tokenized (at least the objective's
        `validation_tokens` for `world_size` ranks), and how many they are (read once per world
        size)."""
        if world_size not in self._validation:
            self._validation[world_size] = self._hold_out(world_size)
        return self._validation[world_size]

    def _hold_out(self, world_size: int) -> tuple[MemoryStore | None, int]:
        least_tokens = self.objective.validation_tokens(world_size)
        first = self.pieces[0]
        documents = sum(1 for _ in first.documents())
        count = held_out_count(documents, self.val_fraction, self.least)
        if count == 0:
            return None, 0
        if documents == 0:
            raise DataSetupError(
                f"streaming holds out validation documents from the corpus's first file, and "
                f"it has none ({first.describe()}); remove the empty file, or train without "
                "validation: datamodule.val_fraction=0"
            )
        encoding = BlockEncoder(self.tokenizer, self.settings)
        while True:
            texts = [text for _, text in zip(range(count), first.documents(), strict=False)]
            store = MemoryStore.of(encoding.encode_documents(texts), self.settings.eos_id)
            if len(store.tokens) >= least_tokens or count >= documents:
                break
            count = min(documents, 2 * count)
        whole = (
            f"streaming holds out the first file's first {count} of its {documents} documents "
            f"for validation (datamodule.val_fraction={self.val_fraction}, at least "
            f"{self.least} document(s) and {least_tokens:,} tokens)"
        )
        if count >= documents and len(self.pieces) == 1:
            raise DataSetupError(
                f"{whole}, which leaves none for training; add text, or lower "
                "datamodule.val_fraction (0: no validation)"
            )
        if count >= documents:
            log.warning("%s: the whole of %s", whole, first.describe())
        return store, count

    @functools.cached_property
    def pieces(self) -> list:
        """The corpus's files, as corpora of one file (or Parquet row group) each, listed once."""
        return [piece for piece, _ in file_pieces(self.corpus)]

    @functools.cached_property
    def corpus_key(self) -> str:
        """The corpus's fingerprint (its files and their content), computed once."""
        return self.corpus.fingerprint()

    def loader(self, datamodule, pin: bool) -> StreamLoader:
        """The training loader of `datamodule` (batches pinned with `pin`)."""
        loader = StreamLoader.over(
            self.dataset, None, seed=self.seed, pin=pin, num_workers=self.num_workers
        )
        loader.position = self.position
        loader.micro_batches = self.micro_batches
        loader.datamodule = datamodule
        return loader

    def first_step(self) -> list[dict[str, np.ndarray]]:
        """The first reader's first step, made here (a corpus that makes none fails now)."""
        record_step = next(self.dataset.steps(0, 0, ReaderState()))
        return record_step[1]

    def settings_key(self) -> dict[str, Any]:
        """What must match for a resumed stream to go on exactly, besides the text (the corpus
        fingerprint, saved beside them and compared by `text_changed`)."""
        dataset = self.dataset
        return {
            "seed": self.seed,
            "readers": dataset.readers,
            "workers": dataset.workers,
            "micro_batches": self.micro_batches,
            "batch_size": self.objective.batch_size,
            "seq_len": self.objective.seq_len,
            "block_bytes": dataset.block_bytes,
            "held_out": dataset.held_out,
            "units": len(dataset.units),
        }

    def state_dict(self, steps: int) -> dict[str, Any]:
        """The position after `steps` consumed steps: every rank's readers' states."""
        mine = {r: s.to_dict() for r, s in self.position.at(steps).items()}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
            mine = {r: s for part in gathered for r, s in part.items()}
        return {
            **self.settings_key(),
            "corpus": self.corpus_key,
            "step": steps,
            "readers_state": mine,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the stream from `state_dict()`: now when set up, and at every later `setup`
        (which makes the stream afresh)."""
        self._pending = dict(state)
        if self.dataset is not None:
            self._apply(state)

    def refusal(self, state: dict[str, Any]) -> str | None:
        """Why this run cannot resume `state` on its text (or sampling); None when it can."""
        if state.get("mixture") is not None:  # a streamed mixture's position
            return mixture_changed(state["mixture"], None)
        return text_changed(state.get("corpus"), self.corpus_key, self.corpus)

    def _apply(self, state: dict[str, Any]) -> None:
        if refusal := self.refusal(state):
            raise DataSetupError(refusal)
        for key, value in self.settings_key().items():
            if state.get(key) != value:
                raise DataSetupError(
                    f"cannot resume the streamed data exactly: the checkpoint has {key}="
                    f"{state.get(key)!r}, this run {value!r} ({_SETTINGS_MEANING[key]}). "
                    "Resume with the same data seed, "
                    "corpus (its files unchanged), objective (batch size, seq_len), "
                    "datamodule.shuffle_buffer_mb, "
                    "datamodule.val_fraction, gradient accumulation, number of processes and "
                    "datamodule.num_workers"
                )
        saved = {int(r): self.state_type.from_dict(s) for r, s in state["readers_state"].items()}
        mine = {r: saved[r] for r in self.position.states}
        self.position.restart(mine, int(state["step"]))
        log.info("streamed data position restored: step %d", state["step"])

    def training_documents(self, world_size: int = 1) -> Iterator[np.ndarray]:
        """The token ids of every training document, in corpus order, the validation documents
        held out as a run of `world_size` processes holds them out: what counting models of
        the run's corpus count."""
        if self.dataset is not None:
            held_out = self.dataset.held_out
        else:
            held_out = self.validation_documents(world_size)[1]
        encoding = BlockEncoder(self.tokenizer, self.settings)
        for number, piece in enumerate(self.pieces):
            documents = piece.documents()
            if number == 0:
                documents = (d for i, d in enumerate(documents) if i >= held_out)
            for chunk in encoding.chunks(documents, 4_000_000):
                store = MemoryStore.of(encoding.encode(chunk), self.settings.eos_id)
                yield from (store.document(i) for i in range(store.num_documents))
