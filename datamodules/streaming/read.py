"""Pretraining batches streamed from the corpus: read and tokenized on the fly by the loader's
workers, with no token store and no preprocessing pass (`datamodule.streaming=true`).

Readers. A run's R = world_size x max(1, num_workers) loader processes are its readers (reader
g = rank x workers + worker). The corpus is cut into units: its files (`file_pieces`), each cut
k = ceil(R / files) ways by document (unit (f, j) reads file f and keeps its documents j, j + k,
...), so that every reader has work even when the corpus is one file. In each of its epochs a
reader takes units g, g + R, g + 2R, ... of the units shuffled by (seed, epoch), and goes on to
its next epoch on its own: the stream has no end (`trainer.max_steps` ends the run).

Blocks (the shuffle buffer). A reader reads documents until it holds `block_mb` MB of text (and
at least 8 optimizer steps' worth), tokenizes them as a store build would (`BlockEncoder`: the
same ids) and makes them into the run's items with the store's own batch code, over the block
held in memory (`MemoryStore`). An objective whose items are windows of the packed stream
(`Objective.packed`: GPT) gets whole windows, and the tokens short of a whole optimizer step
are carried into the next block (no token is skipped); any other gets the items of the block's
documents (BERT: NSP instances whose random second segments come from the block's other
documents), topped up to whole steps by repeating the block's first items (as an epoch of a
store is; its batches wrap around when `set_num_items` gives them more items than they hold,
as `BertBatches` do). The items are shuffled within the block and handed out one optimizer step (its micro-batches) at a time.

Position. A block is a pure function of where it starts (`Cursor`: the reader's epoch, unit
and document), the tokens carried into it and the seed. Every step carries its reader's
`ReaderState` (the block's cursor and carry, and how many of its steps are out), so that a
resumed reader re-reads its block from the cursor and skips the steps already handed out: at
most one block is tokenized again (`datamodules.streaming.loader` keeps the states).

Validation: the first documents of the first file (`held_out`), tokenized once in memory
(`datamodules.streaming.loader.StreamedData.validation_documents`); readers skip them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import IterableDataset, get_worker_info

from datamodules.corpora.corpus import CorpusError, DataSetupError
from datamodules.objectives.batches import TRAIN, BatchMaker, StepBatches
from datamodules.objectives.objective import Objective
from datamodules.stores.encoding import BlockEncoder, Encoded
from datamodules.stores.store import OFFSET_DTYPE, StoreSettings

_MIN_BLOCK_STEPS = 8  # a block holds at least this many optimizer steps of text
_BYTES_PER_TOKEN = 4  # about, in English text: sizes a block's text from its tokens
_GROWTH_LIMIT = 64  # a BERT block that makes no pair grows to at most this many times its size
_MIN_EMPTY_EPOCHS = 10  # a reader fails after this many epochs in a row without a document


@dataclass
class MemoryStore:
    """Documents tokenized in memory, with the arrays of a `TokenStore` (what the batch classes
    read)."""

    tokens: np.ndarray
    doc_offsets: np.ndarray
    sentence_offsets: np.ndarray | None = None
    doc_sentences: np.ndarray | None = None
    eos_id: int | None = None
    path: str = "(documents in memory)"

    @classmethod
    def of(cls, encoded: Encoded, eos_id: int | None) -> MemoryStore:
        """The store of one encoded chunk (`BlockEncoder.encode`)."""
        sentences = encoded.sentence_lengths is not None
        return cls(
            tokens=encoded.ids,
            doc_offsets=_offsets(encoded.doc_lengths),
            sentence_offsets=_offsets(encoded.sentence_lengths) if sentences else None,
            doc_sentences=_offsets(encoded.doc_sentence_counts) if sentences else None,
            eos_id=eos_id,
        )

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    def document(self, index: int) -> np.ndarray:
        """Token ids of document `index` (a view), as `TokenStore.document`."""
        return self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]]


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(OFFSET_DTYPE)


@dataclass(frozen=True)
class Cursor:
    """Where a reader's block starts: its `epoch`, the position `unit` in that epoch's units
    of the reader, and `document`: the unit's file documents before it (read or skipped)."""

    epoch: int = 0
    unit: int = 0
    document: int = 0


@dataclass
class ReaderState:
    """A reader's position: its current block's `cursor` and the tokens `carry`-ed into it
    (GPT), and the block's `steps` already handed out."""

    cursor: Cursor = field(default_factory=Cursor)
    carry: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    steps: int = 0

    def to_dict(self) -> dict:
        """As a checkpoint holds it (tensors and lists: it loads with `weights_only`)."""
        c = self.cursor
        carry = torch.from_numpy(self.carry.astype(np.int32))
        return {"cursor": [c.epoch, c.unit, c.document], "carry": carry, "steps": self.steps}

    @classmethod
    def from_dict(cls, state: dict) -> ReaderState:
        carry = np.asarray(state["carry"]).astype(np.int64)
        return cls(Cursor(*map(int, state["cursor"])), carry, int(state["steps"]))


