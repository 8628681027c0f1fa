"""Learning-rate schedules, as multipliers of the peak learning rate, stepped once per optimizer
step (`conf/schedule/*.yaml`; the LightningModule binds the optimizer and the total step count).

Warmup is linear and reaches the peak at the end of the warmup: step s (0-based) of warmup w runs
at (s + 1) / w of the peak, so the first update already learns (a factor of 0 would waste it).

`pace` (a `Pace`, below; a run sized to a time budget, pipeline/pretrain/budget.py) maps the
optimizer steps done to the schedule's steps: optimizer step s runs at the rate of the schedule
step that ends where it ends, `pace(s + 1) - 1` (s itself without a pace), which need not be a
whole number.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class Pace:
    """Maps optimizer steps to schedule steps: `pace(s)` is where the schedule stands once `s`
    optimizer steps are done. The schedule spans `schedule_steps`, the run plans `planned`
    optimizer steps, and each re-plan adds a knot where the mapping bends (piecewise linear,
    continuous, reaching `schedule_steps` when the planned steps are done). A run with a time
    budget re-plans as it goes (`pipeline.pretrain.budget.TimeBudget`)."""

    def __init__(self, schedule_steps: int) -> None:
        self.schedule_steps = schedule_steps
        self.planned = schedule_steps
        self.knots: list[tuple[int, float]] = [(0, 0.0)]  # (optimizer step, schedule step)

    def __call__(self, step: float) -> float:
        index = max(0, bisect_right([s for s, _ in self.knots], step) - 1)
        start, at = self.knots[index]
        end, to = (
            self.knots[index + 1]
            if index + 1 < len(self.knots)
            else (self.planned, float(self.schedule_steps))
        )
        if step <= start:
            return at
        if end <= start:
            return float(self.schedule_steps)
        return min(float(self.schedule_steps), at + (step - start) * (to - at) / (end - start))

    def replan(self, step: int, planned: int) -> None:
        """With `step` optimizer steps done, reach the schedule's end when `planned` are.

        The rate of the next step was set when the last one ended (Lightning steps the
        schedule before callbacks see the step), so the mapping bends after it: that rate stays
        what it was, in this process and in one resumed from a checkpoint of this step.
        """
        bend = step + 1
        self.knots = [k for k in self.knots if k[0] < bend] + [(bend, self(bend))]
        self.planned = planned

    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule_steps": self.schedule_steps,
            "planned": self.planned,
            "knots": [list(k) for k in self.knots],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # resumed with another trainer.max_steps: the same fractions of the longer schedule
        scale = self.schedule_steps / state.get("schedule_steps", self.schedule_steps)
        self.planned = int(state["planned"])
        self.knots = [(int(s), float(v) * scale) for s, v in state["knots"]]


def resolve_warmup(total_steps: int, warmup_steps: int | None, warmup_ratio: float | None) -> int:
    """Warmup length in steps from either an absolute count or a fraction of the run.

    Raises:
        ValueError: both or neither given, or a value out of range.
    """
    if total_steps <= 0:
        raise ValueError(f"trainer.max_steps must be > 0 to build a schedule, got {total_steps}")
    if (warmup_steps is None) == (warmup_ratio is None):
        raise ValueError(
            "give exactly one of schedule.warmup_steps and schedule.warmup_ratio "
            f"(got {warmup_steps!r} and {warmup_ratio!r}); set the other to null"
        )
    if warmup_ratio is not None:
        if not 0 <= warmup_ratio < 1:
            raise ValueError(f"schedule.warmup_ratio must be in [0, 1), got {warmup_ratio}")
        return round(warmup_ratio * total_steps)
    if warmup_steps < 0:
        raise ValueError(f"schedule.warmup_steps must be >= 0, got {warmup_steps}")
    return min(int(warmup_steps), total_steps)


def _warmup_factor(step: float, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


def _stepped(optimizer: Optimizer, factor: Callable[[float], float], pace: Pace | None) -> LambdaLR:
    if pace is None:
        return LambdaLR(optimizer, factor)
    return LambdaLR(optimizer, lambda step: factor(pace(step + 1) - 1))


def warmup_linear_decay(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    pace: Pace | None = None,
) -> LambdaLR:
    """Linear warmup to the peak, then linear decay to 0 at `total_steps` (BERT)."""
    warmup = resolve_warmup(total_steps, warmup_steps, warmup_ratio)
    decay = max(1, total_steps - warmup)

    def factor(step: float) -> float:
        rising = _warmup_factor(step, warmup)
        return rising if rising is not None else max(0.0, (total_steps - step) / decay)

    return _stepped(optimizer, factor, pace)


def warmup_cosine(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_lr_ratio: float = 0.1,
    pace: Pace | None = None,
) -> LambdaLR:
    """Linear warmup to the peak, then cosine decay to `min_lr_ratio` x peak (GPT)."""
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    warmup = resolve_warmup(total_steps, warmup_steps, warmup_ratio)
    decay = max(1, total_steps - warmup)

    def factor(step: float) -> float:
        rising = _warmup_factor(step, warmup)
        if rising is not None:
            return rising
        progress = min(1.0, (step - warmup) / decay)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return _stepped(optimizer, factor, pace)
