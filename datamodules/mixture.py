"""Weighted mixtures of corpora: several named sources, each sampled by a share or an epoch count.

    make pretrain data=mixture          # conf/data/mixture.yaml: WikiText-2 0.8, GLUE texts 0.2

A `MixtureCorpus` names its sources (each any corpus of `datamodules.corpus`) and says how much of
each to train on, either `weights` (each source's share of the training sequences, normalized) or
`epochs` (passes over each source per mixture epoch: 3 upsamples a small clean source, 0.1 takes a
tenth of a large one). Each source keeps its own token store, cached and shared with every other
run over that corpus, and its own validation documents.

Sampling. A source of N_s items per epoch (GPT windows, BERT NSP instances) contributes M_s items
to each mixture epoch: `round(epochs_s * N_s)`, or `round(share_s * sum N)` with weights. The M
slots of a mixture epoch are the sources' items interleaved evenly (`blend`): slot order sorts
item j of source s by (j + 0.5) / M_s, so every stretch of the epoch, and so every batch, holds the
sources in proportion. Source s's items run on across mixture epochs in its own seeded orders:
its k-th item overall is item k mod N_s of its epoch k div N_s. Everything is a function of
(seed, mixture epoch, slot), as for a single corpus, so a resumed run gets exactly the batches of
the uninterrupted one, and how far each source has been read follows from the position alone
(`MixtureBatches.consumed`).

Sources never share a sequence: a GPT window is packed from one source's documents, a BERT pair
from one source's sentences (the random second sentence comes from another document of the same
source). A batch mixes sources by rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from datamodules.batches import DataSetupError, EpochBatches, merge_batches
from datamodules.corpus import CorpusError

VAL_SOURCE = "val_source"  # key of a validation batch's source index (a 0-d array)


@dataclass
class MixtureCorpus:
    """Named corpora sampled by weight or by epoch count (see the module notes).

    Attributes:
        sources: name -> corpus (in a config: `defaults` entries `/data@sources.<name>: <data
            config>`, as `conf/data/mixture.yaml` does).
        weights: name -> share of the training sequences (normalized to sum 1); or
        epochs: name -> passes over the source per mixture epoch. Give one of the two for every
            source (neither is refused: the docs ask for one, and a silent default hid it).
    """

    sources: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, float] | None = None
    epochs: dict[str, float] | None = None

    def __post_init__(self) -> None:
        self.sources = dict(self.sources)
        if not self.sources:
            raise CorpusError(
                "data.sources is empty; name at least one corpus, e.g. a defaults entry "
                "`/data@sources.wiki: wikitext2` (conf/data/mixture.yaml)"
            )
        if self.weights is not None and self.epochs is not None:
            raise CorpusError(
                "data.weights and data.epochs are both set; give each source a share "
                "(data.weights) or a number of passes (data.epochs), not both: to sample by "
                "epochs, add data.weights=null (conf/data/mixture.yaml sets weights)"
            )
        if self.weights is None and self.epochs is None:
            each = ", ".join(f"{name}: 1" for name in self.sources)
            raise CorpusError(
                "data.weights and data.epochs are both null: say how much of each source to "
                f"train on, as its share of the training sequences ('data.weights={{{each}}}') "
                "or as passes over it per mixture epoch ('data.epochs={"
                f"{each}}}': each source once, its natural share)"
            )
        key = "data.weights" if self.weights is not None else "data.epochs"
        given = dict(self.weights if self.weights is not None else self.epochs)
        missing = [n for n in self.sources if n not in given]
        unknown = [n for n in given if n not in self.sources]
        if missing or unknown:
            raise CorpusError(
                f"{key} must name every source of data.sources ({', '.join(self.sources)}) and "
                f"no other: {'missing ' + ', '.join(missing) if missing else ''}"
                f"{'; ' if missing and unknown else ''}"
                f"{'unknown ' + ', '.join(unknown) if unknown else ''}; replace the whole "
                "mapping (Hydra refuses a key that is not in it), e.g. "
                + f"ARGS=\"{key}=null '{key}"
                + "={"
                + ", ".join(f"{n}: {given.get(n, 1)}" for n in self.sources)
                # make keeps only the last of two assignments of one variable: in ARGS both stay
                + "}'\" (after make; after python -m, the two words alone)"
            )
        for name, value in given.items():
            if not (isinstance(value, int | float) and np.isfinite(value) and value > 0):
                raise CorpusError(
                    f"{key}.{name}={value!r} is not a positive number; leave the source out "
                    f'with ARGS="~data.sources.{name} ~{key}.{name}" (after make; after python '
                    f"-m, the two words alone), or give it e.g. {key}.{name}=1"
                )
        self.by_epochs = self.weights is None
        self.amounts = {name: float(given[name]) for name in self.sources}

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    def documents(self) -> Iterator[str]:
        """Every source's documents, one source after another (what the tokenizer trains on)."""
        for corpus in self.sources.values():
            with self.naming(corpus):
                yield from corpus.documents()

    @contextlib.contextmanager
    def naming(self, corpus) -> Iterator[None]:
        """Errors about the source `corpus` (bad input, too few documents) name it, and their
        hints name its own keys (`data.sources.<name>.errors=replace`, `source_keys`)."""
        name = next(n for n, c in self.sources.items() if c is corpus)
        try:
            yield
        except (CorpusError, DataSetupError) as err:
            settings = [f.name for f in fields(corpus)] if is_dataclass(corpus) else []
            raise type(err)(source_keys(str(err), f"data.sources.{name}", settings)) from None

    def fingerprint(self) -> str:
        """The sources' fingerprints: the weights decide the sampling, not the text, and stay
        out of it (a reweighted mixture reuses its tokenizer)."""
        parts = [[name, corpus.fingerprint()] for name, corpus in self.sources.items()]
        payload = json.dumps([type(self).__name__, parts]).encode()
        return hashlib.sha256(payload).hexdigest()[:16]

    def describe(self) -> str:
        unit = "epochs" if self.by_epochs else "weight"
        return "mixture of " + " + ".join(
            f"{name} ({unit} {self.amounts[name]:g}: {corpus.describe()})"
            for name, corpus in self.sources.items()
        )

    def spec(self) -> dict[str, Any]:
        """What fixes the sampling (compared on resume)."""
        return {
            "sources": self.names,
            "by": "epochs" if self.by_epochs else "weights",
            "amounts": [self.amounts[n] for n in self.names],
        }

    def items_per_epoch(self, available: list[int]) -> np.ndarray:
        """(S,) items each source gives a mixture epoch, from the items of one of its epochs."""
        sizes = np.asarray(available, dtype=np.float64)
        amounts = np.array([self.amounts[n] for n in self.names])
        wanted = amounts * sizes if self.by_epochs else amounts / amounts.sum() * sizes.sum()
        return np.maximum(1, np.round(wanted)).astype(np.int64)


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


