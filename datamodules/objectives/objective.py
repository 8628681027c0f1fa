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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def _check_fraction(name: str, value: float, *, open_low: bool = False) -> None:
    low_ok = value > 0 if open_low else value >= 0
    if not (low_ok and value <= 1):
        bound = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"objective.{name} must be in {bound}, got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"objective.{name} must be a positive integer, got {value!r}")


@dataclass
class MaskedLMObjective:
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
        self.phases = _check_phases(self)


@dataclass
class CausalLMObjective:
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
        self.phases = _check_phases(self)


Objective = MaskedLMObjective | CausalLMObjective

SHARE = "share"


@dataclass(frozen=True)
class Phase:
    """One phase of a run: optimizer steps [first_step, end_step) trained with `objective`
    (`end_step` None: to the end of the run)."""

    index: int
    first_step: int
    end_step: int | None
    objective: Objective


def _check_phases(objective: Objective) -> list[dict[str, Any]] | None:
    """The phases as plain dicts, each checked by building its objective; shares add up to 1."""
    if not objective.phases:
        return None
    # NSP decides the validation split and whether the model trains its NSP head: one setting
    fields = {f.name for f in dataclasses.fields(objective)} - {
        "phases",
        "next_sentence_prediction",
    }
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
