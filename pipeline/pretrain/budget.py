"""Runs sized to a wall-clock budget (`trainer.budget=20m`): the learning-rate schedule completes
its warmup and decay at the deadline on any machine, and `trainer.max_steps` is only an upper
bound.

How: the schedule is built for `trainer.max_steps` schedule steps (`RunLength`, the run's length
parsed once), and a `Pace` (pipeline/training/schedules.py) maps the run's optimizer steps onto
them. `TimeBudget` times the steps and plans how many the budget holds (deciding a bounded
number of times: after a few calibration steps, then each time another tenth of the budget has
passed, and at 95%). Each decision prices a step as what the steps
since the previous decision took (so a machine that slows down, say when another job starts, is
seen at the next decision), plus the time this process spent between steps so far (validations,
checkpoints, probes, fetching batches) spread over all its steps (so a validation or a save
neither sways one decision nor goes uncounted). At each decision the pace is re-aimed so that
the planned last step lands on the schedule's last step, continuing from where the schedule is
(the learning rate never jumps), and Lightning is told to stop there.

Every decision and the elapsed time are saved in the checkpoint, so a resumed run follows the
plan the run had made at that step (exact resume); later decisions time the resumed process.
Decisions are taken at steps fixed in advance and made by the first process, then broadcast, so
all processes of a multi-process run always agree.

The budget counts training time from the first step (as Lightning's `max_time` does, including
validation and checkpoints), not reading the corpus or building the token store before it.
Lightning's `max_time` is set to the budget as a backstop should the machine slow down late.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import lightning as L

from pipeline.training.lightning_compat import set_max_steps, step_boundary
from pipeline.training.schedules import Pace

log = logging.getLogger(__name__)

# The clock the steps are timed with (tests replace it with one that ticks once per reading).
clock = time.monotonic

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: object) -> float:
    """Seconds in a duration: `90s`, `20m`, `1.5h`, `1h30m`, Lightning's `DD:HH:MM:SS`, or a
    number of seconds.

    Raises:
        ValueError: anything else, or a duration that is not positive.
    """
    spelled = str(text).strip().lower().replace(" ", "")
    seconds: float | None = None
    if re.fullmatch(r"\d+(\.\d+)?", spelled):
        seconds = float(spelled)
    elif re.fullmatch(r"\d+:\d+:\d+:\d+", spelled):
        days, hours, minutes, secs = (int(part) for part in spelled.split(":"))
        seconds = float(((days * 24 + hours) * 60 + minutes) * 60 + secs)
    elif spelled and _DURATION.sub("", spelled) == "":
        seconds = sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(spelled))
    if seconds is None or seconds <= 0:
        raise ValueError(
            f"trainer.budget={text!r} is not a positive duration; write e.g. "
            "trainer.budget=20m, 90s, 1h30m or 00:01:30:00 (DD:HH:MM:SS)"
        )
    return seconds


@dataclass(frozen=True)
class RunLength:
    """How long a pretraining run is, parsed once from its trainer config (by
    `pipeline.pretrain.checks.check_config`, which carries it on the `RunPlan`): the checks,
    the schedule's length and the budget's planner all read this one value.

    Attributes:
        max_steps: `trainer.max_steps`: the schedule's length in optimizer steps, and with a
            budget the most steps the run may take.
        budget_s: `trainer.budget` in seconds; None: the run takes `max_steps` steps.
    """

    max_steps: int
    budget_s: float | None = None

    @classmethod
    def of(cls, trainer: Any) -> RunLength:
        """The run length of a trainer config (`max_steps`, `budget`).

        Raises:
            ValueError: a budget that is not a positive duration.
        """
        budget = trainer.get("budget")
        return cls(trainer.max_steps, None if budget is None else parse_duration(budget))

    def pace(self) -> Pace | None:
        """A new mapping of a budgeted run's steps onto its schedule (None without a budget:
        the schedule's steps are the run's)."""
        return Pace(self.max_steps) if self.budget_s is not None else None


class TimeBudget(L.Callback):
    """Plans the run's length so that it ends, schedule complete, within `seconds` of training.

    Args:
        seconds: the budget.
        pace: the mapping the run's schedule reads (`RunLength.pace()`).
        calibration_steps: steps timed before the first plan (the first step of a process,
            which pays for one-time set-up, is never timed).
        margin: the fraction of the budget kept free for the end of the run (the last
            checkpoint) and for timing noise; never less than `RESERVE_STEPS` steps' time,
            which is more than the fraction only in budgets of under 100 steps (where one
            step slowed by a busy machine would otherwise push the plan's last
            step past the deadline, and the max_time backstop would stop the run short of
            the schedule's end).
    """

    RESERVE_STEPS = 3

    # When this fraction of the budget has passed, the plan is made again with what was measured.
    REPLAN_AT = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    STATE_KEY = "TimeBudget"  # its entry among a checkpoint's callback states

    def __init__(
        self, seconds: float, pace: Pace, *, calibration_steps: int = 3, margin: float = 0.03
    ) -> None:
        self.seconds = seconds
        self.pace = pace
        self.margin = margin
        self.next_decision = 1 + calibration_steps
        self.decisions = 0
        self.aimed_at = 0.0  # the fraction of the budget the next decision is aimed at
        self.seconds_per_step: float | None = None
        self.elapsed = 0.0  # budget used up to the last step boundary
        self._attempt: tuple[float, float] | None = None  # (clock at start, elapsed at start)
        # What this process measured: the (step, clock, seconds between steps) the next
        # price is taken from, the step the time between steps is spread over from, that
        # time, and when the current stretch between steps began.
        self._window: tuple[int, float, float] | None = None
        self._first_timed_step = 0
        self._between_steps = 0.0
        self._left_step_at: float | None = None

    @property
    def state_key(self) -> str:
        return self.STATE_KEY

    def state_dict(self) -> dict[str, Any]:
        return {
            "elapsed": self.elapsed,
            "pace": self.pace.state_dict(),
            "next_decision": self.next_decision,
            "decisions": self.decisions,
            "aimed_at": self.aimed_at,
            "seconds_per_step": self.seconds_per_step,
        }

    @classmethod
    def planned_end(cls, checkpoint: dict[str, Any]) -> int | None:
        """The last step that the budget of the run a checkpoint was saved by had planned
        (None: the run had no budget)."""
        state = checkpoint.get("callbacks", {}).get(cls.STATE_KEY)
        return int(state["pace"]["planned"]) if state else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elapsed = float(state["elapsed"])
        self.pace.load_state_dict(state["pace"])
        self.next_decision = int(state["next_decision"])
        self.decisions = int(state["decisions"])
        self.aimed_at = float(state.get("aimed_at", 0.0))
        self.seconds_per_step = state["seconds_per_step"]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attempt = (clock(), self.elapsed)
        self._window = None
        self._between_steps = 0.0
        self._left_step_at = None
        if self.pace.planned < self.pace.schedule_steps:  # resumed: the plan made so far holds
            set_max_steps(trainer, self.pace.planned)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._left_step_at is not None:
            self._between_steps += clock() - self._left_step_at
            self._left_step_at = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not step_boundary(trainer):
            return
        now = clock()
        step = trainer.global_step
        started, elapsed_before = self._attempt
        self.elapsed = elapsed_before + (now - started)
        if self._window is None:  # from the end of this process's first step
            self._window = (step, now, self._between_steps)
            self._first_timed_step = step
        if step == self.next_decision:
            self._decide(trainer, pl_module, step, now)
        # Lightning's later hooks of this step (checkpoint saves, probes), a validation and
        # the next batch's fetch come before the next step starts.
        self._left_step_at = now

    def _decide(self, trainer, pl_module, step: int, now: float) -> None:
        rate = self._price_step(step, now)
        if rate is not None:
            self.seconds_per_step = rate
        self._window = (step, now, self._between_steps)
        planned, next_decision, self.aimed_at = trainer.strategy.broadcast(self._plan(step), src=0)
        self.pace.replan(step, planned)
        set_max_steps(trainer, planned)
        self.next_decision = next_decision
        self.decisions += 1
        pl_module.log("train/planned_steps", float(planned))
        if trainer.is_global_zero:
            log.info(
                "time budget: %d steps planned (%.3g s per step, %.0f of %.0f s used)",
                planned,
                self.seconds_per_step or float("nan"),
                self.elapsed,
                self.seconds,
            )

    def _price_step(self, step: int, now: float) -> float | None:
        """Seconds per step from what this process measured: the steps since the window
        opened, plus all the time between steps so far spread over every step timed; None
        when no step was timed yet (resumed right at a decision)."""
        window_step, window_clock, window_between = self._window
        if step <= window_step:
            return None
        between_in_window = self._between_steps - window_between
        in_steps = (now - window_clock - between_in_window) / (step - window_step)
        return in_steps + self._between_steps / (step - self._first_timed_step)

    def _plan(self, step: int) -> tuple[int, int, float]:
        """(the planned last step, at most `trainer.max_steps`; the step of the next decision,
        -1 for none; the fraction of the budget it is aimed at). Each of `REPLAN_AT` prompts
        one decision at most: the next is aimed at the first fraction after both the one this
        decision was aimed at and the share of the budget used."""
        rate = self.seconds_per_step
        if rate is None or rate <= 0:  # nothing timed yet (resumed right at a decision)
            return self.pace.planned, step + 1, self.aimed_at
        reserve = max(self.margin * self.seconds, self.RESERVE_STEPS * rate)
        left = self.seconds - reserve - self.elapsed
        most = self.pace.schedule_steps  # trainer.max_steps as configured
        # The rate of step + 1 was set by the plan so far (`Pace.replan`), so only that plan
        # can end the schedule there; another ends it at step + 2 at the soonest.
        soonest = step + 1 if self.pace.planned <= step + 1 else step + 2
        planned = max(min(soonest, most), min(most, step + math.floor(left / rate)))
        used = self.elapsed / self.seconds
        later = [f for f in self.REPLAN_AT if f > max(used, self.aimed_at)]
        if not later:
            return planned, -1, 1.0
        wait = math.ceil((later[0] * self.seconds - self.elapsed) / rate)
        next_decision = step + max(1, wait)
        return planned, (next_decision if next_decision < planned else -1), later[0]
