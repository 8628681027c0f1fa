"""Batches of a mixture of corpora: each source's batches blended by weight into every training
batch (`MixtureBatches`), and validation batches taken in turn from each source
(`InterleavedBatches`). How the sources are weighted and sampled: `datamodules.corpora.mixture`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from datamodules.objectives.batches import EpochBatches, merge_batches

log = logging.getLogger(__name__)

VAL_SOURCE = "val_source"  # key of a validation batch's source index (a 0-d array)


def blend(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interleave `counts[s]` items of each source evenly: (source, rank within the source) of
    every slot, item j of source s at time (j + 0.5) / counts[s] (ties by source)."""
    source = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    order = np.lexsort((source, (rank + 0.5) / counts[source]))
    return source[order], rank[order]


class MixtureBatches(EpochBatches):
    """One rank's batches of a mixture epoch, drawn from every source's items.

    Args:
        sources: each source's batches of this split and phase (unsharded: rank 0 of 1, so that
            their items are the whole source; the mixture shards its slots).
        per_epoch: (S,) items each source gives a mixture epoch (`MixtureCorpus.items_per_epoch`).
        pad_id: the padding id BERT rows of different widths are merged with.
        **shard: the keyword arguments of `EpochBatches` (batch size, rank, seed, ...).
    """

    def __init__(
        self,
        sources: list[EpochBatches],
        per_epoch: np.ndarray,
        pad_id: int,
        batch_size: int,
        **shard,
    ) -> None:
        super().__init__(batch_size, **shard)
        self.sources = sources
        self.per_epoch = np.asarray(per_epoch, dtype=np.int64)
        self.source_items = np.array([s.plan.num_items for s in sources], dtype=np.int64)
        self.pad_id = pad_id
        self.slot_source, self.slot_rank = blend(self.per_epoch)
        self.item_tokens = [s.item_tokens() for s in sources]  # once: BERT's reads epoch 0
        self._counted: tuple[int, int, np.ndarray] = (-1, 0, np.zeros(len(sources), np.int64))
        self.set_num_items(int(self.per_epoch.sum()))

    def _make_order(self, epoch: int) -> np.ndarray:
        return np.arange(self.plan.num_items)  # the blend; each source shuffles its own items

    def make_batch(
        self, epoch: int, items: np.ndarray, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        source = self.slot_source[items]
        overall = epoch * self.per_epoch[source] + self.slot_rank[items]
        source_epoch, index = np.divmod(overall, self.source_items[source])
        parts = []
        for s, e in sorted(set(zip(source.tolist(), source_epoch.tolist(), strict=True))):
            chosen = index[(source == s) & (source_epoch == e)]
            dataset = self.sources[s]
            parts.append(dataset.make_batch(e, dataset.order(e)[chosen], rng))
        return merge_batches(parts, self.pad_id)

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        return self.sources[0].loss_counts(batch)

    def consumed(self, epoch: int, batches: int) -> np.ndarray:
        """(S,) items of each source read by the first `batches` batches (of every rank) of
        mixture epoch `epoch`."""
        slots = min(batches * self.batch_size * self.world_size, self.plan.num_items)
        # counted on from the last call (once per training step): the slots since then only
        last_epoch, start, partial = self._counted
        if last_epoch != epoch or start > slots:
            start, partial = 0, np.zeros(len(self.sources), dtype=np.int64)
        partial = partial + np.bincount(self.slot_source[start:slots], minlength=len(self.sources))
        self._counted = (epoch, slots, partial)
        return epoch * self.per_epoch + partial

    def source_epochs(self) -> np.ndarray:
        """(S,) passes over each source that one mixture epoch makes."""
        return self.per_epoch / self.source_items

    def progress(self, names: list[str], epoch: int, batches: int) -> dict[str, dict[str, float]]:
        """Per source, what training has read by batch `batches` of mixture epoch `epoch` (all
        processes together): sequences, tokens (BERT: sequences x the source's mean sequence
        length) and epochs of the source."""
        read = self.consumed(epoch, batches)
        return {
            name: {
                "sequences": float(read[s]),
                "tokens": float(read[s] * self.item_tokens[s]),
                "epochs": float(read[s] / self.source_items[s]),
            }
            for s, name in enumerate(names)
        }


def mixture_batches(
    sources: list[EpochBatches], mixture, names: list[str], pad_id: int, shard: dict[str, Any]
) -> MixtureBatches:
    """One rank's training batches of a mixture (`MixtureCorpus`) of the sources' batches of
    one phase (unsharded), each source giving its share of every mixture epoch
    (`MixtureCorpus.items_per_epoch`, logged per source name); `shard`: `EpochBatches`'s
    keywords but the batch size, which is the sources'."""
    per_epoch = mixture.items_per_epoch([s.plan.num_items for s in sources])
    for name, count, source in zip(names, per_epoch, sources, strict=True):
        log.info(
            "source %s: %d of its %d sequences per mixture epoch (%.3g epochs of it)",
            name,
            count,
            source.plan.num_items,
            count / source.plan.num_items,
        )
    return MixtureBatches(sources, per_epoch, pad_id, sources[0].batch_size, **shard)


class InterleavedBatches(Dataset):
    """Validation of a mixture: every source's validation batches in turn (the first of each
    source, then the second of each, ...), so that a run validating on its first batches only
    (`trainer.limit_val_batches`) still sees every source. Each batch is tagged with its
    source's index (`VAL_SOURCE`), so that the loss is logged overall and per source. Keyed like
    `EpochBatches` by (epoch, batch index)."""

    def __init__(self, sources: list[EpochBatches]) -> None:
        self.sources = sources
        counts = [len(s) for s in sources]
        source = np.repeat(np.arange(len(sources)), counts)
        index = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
        order = np.lexsort((source, index))
        self.source, self.index = source[order], index[order]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        epoch, index = key
        s = int(self.source[index])
        batch = self.sources[s][(epoch, int(self.index[index]))]
        return batch | {VAL_SOURCE: np.array(s, dtype=np.int64)}