def source_keys(message: str, prefix: str, settings: list[str]) -> str:
    """`message`, an error about the corpus configured at `prefix` (`data.sources.<name>`),
    written as for a corpus at `data`: its hints' keys of `settings` (`data.errors=replace`)
    moved under `prefix` (`data.sources.<name>.errors=replace`) so that they work when pasted,
    and `prefix` put in front unless the message starts with one of them. A path that looks
    like a key (`data.errors` after a `/` or a quote, or followed by `:`) is left alone."""
    if settings:
        names = "|".join(re.escape(setting) for setting in settings)
        key = re.compile(rf"(?<![\w./~'\"-])data\.({names})(?![\w:-]|\.\w)")
        message = key.sub(lambda found: f"{prefix}.{found[1]}", message)
    return message if message.startswith(f"{prefix}.") else f"{prefix}: {message}"


def resume_overrides(spec: dict[str, Any]) -> str:
    """The overrides that give a run the sampling of `spec` (`MixtureCorpus.spec`), whichever
    of weights and epochs the config it is added to sets: the other is nulled, and the whole
    mapping is given (a dotted key into a null mapping is refused by Hydra)."""
    other = "epochs" if spec["by"] == "weights" else "weights"
    pairs = ", ".join(f"{n}: {a:g}" for n, a in zip(spec["sources"], spec["amounts"], strict=True))
    return f"data.{other}=null 'data.{spec['by']}={{{pairs}}}'"


def mixture_changed(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> str:
    """Why a run cannot resume the data position of a checkpoint sampled another way."""

    def said(spec: dict[str, Any] | None) -> str:
        if spec is None:
            return "one corpus"
        pairs = ", ".join(
            f"{n} {a:g}" for n, a in zip(spec["sources"], spec["amounts"], strict=True)
        )
        return f"a mixture by {spec['by']} ({pairs})"

    fix = "resume with the checkpoint's data settings"
    if saved is not None:
        fix += f" (add {resume_overrides(saved)})"
    return (
        f"cannot resume the data position: the checkpoint sampled {said(saved)}, this run "
        f"{said(now)}, and the position means nothing under other weights. {fix}; or train "
        "with the new mixture in a new run (another run_name)"
    )
