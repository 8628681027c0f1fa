"""A streamed mixture (`data=mixture datamodule.streaming=true`): every source of a
`MixtureCorpus` streamed as one corpus is (`datamodules.streaming.read`), and each step's rows
drawn from the sources by weight.

Sources. Each source has its own units, blocks and `ReaderState`s: reader g of the run reads
every source, through one `StreamBatches` per source, seeded apart from the others, whose steps
are single rows (the objective with batch_size 1), so that a source can give a step any number
of rows. A GPT window is packed from one source's documents and a BERT pair from one source's
sentences, as in the store path (`datamodules.corpora.mixture`).

Mixing: rows by weight, as the store path mixes a batch. The `batch_size` rows of micro-batch m
of optimizer step t on rank r are shared among the sources by a multinomial draw with the
normalized `weights`, a pure function of (seed, r, t, m) (`step_rows`), whichever loader
worker reads the step. Over many steps each source's share of the rows tends to its weight
(within about 2 sqrt(w (1 - w) / rows) after `rows` rows); a single step holds the sources in
proportion only on average (the store path's even blend holds them in proportion in every
batch, but needs each source's length). A micro-batch holds its rows in source order
(`merge_batches`: BERT rows padded to the widest), and each carries the step's loss counts,
summed from its rows'. Each source keeps a block of `shuffle_buffer_mb` in memory per reader.

A mixture given `epochs` is refused (`streaming_refusal`): a stream has no epoch length to count
passes in; give it `weights`.

Position. A reader's state (`MixedState`) is its steps handed out and each source's
`ReaderState`; a resumed reader re-reads each source's block from its cursor and skips the rows
already taken. The saved position holds the mixture's `spec` and each source's fingerprint:
other weights, or an edited source, are refused on resume as the store path refuses them
(`datamodules.stores.resume_text.sources_changed`, with the overrides that fix it).

Logged as the store path logs a mixture: validation per source (each source's first file's first
documents held out, their batches taken in turn: `InterleavedBatches`), and each source's
sequences and tokens read by all ranks (`data/<source>/sequences`, `tokens`), counted from the
draws (tokens: sequences x the mean tokens per item of the source's first block: exact for GPT,
BERT's mean as the store path's). A stream has no epoch length: no `data/<source>/epochs`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from datamodules.corpora.corpus import DataSetupError
from datamodules.corpora.mixture import MixtureCorpus
from datamodules.objectives.batches import STEP_TOTAL, BatchMaker, merge_batches
from datamodules.objectives.mixed import InterleavedBatches
from datamodules.stores.resume_text import sources_changed
from datamodules.streaming.loader import StreamedData, StreamPosition, streaming_refusal
from datamodules.streaming.read import (
    MemoryStore,
    ReaderState,
    StepRecord,
    StreamBatches,
    worker_reader,
)

log = logging.getLogger(__name__)

_MIXING = 7  # mixed into the seeds of the row draws and of the sources' streams


def step_rows(
    seed: int, rank: int, step: int, weights: np.ndarray, batch_size: int, micro_batches: int
) -> np.ndarray:
    """(micro_batches, S) rows of each source in each micro-batch of optimizer step `step` (of
    the rank's steps, from 0) on `rank`: multinomial draws of `batch_size` rows by `weights`."""
    rng = np.random.default_rng([seed, _MIXING, rank, step])
    return rng.multinomial(batch_size, weights, size=micro_batches)


def source_seed(seed: int, source: int) -> int:
    """The seed of source `source`'s stream (its unit orders and blocks), apart from the
    other sources'."""
    return int(np.random.default_rng([seed, _MIXING, source]).integers(1 << 62))


@dataclass
class MixedState:
    """A mixture reader's position: its `steps` handed out, and each source's reader state."""

    steps: int = 0
    sources: list[ReaderState] = field(default_factory=list)

    @classmethod
    def fresh(cls, count: int) -> MixedState:
        return cls(0, [ReaderState() for _ in range(count)])

    def to_dict(self) -> dict:
        """As a checkpoint holds it (`ReaderState.to_dict` per source)."""
        return {"steps": self.steps, "sources": [s.to_dict() for s in self.sources]}

    @classmethod
    def from_dict(cls, state: dict) -> MixedState:
        return cls(int(state["steps"]), [ReaderState.from_dict(s) for s in state["sources"]])


@dataclass
class MixedRecord:
    """What a loader worker sends with a mixture step: the reader, its steps handed out after
    it, and per source the record of the last row taken (None: no row of it in the step)."""

    reader: int
    worker: int
    steps: int
    sources: list[StepRecord | None]

    def after(self, before: MixedState) -> MixedState:
        """The reader's state after this step, from its state `before` it."""
        pairs = zip(self.sources, before.sources, strict=True)
        return MixedState(self.steps, [b if r is None else r.after(b) for r, b in pairs])


def last_row(records: list[StepRecord]) -> StepRecord | None:
    """One record for the rows a step took of a source: the last row's position, with the carry
    sent by the last of them that began a block (None when none did)."""
    if not records:
        return None
    carries = [r.carry for r in records if r.carry is not None]
    return dataclasses.replace(records[-1], carry=carries[-1] if carries else None)


def with_step_totals(micro: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The micro-batches of a step, each carrying the step's totals (`STEP_TOTAL`): the sums of
    the micro-batches' own (their rows' summed by `merge_batches`)."""
    names = [name for name in micro[0] if name.startswith(STEP_TOTAL)]
    totals = {name: np.array(sum(int(b[name]) for b in micro), np.int64) for name in names}
    return [batch | totals for batch in micro]


class MixedStreamBatches(IterableDataset):
    """One rank's stream of mixture steps: each item is (`MixedRecord`, the step's
    micro-batches).

    Args:
        sources: each source's stream of single rows (`StreamBatches`, batch_size 1).
        weights: (S,) each source's share of the rows (normalized).
        pad_id: the padding id BERT rows of different widths are merged with.
        batch_size, micro_batches: rows per micro-batch, micro-batches per optimizer step.
        seed, rank: the data seed and this process's rank.
    """

    def __init__(
        self,
        sources: list[StreamBatches],
        weights: np.ndarray,
        pad_id: int,
        *,
        batch_size: int,
        micro_batches: int,
        seed: int,
        rank: int,
    ) -> None:
        self.sources = sources
        self.weights = weights
        self.pad_id = pad_id
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        self.seed = seed
        self.rank = rank
        self.workers, self.readers = sources[0].workers, sources[0].readers
        self.resume: dict[int, MixedState] = {}  # reader -> where it starts

    def __iter__(self) -> Iterator[tuple[MixedRecord, list[dict[str, np.ndarray]]]]:
        reader, worker = worker_reader(self.rank, self.workers)
        fresh = MixedState.fresh(len(self.sources))
        return self.steps(reader, worker, self.resume.get(reader, fresh))

    def steps(
        self, reader: int, worker: int, state: MixedState
    ) -> Iterator[tuple[MixedRecord, list[dict[str, np.ndarray]]]]:
        """`reader`'s steps from `state` on (the rank's steps w, w + W, ... of worker w of W)."""
        pairs = zip(self.sources, state.sources, strict=True)
        rows = [source.steps(reader, worker, start) for source, start in pairs]
        done = state.steps
        while True:
            step = done * self.workers + worker
            counts = step_rows(
                self.seed, self.rank, step, self.weights, self.batch_size, self.micro_batches
            )
            taken: list[list[StepRecord]] = [[] for _ in self.sources]
            micro = []
            for row_counts in counts:
                parts = []
                for source, count in enumerate(row_counts):
                    for _ in range(count):
                        record, [row] = next(rows[source])
                        taken[source].append(record)
                        parts.append(row)
                micro.append(merge_batches(parts, self.pad_id))
            done += 1
            record = MixedRecord(reader, worker, done, [last_row(t) for t in taken])
            yield record, with_step_totals(micro)


class MixedStreamedData(StreamedData):
    """The training stream and per-source validation documents of a streamed mixture (the
    arguments of `StreamedData`, `corpus` a `MixtureCorpus` by weights)."""

    state_type = MixedState

    def __init__(self, corpus: MixtureCorpus, tokenizer, settings, objective, **options) -> None:
        super().__init__(corpus, tokenizer, settings, objective, **options)
        self.names = corpus.names
        amounts = np.array([corpus.amounts[name] for name in self.names])
        self.weights = amounts / amounts.sum()
        self.parts = [
            StreamedData(source, tokenizer, settings, objective, **options)
            for source in corpus.sources.values()
        ]
        self.pad_id = BatchMaker(tokenizer).special.pad
        self.world_size = 1
        self._read: tuple[int, np.ndarray] = (0, np.zeros(len(self.names)))

    def setup(self, rank: int, world_size: int, validate: bool) -> list[MemoryStore]:
        """Each source's validation documents held out (when `validate`) and its stream of
        rows; this rank's mixed stream. Returns the sources' validation documents."""
        rows = dataclasses.replace(self.objective, batch_size=1)
        stores = []
        for number, (name, part) in enumerate(zip(self.names, self.parts, strict=True)):
            with self.corpus.naming(part.corpus):
                store, held_out = part.validation_documents(world_size) if validate else (None, 0)
            stores += [] if store is None else [store]
            part.dataset = StreamBatches(
                part.pieces,
                f"data.sources.{name}: {part.corpus.describe()}",
                self.tokenizer,
                self.settings,
                rows,
                seed=source_seed(self.seed, number),
                rank=rank,
                world_size=world_size,
                num_workers=self.num_workers,
                micro_batches=1,
                held_out=held_out,
                block_mb=self.block_mb,
            )
            log.info(
                "streaming source %s (weight %.3g): %d unit(s) of %d file(s), blocks of %.3g MB "
                "of text; %d validation documents held out",
                name,
                self.weights[number],
                len(part.dataset.units),
                len(part.pieces),
                part.dataset.block_bytes / 1e6,
                held_out,
            )
        self.dataset = MixedStreamBatches(
            [part.dataset for part in self.parts],
            self.weights,
            self.pad_id,
            batch_size=self.objective.batch_size,
            micro_batches=self.micro_batches,
            seed=self.seed,
            rank=rank,
        )
        self.world_size = world_size
        mine = range(rank * self.dataset.workers, (rank + 1) * self.dataset.workers)
        self.position = StreamPosition({r: MixedState.fresh(len(self.parts)) for r in mine}, 0)
        if self._pending is not None:
            self._apply(self._pending)
        return stores

    def validation_set(self, stores: list, make: BatchMaker, val: dict[str, Any]):
        """Every source's validation batches, taken in turn (`InterleavedBatches`), or None
        (`stores`: one per source, or none); errors name the source."""
        sets = []
        for part, store in zip(self.parts, stores, strict=False):
            with self.corpus.naming(part.corpus):
                sets.append(make(store, np.arange(store.num_documents), self.objective, **val))
        return InterleavedBatches(sets) if sets else None

    @functools.cached_property
    def corpus_key(self) -> dict[str, str]:
        """Each source's fingerprint, by name (as the store path saves a mixture's)."""
        return {name: part.corpus_key for name, part in zip(self.names, self.parts, strict=True)}

    def first_step(self) -> list[dict[str, np.ndarray]]:
        """The first reader's first step, made here, after a first row of every source: a
        source that makes none fails now, named, however seldom its weight draws it."""
        for part in self.parts:  # each source's first block is read twice: once here
            with self.corpus.naming(part.corpus):
                part.first_step()
        return next(self.dataset.steps(0, 0, MixedState.fresh(len(self.parts))))[1]

    def settings_key(self) -> dict[str, Any]:
        """`StreamedData.settings_key`, with each source's blocks, validation documents and
        units."""
        sources = [part.dataset for part in self.parts]
        return {
            "seed": self.seed,
            "readers": self.dataset.readers,
            "workers": self.dataset.workers,
            "micro_batches": self.micro_batches,
            "batch_size": self.objective.batch_size,
            "seq_len": self.objective.seq_len,
            "block_bytes": [source.block_bytes for source in sources],
            "held_out": [source.held_out for source in sources],
            "units": [len(source.units) for source in sources],
        }

    def state_dict(self, steps: int) -> dict[str, Any]:
        """`StreamedData.state_dict`, with the mixture's sampling (`MixtureCorpus.spec`)."""
        return super().state_dict(steps) | {"mixture": self.corpus.spec()}

    def refusal(self, state: dict[str, Any]) -> str | None:
        """Why this run cannot resume `state`: other weights or sources, or an edited source."""
        return sources_changed(state, self.corpus, self.corpus_key)

    def training_documents(self, world_size: int = 1) -> Iterator[np.ndarray]:
        """Every source's training documents, one source after another."""
        for part in self.parts:
            yield from part.training_documents(world_size)

    def progress(self, steps: int) -> dict[str, dict[str, float]]:
        """Per source, the sequences and tokens that the first `steps` steps of every rank
        read (counted on from the last call)."""
        counted, read = self._read
        if steps < counted:
            counted, read = 0, np.zeros(len(self.names))
        for step in range(counted, steps):
            for rank in range(self.world_size):
                drawn = step_rows(
                    self.seed,
                    rank,
                    step,
                    self.weights,
                    self.objective.batch_size,
                    self.micro_batches,
                )
                read = read + drawn.sum(axis=0)
        self._read = (steps, read)
        return {
            name: {"sequences": float(read[s]), "tokens": float(read[s] * self.item_tokens[s])}
            for s, name in enumerate(self.names)
        }

    @functools.cached_property
    def item_tokens(self) -> list[float]:
        """Each source's mean tokens per item, from its first block (of reader 0) read here."""
        found = []
        for part in self.parts:
            blocks = part.dataset.blocks(0, ReaderState())
            found.append(next(s for _, s, _ in blocks if len(s)).batches.item_tokens())
        return found


def streamed_data(corpus, tokenizer, settings, objective, **options) -> StreamedData:
    """The stream of `corpus` (one corpus, or a `MixtureCorpus`) with `StreamedData`'s
    arguments.

    Raises:
        DataSetupError: when `corpus` and `objective` cannot be streamed (`streaming_refusal`).
    """
    if refusal := streaming_refusal(corpus, objective):
        raise DataSetupError(refusal)
    kind = MixedStreamedData if isinstance(corpus, MixtureCorpus) else StreamedData
    return kind(corpus, tokenizer, settings, objective, **options)
