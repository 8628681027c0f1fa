"""Datasets whose items are whole, collated batches, keyed by (epoch, batch index).

A batch is a pure function of (seed, split, epoch, batch index, rank): which items it holds
(`ShardPlan` over the epoch's seeded order) and its random masks (a generator seeded by the same
numbers). DataLoader workers therefore build exactly the batches the main process would, in any
number, and a resumed run rebuilds batch k of epoch e directly instead of replaying 0..k-1.

Items are dicts of int64 numpy arrays (`PretrainDataModule`'s loaders hand them out as torch
tensors; see `datamodules.objectives.loaders.BatchLoader` for why the conversion happens there).
Which arrays, and how they are built, is the objective's: `Objective.make_batches` returns its
subclass of `EpochBatches` (BERT's in `datamodules.objectives.bert_batches`, GPT's in
`datamodules.objectives.gpt_batches`), and `BatchMaker` holds the tokenizer's tables they use.
"""

from __future__ import annotations

import functools

import numpy as np
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.masking import continuation_table
from datamodules.objectives.sharding import ShardPlan
from datamodules.stores.store import TokenStore
from tokenizer import special_ids
from tokenizer.token_bytes import token_byte_counts

TRAIN, VAL = 0, 1  # split tags mixed into every seed, so the two never share randomness
SPLIT_NAMES = ("training", "validation")
ORDER, INSTANCES, BATCH = 1, 2, 3  # purpose tags, likewise


