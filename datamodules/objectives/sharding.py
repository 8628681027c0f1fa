"""Validation split, per-rank sharding and the resumable sampler.

Everything here is a pure function of (seed, epoch, rank, world size): no state hides in a
random generator that advances as batches are drawn, which is what makes a resumed run see
exactly the batches the uninterrupted run would have seen next, whatever the number of
DataLoader workers.

Sharding: an epoch is a fixed-size list of items (NSP instances or GPT windows) in a seeded
order. Global batch g holds items [g * B * W, (g + 1) * B * W) of that order and rank r takes
the r-th slice of B. The last, partial global batch is split as evenly as possible, so all ranks
take the same number of steps (DDP needs that) and together cover every item once; only when
fewer items than ranks remain (< W items) are those left out of the epoch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DistributedSampler


def split_documents(
    doc_lengths: np.ndarray,
    val_fraction: float,
    seed: int,
    *,
    min_val: int = 1,
    min_val_tokens: int = 0,
    min_train: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out a seeded random share of whole documents for validation.

    Documents are taken in a seeded random order: `round(val_fraction * D)` of them, at least
    `min_val`, and more while the held-out text is shorter than `min_val_tokens` (so a tiny
    corpus still yields a usable validation split). A change to which documents it holds out
    bumps `datamodules.objectives.splits.TRAINING_DOCUMENTS_FORMAT` (caches of training text
    follow it).

    Args:
        doc_lengths: (D,) tokens per document of the store.
        val_fraction: share held out, in [0, 1); 0 gives no validation documents.
        seed: the run's data seed.
        min_val: fewest validation documents when val_fraction > 0 (2 for NSP pairs).
        min_val_tokens: fewest validation tokens when val_fraction > 0 (a GPT window).
        min_train: fewest training documents (2 for NSP pairs).

    Returns:
        (train, val) sorted document indices; every document is in exactly one.

    Raises:
        ValueError: the fraction is out of range.
        TooFewDocuments: the corpus is too small for it.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"data val_fraction must be in [0, 1), got {val_fraction!r}")
    lengths = np.asarray(doc_lengths)
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(lengths))
    num_val = 0
    if val_fraction > 0:
        num_val = max(min_val, round(val_fraction * len(lengths)))
        enough = np.cumsum(lengths[order]) >= min_val_tokens
        num_val = max(num_val, int(np.argmax(enough)) + 1 if enough.any() else len(lengths))
    if len(lengths) - num_val < min_train:
        raise TooFewDocuments(len(lengths), num_val, min_train)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


class TooFewDocuments(ValueError):
    """`split_documents` cannot hold out `held_out` documents and keep `min_train`: the caller,
    which knows why it needs them and which settings fix it, explains (`PretrainDataModule`)."""

    def __init__(self, documents: int, held_out: int, min_train: int) -> None:
        self.documents, self.held_out, self.min_train = documents, held_out, min_train
        super().__init__(
            f"the corpus has {documents} document(s): too few to hold out {held_out} for "
            f"validation and keep {min_train} for training"
        )


@dataclass(frozen=True)
class ShardPlan:
    """How one epoch's items are cut into per-rank batches.

    Attributes:
        num_items: items in the epoch.
        batch_size: items per rank per full batch.
        world_size: number of ranks.
    """

    num_items: int
    batch_size: int
    world_size: int = 1

    @property
    def num_batches(self) -> int:
        """Batches every rank gets per epoch (the same on all ranks)."""
        full, rest = divmod(self.num_items, self.batch_size * self.world_size)
        return full + (rest >= self.world_size)

    def bounds(self, index: int, rank: int) -> tuple[int, int]:
        """[start, stop) positions in the epoch order of `rank`'s batch `index`."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range (epoch has {self.num_batches})")
        step = self.batch_size * self.world_size
        full = self.num_items // step
        if index < full:
            start = index * step + rank * self.batch_size
            return start, start + self.batch_size
        base, extra = divmod(self.num_items - full * step, self.world_size)
        start = full * step + rank * base + min(rank, extra)
        return start, start + base + (rank < extra)


class EpochSampler(DistributedSampler):
    """Yields the keys (epoch, batch index) of one rank's batches, from a resume point on.

    It subclasses `DistributedSampler` only so that Lightning does not wrap it in another
    distributed sampler: it already yields this rank's share (`EpochBatches` does the
    sharding) and must not be reshuffled. `DistributedSampler.__init__` is deliberately not
    called.

    `len()` is always the full epoch, also while resuming mid-epoch: Lightning counts the
    restored batches as already done and expects the rest of the epoch. `stop` ends epochs
    early (at that batch index), for an objective phase that ends mid-epoch; `len()` then
    counts to it.

    Args:
        num_batches: batches per epoch of this rank.
        follow_epochs: take the epoch from `set_epoch` (training); False pins epoch 0
            (validation: the same batches every time).
    """

    def __init__(self, num_batches: int, follow_epochs: bool = True) -> None:
        self.num_batches = num_batches
        self.follow_epochs = follow_epochs
        self.epoch = 0
        self._resume: tuple[int, int] | None = None
        self.current: tuple[int, int] = (0, 0)
        self.stop: int | None = None

    def set_epoch(self, epoch: int) -> None:
        if self.follow_epochs:
            self.epoch = epoch
            if self._resume is not None and self._resume[0] != epoch:
                self._resume = None

    def resume(self, epoch: int, step: int) -> None:
        """Make iterations of `epoch` start at batch `step` until the epoch is finished or
        changed (a finished epoch moves to the start of the next one)."""
        if step >= self.num_batches:
            epoch, step = epoch + 1, 0
        self.epoch = epoch
        self._resume = (epoch, step)

    def finish_epoch(self) -> None:
        """The current epoch was iterated to its end: forget the resume point."""
        self._resume = None

    def next_position(self) -> tuple[int, int]:
        """(epoch, first batch) the next iteration will start at."""
        return self._resume or (self.epoch, 0)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # Read the position now, not lazily: Lightning creates the iterator (and workers
        # prefetch from it) before it calls set_epoch for a resumed epoch. The resume point is
        # not consumed here, as a DataLoader with workers calls iter() twice on creation.
        epoch, start = self.next_position()
        self.current = (epoch, start)
        return ((epoch, index) for index in range(start, len(self)))

    def __len__(self) -> int:
        return self.num_batches if self.stop is None else min(self.num_batches, self.stop)


def process_place(trainer, rank: int | None, world_size: int | None) -> tuple[int, int, bool]:
    """(rank, world size, whether this process may build stores): the Trainer's when there is
    one, else the given `rank`/`world_size`, else torch.distributed's, else 0 of 1."""
    if trainer is not None:
        return trainer.global_rank, trainer.world_size, trainer.local_rank == 0
    if rank is not None:
        return rank, world_size or 1, rank == 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return rank, torch.distributed.get_world_size(), local == 0
    return 0, 1, True
