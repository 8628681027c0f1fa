"""Weighted mixtures of corpora: several named sources, each sampled by a share or an epoch count.

    make pretrain data=mixture          # conf/data/mixture.yaml: WikiText-2 0.8, GLUE texts 0.2

A `MixtureCorpus` names its sources (each any corpus of `datamodules.corpora.corpus`) and says how much of
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

from datamodules.corpora.corpus import CorpusError, DataSetupError


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