@dataclass
class StepRecord:
    """What a loader worker sends with each step: the reader and its state after the step
    (`carry` only with a block's first step, else None: the loader keeps the last one)."""

    reader: int
    worker: int
    cursor: Cursor
    steps: int
    carry: np.ndarray | None

    def after(self, before: ReaderState) -> ReaderState:
        """The reader's state after this step, from its state `before` it."""
        carry = before.carry if self.carry is None else self.carry
        return ReaderState(self.cursor, carry, self.steps)


def worker_reader(rank: int, workers: int) -> tuple[int, int]:
    """(reader, loader worker) of the process asking, on `rank` with `workers` per rank."""
    info = get_worker_info()
    worker = info.id if info is not None else 0
    if info is not None:
        # one tokenizer thread per worker: the workers are the parallelism (and the
        # tokenizers library would warn about threads used before the fork)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return rank * workers + worker, worker


def stream_units(pieces: int, readers: int) -> list[tuple[int, int, int]]:
    """The units (file, j, k) of a corpus of `pieces` files for `readers` readers: each file
    cut into k = ceil(readers / pieces) interleaved shares of its documents."""
    ways = max(1, math.ceil(readers / pieces))
    return [(piece, share, ways) for piece in range(pieces) for share in range(ways)]


def held_out_count(documents: int, val_fraction: float, least: int) -> int:
    """Validation documents held out of a first file of `documents` documents: the share
    `val_fraction` (rounded up), at least `least` (none when val_fraction is 0). A change to
    it bumps `datamodules.objectives.splits.TRAINING_DOCUMENTS_FORMAT` (caches of training
    text follow it)."""
    if val_fraction <= 0:
        return 0
    return max(least, math.ceil(val_fraction * documents))


