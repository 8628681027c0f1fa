"""Pre-training objectives: what training examples are built from the token stream and how.

`conf/objective/*.yaml` instantiates one of these; values are checked here so that a bad setting
fails before any work starts, with the config key in the message.

Phases: `objective.phases` splits the run's optimizer steps into consecutive phases that change
some of the objective's settings, as BERT is trained (90% of the steps at 128 tokens with 20
predictions, the last 10% at 512 tokens with 80):

    phases:
      - {share: 0.9}
      - {share: 0.1, seq_len: 512, max_predictions_per_seq: 80}

Each phase is the objective with its overrides (`share`: its part of `trainer.max_steps`; the
shares add up to 1). `phase_plan` turns them into step ranges.

What differs between objectives in the data path (how a corpus is stored, how batches are made,
what a validation split needs, how a stream is cut, how many passes are too many) is behaviour
of the objective classes (`Objective`): nothing else in `datamodules/` or `pipeline/` asks which
objective a run has, besides the family registry that pairs a model with its objective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from tokenizers import Tokenizer

from datamodules.objectives.batches import VAL, BatchMaker, EpochBatches
from datamodules.objectives.bert_batches import BertBatches, require_pairs, too_few_for_pairs
from datamodules.objectives.gpt_batches import GPTBatches, require_window, too_little_for_a_window
from datamodules.objectives.masking import MLMMasker
from datamodules.objectives.splits import Shortage
from datamodules.stores.store import StoreSettings, TokenStore
from tokenizer import special_ids, tokenizer_kind


def _check_fraction(name: str, value: float, *, open_low: bool = False) -> None:
    low_ok = value > 0 if open_low else value >= 0
    if not (low_ok and value <= 1):
        bound = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"objective.{name} must be in {bound}, got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"objective.{name} must be a positive integer, got {value!r}")


class Objective:
    """A pretraining objective: its settings, and all that the data path does differently for
    it. A new objective subclasses this as a dataclass with at least the fields

        seq_len: tokens of the longest item (special tokens included).
        batch_size: items per batch (per device).
        phases: consecutive shares of the run's steps with other settings (module docstring),
            checked in `__post_init__` by `self.phases = check_phases(self)`.

    and implements `store_settings` and `make_batches`. The other members have defaults that
    fit an objective whose items are built document by document and need nothing of a split
    but one document.

    Attributes:
        many_passes: the most passes over its training text a run is not warned about
            (`pipeline.pretrain.passes`); None: no limit.
        run_settings: fields that hold for the whole run, which a phase may not change.
        packed: its items are the consecutive windows of `seq_len` + 1 tokens (one more
            target) of the split's documents packed into one stream, each ended by the
            store's `eos_id` (`packing.PackedStream`): a streamed run then cuts its blocks into
            whole windows and carries the tokens short of a step into the next block, instead
            of making items of each block's documents (`datamodules.streaming.read`).
    """

    seq_len: int
    batch_size: int
    phases: list[dict[str, Any]] | None

    many_passes: ClassVar[float | None] = None
    run_settings: ClassVar[tuple[str, ...]] = ()
    packed: ClassVar[bool] = False

    def store_settings(self, tokenizer: Tokenizer) -> StoreSettings:
        """What the objective needs in a token store made with `tokenizer` (sentence offsets, a
        separator after every document); part of the store's cache key.

        Raises:
            ValueError: a tokenizer the objective cannot use, naming the one that fits.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not say what it needs in a token store: implement "
            "store_settings (datamodules.objectives.objective.Objective)"
        )

    def make_batches(
        self, store: TokenStore, documents: np.ndarray, maker: BatchMaker, **shard: Any
    ) -> EpochBatches:
        """`store`'s `documents` (one split) as this objective's batches; `maker` holds the
        tokenizer's tables (special ids, vocabulary size, bytes per token); `shard`: the
        keywords of `EpochBatches` (split, shuffle, rank, world_size, seed). The batches'
        `loss_counts` name what the family's LightningModule's loss terms average over.

        Raises:
            DataSetupError: the documents make no item (as `check_split` says).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not say how its batches are made: implement "
            "make_batches (datamodules.objectives.objective.Objective)"
        )

    @property
    def documents_per_split(self) -> int:
        """The fewest documents a training or validation split may have."""
        return 1

    def validation_tokens(self, world_size: int) -> int:
        """The fewest tokens the validation documents held out of a corpus must hold, for a
        run of `world_size` processes (`split_store`, and a stream's held-out documents)."""
        return 0

    def check_split(self, split: int, store: TokenStore, documents: np.ndarray) -> None:
        """Raise `DataSetupError` unless `store`'s `documents` make at least one item of
        `split` (TRAIN or VAL), from their lengths only (cheap): what `make_batches` would
        find, said before a run writes anything."""

    def too_few_documents(self, short: Shortage) -> str | None:
        """What to say when a corpus is too few for this objective's splits (`short`), when
        the objective is the reason; None: the general message (`splits.validation_too_few`)."""
        return None


@dataclass
class MaskedLMObjective(Objective):
    """BERT: masked language modelling plus next-sentence prediction.

    Attributes:
        seq_len: length of an instance, special tokens included (128 in the BERT recipe).
        batch_size: instances per batch (per device).
        mlm_probability: share of eligible tokens chosen for prediction.
        mask_replace_prob: of the chosen tokens, the share replaced by [MASK].
        random_replace_prob: of the chosen tokens, the share replaced by a random token; the rest
            stay unchanged.
        max_predictions_per_seq: cap on chosen tokens per instance (20 at seq 128).
        next_sentence_prediction: build A/B pairs with 50% random B and train the NSP head.
        short_seq_prob: share of instances with a shorter random target length.
        whole_word_masking: choose whole words (all their word pieces) instead of pieces.
        phases: consecutive shares of the run's steps with other settings (module docstring).
    """

    seq_len: int = 128
    batch_size: int = 32
    mlm_probability: float = 0.15
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    max_predictions_per_seq: int = 20
    next_sentence_prediction: bool = True
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False
    phases: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        _check_positive("seq_len", self.seq_len)
        _check_positive("batch_size", self.batch_size)
        _check_positive("max_predictions_per_seq", self.max_predictions_per_seq)
        if self.seq_len < 8:
            raise ValueError(f"objective.seq_len={self.seq_len} is too short for A/B pairs (>= 8)")
        _check_fraction("mlm_probability", self.mlm_probability, open_low=True)
        _check_fraction("mask_replace_prob", self.mask_replace_prob)
        _check_fraction("random_replace_prob", self.random_replace_prob)
        _check_fraction("short_seq_prob", self.short_seq_prob)
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError(
                "objective.mask_replace_prob + objective.random_replace_prob must be <= 1, got "
                f"{self.mask_replace_prob} + {self.random_replace_prob}"
            )
        self.phases = check_phases(self)

    # New masks each pass make a pass repeat less; BERT itself was trained for about 40.
    many_passes: ClassVar[float] = 40.0
    # NSP decides the validation split and whether the model trains its NSP head
    run_settings: ClassVar[tuple[str, ...]] = ("next_sentence_prediction",)

    def store_settings(self, tokenizer: Tokenizer) -> StoreSettings:
        if (kind := tokenizer_kind(tokenizer)) != "wordpiece":
            raise ValueError(
                f"the masked-LM objective needs a wordpiece tokenizer ([CLS], [SEP], [MASK]), "
                f"got a {kind} tokenizer; use tokenizer=wordpiece"
            )
        return StoreSettings(sentences=True)  # NSP pairs sentences

    def make_batches(
        self, store: TokenStore, documents: np.ndarray, maker: BatchMaker, **shard: Any
    ) -> EpochBatches:
        continuation = maker.continuation if self.whole_word_masking else None
        masker = MLMMasker(self, maker.special, maker.vocab_size, continuation)
        return BertBatches(store, documents, self, masker, maker.special, **shard)

    @property
    def documents_per_split(self) -> int:
        # half of the NSP pairs take their second sentence from another document
        return 2 if self.next_sentence_prediction else 1

    def validation_tokens(self, world_size: int) -> int:
        # pairs hold 2 documents out; single segments a window's text for every process
        return 0 if self.next_sentence_prediction else world_size * self.seq_len + 1

    def check_split(self, split: int, store: TokenStore, documents: np.ndarray) -> None:
        if self.next_sentence_prediction:
            require_pairs(split, np.diff(store.doc_sentences)[documents])

    def too_few_documents(self, short: Shortage) -> str | None:
        return too_few_for_pairs(short) if self.next_sentence_prediction else None


@dataclass
class CausalLMObjective(Objective):
    """GPT: next-token prediction on packed windows.

    Attributes:
        seq_len: tokens per window (inputs; targets are shifted by one).
        batch_size: windows per batch (per device).
        document_masking: restrict attention to the current document within a window.
        phases: consecutive shares of the run's steps with other settings (module docstring).
    """

    seq_len: int = 256
    batch_size: int = 16
    document_masking: bool = False
    phases: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        _check_positive("seq_len", self.seq_len)
        _check_positive("batch_size", self.batch_size)
        self.phases = check_phases(self)

    # Muennighoff et al. 2023: up to about 4 passes are almost as good as new text
    many_passes: ClassVar[float] = 4.0
    packed: ClassVar[bool] = True

    def store_settings(self, tokenizer: Tokenizer) -> StoreSettings:
        return StoreSettings(sentences=False, eos_id=special_ids(tokenizer).document_separator)

    def make_batches(
        self, store: TokenStore, documents: np.ndarray, maker: BatchMaker, **shard: Any
    ) -> EpochBatches:
        # validation batches count the bytes of text they predict (for bits per byte)
        counts = maker.token_bytes if shard["split"] == VAL else None
        return GPTBatches(store, documents, self, token_bytes=counts, **shard)

    def validation_tokens(self, world_size: int) -> int:
        return world_size * self.seq_len + 1  # a window (and its last target) per process

    def check_split(self, split: int, store: TokenStore, documents: np.ndarray) -> None:
        require_window(split, int(np.diff(store.doc_offsets)[documents].sum()), self.seq_len)

    def too_few_documents(self, short: Shortage) -> str | None:
        return too_little_for_a_window(short, self.seq_len)


SHARE = "share"


@dataclass(frozen=True)
class Phase:
    """One phase of a run: optimizer steps [first_step, end_step) trained with `objective`
    (`end_step` None: to the end of the run)."""

    index: int
    first_step: int
    end_step: int | None
    objective: Objective


def check_phases(objective: Objective) -> list[dict[str, Any]] | None:
    """The phases as plain dicts, each checked by building its objective; shares add up to 1."""
    if not objective.phases:
        return None
    fields = {f.name for f in dataclasses.fields(objective)} - {"phases", *objective.run_settings}
    phases = [dict(phase) for phase in objective.phases]
    for number, phase in enumerate(phases):
        unknown = sorted(set(phase) - fields - {SHARE})
        if unknown:
            raise ValueError(
                f"objective.phases[{number}] has unknown key(s) {unknown}; a phase takes "
                f"{SHARE!r} and any of {sorted(fields)}"
            )
        share = phase.get(SHARE)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(
                f"objective.phases[{number}].share must be a fraction of the run's steps in "
                f"(0, 1], got {share!r}; e.g. objective.phases=[{{share: 0.9}},{{share: 0.1,"
                "seq_len: 512}]"
            )
        try:
            _phase_objective(objective, phase)
        except ValueError as err:
            raise ValueError(f"objective.phases[{number}]: {err}") from err
    total = sum(phase[SHARE] for phase in phases)
    if abs(total - 1) > 1e-6:
        raise ValueError(
            f"the shares of objective.phases add up to {total:g}, not 1; give each phase its "
            "part of trainer.max_steps so that they cover the run"
        )
    return phases


def _phase_objective(objective: Objective, phase: dict[str, Any]) -> Objective:
    settings = {key: value for key, value in phase.items() if key != SHARE}
    return dataclasses.replace(objective, phases=None, **settings)


def phase_plan(objective: Objective, max_steps: int | None) -> list[Phase]:
    """The run's phases as step ranges: one phase (the objective) without `phases`; else each
    phase gets `round` of its cumulative share of `max_steps`, and the last runs to the end.

    Raises:
        ValueError: phases without a step count, or a phase that gets no step.
    """
    if not objective.phases:
        return [Phase(0, 0, None, objective)]
    if not max_steps or max_steps <= 0:
        raise ValueError(
            "objective.phases split trainer.max_steps, which is not set; set trainer.max_steps"
        )
    plan, first, cumulative = [], 0, 0.0
    for index, settings in enumerate(objective.phases):
        cumulative += settings[SHARE]
        last = index == len(objective.phases) - 1
        end = max_steps if last else round(cumulative * max_steps)
        if end <= first:
            raise ValueError(
                f"objective.phases[{index}] gets no step of trainer.max_steps={max_steps}; "
                "raise trainer.max_steps or the phase's share"
            )
        phase_objective = _phase_objective(objective, settings)
        plan.append(Phase(index, first, None if last else end, phase_objective))
        first = end
    return plan


def longest_seq_len(objective: Objective) -> int:
    """The longest sequence the objective trains, over its phases."""
    phases = objective.phases or [{}]
    return max(_phase_objective(objective, phase).seq_len for phase in phases)


def trained_seq_len(phases: list[Phase], steps_done: int) -> int:
    """The longest sequence trained after `steps_done` optimizer steps: that of the phases
    that have made at least one step (the first phase's before any)."""
    started = [p for p in phases if p.first_step < steps_done] or phases[:1]
    return max(p.objective.seq_len for p in started)


def passes_over(phases: list[Phase], steps_per_pass: list[int], steps: int) -> float:
    """How many times `steps` optimizer steps go through the training text, each phase's steps
    over its own batches (`steps_per_pass`, one count per phase) and summed: the phases read
    the same text, in windows of their own length."""
    total = 0.0
    for phase, per_pass in zip(phases, steps_per_pass, strict=True):
        end = steps if phase.end_step is None else min(steps, phase.end_step)
        total += max(0, end - phase.first_step) / max(1, per_pass)
    return total