class EpochBatches(Dataset):
    """Base class: one rank's batches of an epoch. Subclasses say what the items are (calling
    `set_num_items` once they know how many) and how a batch of them is built.

    Args:
        batch_size: items per batch on each rank.
        rank, world_size: this process's shard.
        seed: the run's data seed (>= 0).
        split: TRAIN or VAL.
        shuffle: a new seeded item order every epoch; False keeps the natural order.
    """

    def __init__(
        self, batch_size: int, *, rank: int, world_size: int, seed: int, split: int, shuffle: bool
    ) -> None:
        if seed < 0:
            raise ValueError(f"the data seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.split = split
        self.shuffle = shuffle
        self.plan = ShardPlan(0, batch_size, world_size)
        self._orders: dict[int, np.ndarray] = {}

    def set_num_items(self, num_items: int) -> None:
        """Fix the number of items per epoch (the same every epoch)."""
        self.plan = ShardPlan(num_items, self.batch_size, self.world_size)
        self._orders = {}

    def __len__(self) -> int:
        return self.plan.num_batches

    def __getitem__(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        epoch, index = key
        rng = np.random.default_rng([self.seed, self.split, BATCH, epoch, index, self.rank])
        return self.make_batch(epoch, self.batch_items(epoch, index), rng)

    def batch_items(self, epoch: int, index: int) -> np.ndarray:
        """Item ids (into the epoch's items) of this rank's batch `index`."""
        start, stop = self.plan.bounds(index, self.rank)
        return self.order(epoch)[start:stop]

    def order(self, epoch: int) -> np.ndarray:
        """(num_items,) the epoch's item order (cached for the current and previous epoch)."""
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = self._make_order(epoch)
        return self._orders[epoch]

    def _make_order(self, epoch: int) -> np.ndarray:
        return self._arrange(epoch, self.plan.num_items)

    def _arrange(self, epoch: int, count: int) -> np.ndarray:
        """0..count-1, shuffled by the epoch's seed when the dataset shuffles."""
        if not self.shuffle:
            return np.arange(count)
        return self.rng(epoch, ORDER).permutation(count)

    def rng(self, epoch: int, purpose: int) -> np.random.Generator:
        """A generator for one purpose in one epoch, the same on every rank."""
        return np.random.default_rng([self.seed, self.split, purpose, epoch])

    def make_batch(
        self, epoch: int, items: np.ndarray, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        """How many predictions each loss term of the objective averages over in `batch`."""
        raise NotImplementedError

    def item_tokens(self) -> float:
        """Tokens per item (GPT: the window; BERT: the mean of epoch 0's instances)."""
        raise NotImplementedError


def merge_batches(parts: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """One batch of the rows of `parts` (batches of one layout), in order: (B, T) arrays padded
    to the widest (`input_ids` with `pad_id`, the rest with 0), flat `masked_positions`
    re-indexed to the merged width, per-row and per-prediction arrays concatenated, 0-d totals
    summed."""
    if len(parts) == 1:
        return parts[0]
    width = max(p["input_ids"].shape[1] for p in parts)
    merged: dict[str, np.ndarray] = {}
    for name in parts[0]:
        arrays = [p[name] for p in parts]
        if name == "masked_positions":
            rows = np.cumsum([0] + [p["input_ids"].shape[0] for p in parts])
            arrays = [
                (first + pos // p["input_ids"].shape[1]) * width + pos % p["input_ids"].shape[1]
                for first, pos, p in zip(rows, arrays, parts, strict=False)
            ]
        elif arrays[0].ndim == 2:
            fill = pad_id if name == "input_ids" else 0
            arrays = [
                np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill) for a in arrays
            ]
        elif arrays[0].ndim == 0:
            merged[name] = np.sum(arrays, dtype=arrays[0].dtype)
            continue
        merged[name] = np.concatenate(arrays)
    return merged


STEP_TOTAL = "step_total_"  # key prefix of a step's totals in its micro-batches


class LossCount:
    """Names of what a loss term averages over (`EpochBatches.loss_counts`, whose totals a step
    carries as `step_total_<name>`; the LightningModules' `loss_terms` refer to them)."""

    MASKED = "masked"  # masked tokens (MLM)
    SEQUENCES = "sequences"  # sequences (NSP)
    TARGETS = "targets"  # next-token targets (causal LM)


class StepBatches(Dataset):
    """The micro-batches of whole optimizer steps, for gradient accumulation.

    Step s of an epoch is batches s*k .. s*k+k-1 of `batches` (so the micro-batches are the
    ones a run without accumulation sees, in the same order). Each carries the step's total of
    every loss count (`step_total_<name>`, a 0-d array), so the loss can be normalized by the
    number of predictions in the whole step rather than averaged over micro-batch means. An
    epoch's last batches that do not fill a step are left out.

    Args:
        batches: one rank's batches of an epoch.
        micro_batches: batches per optimizer step (k >= 1).
    """

    def __init__(self, batches: EpochBatches, micro_batches: int) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if len(batches) < micro_batches:
            raise DataSetupError(
                f"an epoch has {len(batches)} batches per process, fewer than the "
                f"{micro_batches} micro-batches of one optimizer step; lower "
                "trainer.accumulate_grad_batches or objective.batch_size, or use more text"
            )
        self.batches = batches
        self.micro_batches = micro_batches

    def __len__(self) -> int:
        return len(self.batches) // self.micro_batches

    def __getitem__(self, key: tuple[int, int]) -> list[dict[str, np.ndarray]]:
        epoch, step = key
        first = step * self.micro_batches
        group = [self.batches[(epoch, first + i)] for i in range(self.micro_batches)]
        totals: dict[str, int] = {}
        for batch in group:
            for name, count in self.batches.loss_counts(batch).items():
                totals[name] = totals.get(name, 0) + count
        extra = {STEP_TOTAL + name: np.array(total, np.int64) for name, total in totals.items()}
        return [batch | extra for batch in group]


def as_int64(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`batch` with every array int64 and contiguous (what the loaders turn into tensors)."""
    return {name: np.ascontiguousarray(v, np.int64) for name, v in batch.items()}


class BatchMaker:
    """Makes a split's batches of a store for an objective (`Objective.make_batches`), with the
    tokenizer's tables that batches need, each computed once. Picklable (streaming's loader
    workers make their blocks' batches with it).

    Args:
        tokenizer: the run's tokenizer (special ids, vocabulary size, word continuations for
            whole-word masking, bytes per token for bits per byte).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = special_ids(tokenizer)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def continuation(self) -> np.ndarray:
        """(V,) True for the word pieces that continue a word (`continuation_table`)."""
        return continuation_table(self.tokenizer)

    @functools.cached_property
    def token_bytes(self) -> np.ndarray | None:
        """(V,) bytes of text per token id (`token_byte_counts`), for bits per byte."""
        return token_byte_counts(self.tokenizer)

    def __call__(
        self, store: TokenStore, documents: np.ndarray, objective, **shard
    ) -> EpochBatches:
        """`store`'s `documents` as batches of `objective` (an `Objective`); `shard`:
        `EpochBatches`'s keywords."""
        return objective.make_batches(store, documents, self, **shard)