class StreamBatches(IterableDataset):
    """One rank's stream of optimizer steps: each item is (`StepRecord`, the step's
    micro-batches, as `StepBatches` makes them).

    Args:
        pieces: the corpus's files, as corpora of one file each (`file_pieces`).
        describe: the corpus's description, for errors.
        tokenizer: the run's tokenizer.
        settings: what the objective needs of the tokens (`run_stores.store_settings`).
        objective: the run's objective (one phase).
        seed: the data seed.
        rank, world_size: this process's place in the run.
        num_workers: the loader's worker processes on each rank.
        micro_batches: batches per optimizer step.
        held_out: the first file's first documents, kept for validation.
        block_mb: text per block (the shuffle buffer), in MB.
    """

    def __init__(
        self,
        pieces: list,
        describe: str,
        tokenizer: Tokenizer,
        settings: StoreSettings,
        objective: Objective,
        *,
        seed: int,
        rank: int,
        world_size: int,
        num_workers: int,
        micro_batches: int,
        held_out: int,
        block_mb: float,
    ) -> None:
        self.pieces = pieces
        self.describe = describe
        self.tokenizer = tokenizer
        self.settings = settings
        self.objective = objective
        self.seed = seed
        self.rank = rank
        self.workers = max(1, num_workers)
        self.readers = world_size * self.workers
        self.micro_batches = micro_batches
        self.held_out = held_out
        self.units = stream_units(len(self.pieces), self.readers)
        self.per_step = objective.batch_size * micro_batches
        step_bytes = self.per_step * objective.seq_len * _BYTES_PER_TOKEN
        self.block_bytes = max(int(block_mb * 1e6), _MIN_BLOCK_STEPS * step_bytes)
        self.resume: dict[int, ReaderState] = {}  # reader -> where it starts

    def __iter__(self) -> Iterator[tuple[StepRecord, list[dict[str, np.ndarray]]]]:
        reader, worker = worker_reader(self.rank, self.workers)
        return self.steps(reader, worker, self.resume.get(reader, ReaderState()))

    def units_of(self, reader: int, epoch: int) -> list[tuple[int, int, int]]:
        """The units `reader` reads in `epoch`, in order."""
        order = np.random.default_rng([self.seed, TRAIN, epoch]).permutation(len(self.units))
        return [self.units[i] for i in order[reader :: self.readers]]

    def documents(self, reader: int, start: Cursor) -> Iterator[tuple[str, Cursor]]:
        """`reader`'s documents from `start` on, each with the cursor after it (no end). An
        epoch whose units hold no training document (an empty file, a file of fewer documents
        than the readers sharing it) is passed over; only a reader that finds none in as many
        epochs in a row as there are units (every unit comes round) fails."""
        epoch, first_unit, skip = start.epoch, start.unit, start.document
        empty = 0
        while True:
            found = False
            units = self.units_of(reader, epoch)
            for position in range(first_unit, len(units)):
                piece, share, ways = units[position]
                for index, text in enumerate(self.pieces[piece].documents()):
                    if index < skip or index % ways != share:
                        continue
                    if piece == 0 and index < self.held_out:
                        continue
                    found = True
                    yield text, Cursor(epoch, position, index + 1)
                skip = 0
            empty = 0 if found else empty + 1
            if empty > max(_MIN_EMPTY_EPOCHS, len(self.units)):
                raise CorpusError(
                    f"streaming reader {reader} of {self.readers} found no document in "
                    f"{empty} epochs of its shares of the corpus ({self.describe}) besides the "
                    f"{self.held_out} held out for validation; add text, or use fewer loader "
                    "workers (datamodule.num_workers) or processes"
                )
            epoch, first_unit = epoch + 1, 0

    def steps(
        self, reader: int, worker: int, state: ReaderState
    ) -> Iterator[tuple[StepRecord, list[dict[str, np.ndarray]]]]:
        """`reader`'s steps from `state` on."""
        skip = state.steps
        for cursor, steps, carry in self.blocks(reader, state):
            for index in range(skip, len(steps)):
                sent = carry if index == skip else None
                yield StepRecord(reader, worker, cursor, index + 1, sent), steps[(0, index)]
            skip = 0

    def blocks(
        self, reader: int, state: ReaderState
    ) -> Iterator[tuple[Cursor, StepBatches | tuple, np.ndarray]]:
        """`reader`'s blocks from `state`'s on: each one's cursor, steps and carry into it."""
        encoding = BlockEncoder(self.tokenizer, self.settings)
        make = BatchMaker(self.tokenizer)
        documents = self.documents(reader, state.cursor)
        cursor, carry = state.cursor, state.carry
        while True:
            texts: list[str] = []
            size, target = 0, self.block_bytes
            steps = None
            while steps is None:
                for text, end in documents:  # the stream has no end: this always breaks
                    texts.append(text)
                    after = end
                    size += len(text.encode())
                    if size >= target and len(texts) >= 2:
                        break
                steps, rest = self.block(reader, cursor, encoding, make, texts, carry, size)
                target = 2 * size  # a BERT block without a pair yet: read as much again
            yield cursor, steps, carry
            cursor, carry = after, rest

    def block(
        self,
        reader: int,
        cursor: Cursor,
        encoding: BlockEncoder,
        make: BatchMaker,
        texts: list[str],
        carry: np.ndarray,
        size: int,
    ) -> tuple[StepBatches | tuple | None, np.ndarray]:
        """The steps of the block of `texts` that starts at `cursor` with `carry`, and the
        tokens carried on; None for a BERT block that makes no pair yet (read on)."""
        where = [self.seed, reader, cursor.epoch, cursor.unit, cursor.document]
        seed = int(np.random.default_rng(where).integers(1 << 62))
        shard = {"split": TRAIN, "shuffle": True, "seed": seed, "rank": 0, "world_size": 1}
        encoded = encoding.encode_documents(texts)
        if self.objective.packed:  # whole windows of the stream; the rest carried on
            tokens = np.concatenate([carry, encoded.ids.astype(np.int64)])
            seq_len = self.objective.seq_len
            windows = (len(tokens) - 1) // seq_len // self.per_step * self.per_step
            if windows == 0:
                return (), tokens
            used = windows * seq_len + 1
            store = MemoryStore(tokens[:used], np.array([0, used]), eos_id=self.settings.eos_id)
            batches = make(store, np.zeros(1, np.int64), self.objective, **shard)
            # a copy: a view would keep the whole block's tokens alive with the carry
            return StepBatches(batches, self.micro_batches), tokens[used - 1 :].copy()
        store = MemoryStore.of(encoded, eos_id=None)
        try:
            batches = make(store, np.arange(store.num_documents), self.objective, **shard)
        except DataSetupError as err:
            if size < _GROWTH_LIMIT * self.block_bytes:
                return None, carry
            raise DataSetupError(
                f"streaming reader {reader} read {size:,} bytes of text in a row that make no "
                f"BERT sentence pair (documents of one sentence each?): {err}"
            ) from None
        if batches.plan.num_items == 0:
            return None, carry
        batches.set_num_items(-(-batches.plan.num_items // self.per_step) * self.per_step)
        return StepBatches(batches, self.micro_batches), carry
