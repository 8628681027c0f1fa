"""A fine-tuning task's encoded splits as datasets, their collators into padded batches, and the
samplers that shuffle them per epoch and shard them over ranks
(`FinetuneDataModule` serves them)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from datamodules.tasks.long_text import sample_chunks


class EncodedSplit(Dataset):
    """The encoded examples of one split, as flat token arrays plus offsets.

    Items are example indices; `PadCollator` turns a list of them into a batch.
    """

    def __init__(self, ids: list[list[int]], type_ids: list[list[int]], labels: np.ndarray):
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.ids = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=lengths.sum())
        self.type_ids = np.fromiter(
            (t for x in type_ids for t in x), dtype=np.int8, count=lengths.sum()
        )
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> int:
        return index

    def length(self, index: int) -> int:
        return int(self.offsets[index + 1] - self.offsets[index])


class PadCollator:
    """Builds a right-padded batch (padded to its longest sequence) from example indices."""

    def __init__(self, split: EncodedSplit, pad_id: int) -> None:
        self.split, self.pad_id = split, pad_id

    def __call__(self, items: Sequence[int]) -> dict[str, torch.Tensor]:
        split = self.split
        indices = np.fromiter(items, dtype=np.int64, count=len(items))
        starts, ends = split.offsets[indices], split.offsets[indices + 1]
        width = int((ends - starts).max())
        input_ids = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        type_ids = np.zeros((len(indices), width), dtype=np.int64)
        mask = np.zeros((len(indices), width), dtype=np.int64)
        for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
            n = end - start
            input_ids[row, :n] = split.ids[start:end]
            type_ids[row, :n] = split.type_ids[start:end]
            mask[row, :n] = 1
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask),
            "token_type_ids": torch.from_numpy(type_ids),
            "labels": torch.from_numpy(split.labels[indices]),
            "example_index": torch.from_numpy(indices),
        }
        return with_scored(batch, items)


class ChunkedSplit(Dataset):
    """The sliding-window chunks of one split's documents: chunk rows in an `EncodedSplit`
    (document order) and each document's range of chunk rows.

    Items are document indices, or (document, epoch) pairs from a training sampler;
    `ChunkCollator` turns a list of them into a batch.
    """

    def __init__(self, chunks: EncodedSplit, chunks_per_doc: np.ndarray, labels: np.ndarray):
        self.chunks = chunks
        self.doc_offsets = np.concatenate([[0], np.cumsum(chunks_per_doc)])
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return index

    def doc_chunks(self, doc: int) -> range:
        return range(int(self.doc_offsets[doc]), int(self.doc_offsets[doc + 1]))


class ChunkCollator:
    """A batch of whole documents: all their chunks, or `train_chunks` of each sampled from
    (seed, epoch, document) when the items carry the epoch (training)."""

    def __init__(
        self, split: ChunkedSplit, pad_id: int, seed: int, train_chunks: int | None
    ) -> None:
        self.split, self.seed, self.train_chunks = split, seed, train_chunks
        self.pad = PadCollator(split.chunks, pad_id)

    def __call__(self, items: Sequence[int | tuple[int, int]]) -> dict[str, torch.Tensor]:
        rows: list[int] = []
        chunk_doc: list[int] = []
        docs: list[int] = []
        for position, item in enumerate(items):
            doc, epoch = item if isinstance(item, tuple) else (item, None)
            chunks = self.split.doc_chunks(doc)
            if epoch is not None and self.train_chunks is not None:
                rng = np.random.default_rng([self.seed, epoch, doc])
                chunks = [chunks[i] for i in sample_chunks(len(chunks), self.train_chunks, rng)]
            rows.extend(chunks)
            chunk_doc.extend([position] * len(chunks))
            docs.append(doc)
        batch = self.pad(rows)
        batch["chunk_doc"] = torch.as_tensor(chunk_doc, dtype=torch.int64)
        batch["labels"] = torch.from_numpy(self.split.labels[docs])
        batch["example_index"] = torch.as_tensor(docs, dtype=torch.int64)
        return with_scored(batch, items)


class PairedSplit(Dataset):
    """The examples of a pair task with their two texts encoded apart (a siamese head): rows
    2i and 2i+1 of `texts` are the texts of example i. Items are example indices;
    `PairCollator` turns a list of them into a batch of 2B rows."""

    def __init__(self, texts: EncodedSplit, labels: np.ndarray) -> None:
        self.texts, self.labels = texts, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> int:
        return index


class PairCollator:
    """A batch of B pairs as 2B right-padded rows (each pair's two texts side by side), with
    one label and `example_index` per pair."""

    def __init__(self, split: PairedSplit, pad_id: int) -> None:
        self.split = split
        self.pad = PadCollator(split.texts, pad_id)

    def __call__(self, items: Sequence[int]) -> dict[str, torch.Tensor]:
        examples = np.fromiter(items, dtype=np.int64, count=len(items))
        batch = self.pad(np.stack([2 * examples, 2 * examples + 1], axis=1).reshape(-1).tolist())
        batch["labels"] = torch.from_numpy(self.split.labels[examples])
        batch["example_index"] = torch.from_numpy(examples)
        return with_scored(batch, items)


# --- sharding across processes (DDP) ---------------------------------------------------------------


class Repeat(int):
    """An example index that a rank's evaluation share repeats only so that every rank runs
    the same number of batches; it is batched like any other and not scored."""


def with_scored(batch: dict[str, torch.Tensor], items: Sequence) -> dict[str, torch.Tensor]:
    """`batch` with a `scored` mask (False for `Repeat` items) if any item is a `Repeat`."""
    if any(isinstance(item, Repeat) for item in items):
        batch["scored"] = torch.tensor([not isinstance(item, Repeat) for item in items])
    return batch


def rank_share(items: list, rank: int, world: int, repeat=lambda item: item) -> list:
    """Rank `rank`'s share of `items` among `world` processes: every world-th item from
    position `rank`, after `items` is padded to a multiple of `world` with its own first
    items (each passed through `repeat`), so that every rank gets ceil(len / world) items."""
    short = -len(items) % world
    padded = items + [repeat(items[i % len(items)]) for i in range(short)]
    return padded[rank::world]


class EpochShuffleSampler(DistributedSampler):
    """A permutation of range(n) that is a pure function of (seed, epoch), shared out among
    `world` processes (`rank_share`; the permutation is the same on every rank). Its length,
    ceil(n / world), is `DistributedSampler`'s.

    Lightning calls `set_epoch` before each training epoch; used outside Lightning, each
    iteration moves on to the next epoch's order by itself. With `with_epoch`, items are
    (index, epoch) pairs (for per-epoch chunk sampling in the collator, also in workers).
    """

    def __init__(
        self, n: int, seed: int, with_epoch: bool = False, *, rank: int = 0, world: int = 1
    ) -> None:
        super().__init__(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.n, self.with_epoch = n, with_epoch

    def __iter__(self) -> Iterator:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()
        epoch = self.epoch
        self.epoch += 1
        items = [(i, epoch) for i in order] if self.with_epoch else order
        return iter(rank_share(items, self.rank, self.num_replicas))


class EvalShardSampler(DistributedSampler):
    """range(n) in order, shared out among `world` processes (`rank_share`); the items a rank
    repeats to fill its share are `Repeat`s, so that every example is scored exactly once."""

    def __init__(self, n: int, *, rank: int = 0, world: int = 1) -> None:
        super().__init__(range(n), num_replicas=world, rank=rank, shuffle=False)
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(rank_share(list(range(self.n)), self.rank, self.num_replicas, Repeat))
