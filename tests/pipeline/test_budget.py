"""Runs sized to a time budget (pipeline/pretrain/budget.py): durations, the pace that maps steps onto
the schedule, and real runs whose schedule ends on time, even with artificially slow steps.
(Exact resume in budget mode: tests/pipeline/test_resume.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Timer

from pipeline.pretrain.budget import Pace, RunLength, TimeBudget, parse_duration
from pipeline.pretrain.checks import check_config
from pipeline.run.errors import ConfigError
from pipeline.training.schedules import warmup_cosine
from tests.conftest import compose_pretrain
from tests.pipeline.test_modules import logged, tiny_run


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("20m", 1200), ("1.5h", 5400), ("1h30m", 5400), ("00:01:30:00", 5400), (45, 45)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "20 minutes", "1:30", "-5m", "m"])
def test_bad_durations_are_refused_with_examples(text):
    with pytest.raises(ValueError, match="trainer.budget=20m"):
        parse_duration(text)


def test_pace_bends_without_jumps_and_ends_the_schedule_at_the_planned_step():
    pace = Pace(1000)
    assert pace(7) == 7  # no plan yet: the schedule's own steps
    pace.replan(4, 104)  # after 4 steps; the 5th step's rate was set already: bend after it
    assert pace(5) == 5 and pace(104) == 1000 and pace(500) == 1000
    before = pace(51)
    pace.replan(50, 80)  # slower than planned: fewer steps, the same point of the schedule
    assert pace(51) == before and pace(80) == 1000
    # steps before a re-plan keep their mapping
    assert pace(30) == pytest.approx(5 + 25 * (1000 - 5) / 99, rel=1e-12)
    next_step = pace(61)
    pace.replan(60, 61)  # out of time: one step left, whose rate was set already
    assert pace(61) == next_step and pace(62) == 1000
    restored = Pace(1000)
    restored.load_state_dict(pace.state_dict())
    assert [restored(s) for s in range(0, 90, 7)] == [pace(s) for s in range(0, 90, 7)]


def test_paced_schedule_reaches_its_final_rate_at_the_planned_step():
    pace = Pace(10_000)
    pace.replan(0, 40)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_cosine(optimizer, 10_000, warmup_ratio=0.1, min_lr_ratio=0.1, pace=pace)
    rates = []
    for _ in range(40):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # The first step's rate is set before any plan (a tiny first warmup step), then the warmup,
    # 10% of the schedule, takes 10% of the 40 steps.
    assert rates[0] == pytest.approx(1 / 1000)
    assert rates[1] < rates[2] < rates[3] < 1 and rates[4] == pytest.approx(1.0, abs=0.01)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # after the last step


class SimulatedClock(L.Callback):
    """A clock that both the budget and Lightning's `max_time` timer read, advanced by
    `step_seconds(step)` at the end of each training batch: a run whose step times the test
    decides, so that a loaded machine cannot change what it measures."""

    def __init__(self, step_seconds) -> None:
        self.now = 0.0
        self.step_seconds = step_seconds

    def monotonic(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer, *args) -> None:
        self.now += self.step_seconds(trainer.global_step)


class SleepySteps(L.Callback):
    """Adds `seconds` of real time to every training batch, and records the period of the last
    step: the time from the end of the step before it to its own end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.ended: float | None = None
        self.last_period = 0.0

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)
        now = time.monotonic()
        if self.ended is not None:
            self.last_period = now - self.ended
        self.ended = now


def budgeted_run(tmp_path, small_docs, budget: float, first_callback: L.Callback):
    """(module, trainer, budget callback, timer) of a finished gpt-tiny run with `budget`
    seconds, `first_callback` running before every other callback."""
    module, datamodule, trainer = tiny_run(
        tmp_path,
        small_docs,
        "model=gpt-tiny",
        f"trainer.budget={budget}s",
        "trainer.max_steps=100000",
        "objective.batch_size=4",
        "checkpoint.every_n_steps=10000",
    )
    trainer.callbacks.insert(0, first_callback)
    trainer.fit(module, datamodule=datamodule)
    sized = next(c for c in trainer.callbacks if isinstance(c, TimeBudget))
    timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
    return module, trainer, sized, timer


def assert_schedule_complete(module, trainer, run_dir) -> None:
    """The last step ran at cosine's floor, 0.1 x the configured peak, and the warmup came
    near the peak (a plan re-estimated during the warmup can skip the peak step itself)."""
    rates = logged(run_dir, "train/lr")
    peak = module.trainer.optimizers[0].param_groups[0]["initial_lr"]
    assert len(rates) == trainer.global_step
    assert rates[-1] == pytest.approx(0.1 * peak, rel=0.02)
    assert max(rates) > 0.95 * peak


# Simulated steps of 1/8 s (exact in binary: the step count below is not off by a rounding):
# a 4 s budget holds 29 of them, the plan, a decision at each tenth of the budget and the
# warmup's peak all there, where steps of 0.05 s made 77 real steps to show the same. The
# second run slows down 3x two fifths of the way in.
@pytest.mark.parametrize(
    "step_seconds",
    [lambda step: 0.125, lambda step: 0.125 if step < 12 else 0.375],
    ids=["steady", "slows-down-3x-at-step-12"],
)
def test_a_budgeted_run_ends_its_schedule_by_its_plan_within_the_budget(
    tmp_path, small_docs, monkeypatch, step_seconds
):
    budget = 4.0
    clock = SimulatedClock(step_seconds)
    monkeypatch.setattr("pipeline.pretrain.budget.clock", clock.monotonic)
    monkeypatch.setattr("lightning.pytorch.callbacks.timer.time", clock)
    module, trainer, sized, timer = budgeted_run(tmp_path, small_docs, budget, clock)
    # ended by its plan, not cut by the max_time backstop, within the budget
    assert trainer.global_step == sized.pace.planned < 100_000
    assert timer.time_elapsed("train") <= budget
    # a steady run fills the budget less what it keeps free (3%, or 3 steps' time if more)
    if step_seconds(0) == step_seconds(10_000):
        free = max(0.03 * budget, TimeBudget.RESERVE_STEPS * 0.125)
        assert trainer.global_step == int((budget - free) / 0.125)
    assert_schedule_complete(module, trainer, tmp_path / "run")


@pytest.mark.slow  # real time: on a loaded machine (a clean-clone CI beside a fine-tune) its 6 s
# made 6 steps, too few to warm up; the simulated-clock tests above check the same logic
def test_a_run_slowed_by_real_sleeps_still_ends_its_schedule_within_the_budget(
    tmp_path, small_docs
):
    budget = 6.0
    sleepy = SleepySteps(0.06)
    module, trainer, sized, timer = budgeted_run(tmp_path, small_docs, budget, sleepy)
    # Within the budget, but for the step running at the deadline: the max_time backstop can
    # only stop between steps, and on a loaded machine the plan's last step can end a little
    # late (6.29 s of 6.0 was seen beside 30 fine-tunes).
    assert timer.time_elapsed("train") <= budget + sleepy.last_period
    # the plan ends it; on a loaded machine the max_time backstop may cut its last step
    assert sized.pace.planned - 1 <= trainer.global_step <= sized.pace.planned < 100_000
    assert_schedule_complete(module, trainer, tmp_path / "run")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.budget=soon"], "is not a positive duration"),
        (["trainer.budget=10m", "trainer.max_time=00:00:10:00"], "keep one"),
        (
            ["trainer.budget=10m", "schedule.warmup_steps=100", "schedule.warmup_ratio=null"],
            "schedule.warmup_steps=null schedule.warmup_ratio=0.05",
        ),
    ],
)
def test_budget_settings_that_cannot_work_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(compose_pretrain(*overrides))


def test_the_budget_is_parsed_once_into_the_plan_that_sizes_schedule_and_pace(tmp_path, small_docs):
    """`check_config` parses trainer.budget once; the module's schedule, the pace and the
    planner are all sized from that one value."""
    plain = check_config(compose_pretrain("trainer.max_steps=300")).length
    assert plain == RunLength(300, None) and plain.pace() is None
    module, _, trainer = tiny_run(
        tmp_path, small_docs, "model=gpt-tiny", "trainer.budget=1m30s", "trainer.max_steps=500"
    )
    sized = next(c for c in trainer.callbacks if isinstance(c, TimeBudget))
    assert module.schedule_steps == sized.pace.schedule_steps == 500 and sized.seconds == 90


class FakeRun:
    """Drives a `TimeBudget` as Lightning would, one optimizer step at a time, on a clock that
    the test advances by each step's duration."""

    def __init__(self, budget_s: float, max_steps: int = 100_000) -> None:
        self.now = 0.0
        self.loop = SimpleNamespace(max_steps=max_steps, _should_accumulate=lambda: False)
        self.trainer = SimpleNamespace(
            global_step=0,
            fit_loop=SimpleNamespace(epoch_loop=self.loop),
            strategy=SimpleNamespace(broadcast=lambda value, src: value),
            is_global_zero=True,
            sanity_checking=False,
        )
        self.budget = TimeBudget(budget_s, Pace(max_steps))
        self.module = SimpleNamespace(log=lambda *args, **kwargs: None)

    def run(self, step_seconds, between_seconds=lambda step: 0.0) -> int:
        """Steps until the planned end; `step_seconds(step)` is step `step`'s duration, and
        `between_seconds(step)` the time after it before the next step (a validation, a
        checkpoint save)."""
        import pipeline.pretrain.budget as budget_module

        budget_module.clock = lambda: self.now
        try:
            self.budget.on_train_start(self.trainer, self.module)
            while self.trainer.global_step < self.loop.max_steps:
                self.budget.on_train_batch_start(self.trainer, self.module, None, 0)
                self.now += step_seconds(self.trainer.global_step + 1)
                self.trainer.global_step += 1
                self.budget.on_train_batch_end(self.trainer, self.module, None, None, 0)
                self.now += between_seconds(self.trainer.global_step)
        finally:
            budget_module.clock = time.monotonic
        return self.trainer.global_step


@pytest.mark.parametrize(
    "between",
    [
        lambda step: 20.0 if step % 100 == 0 else 0.0,  # a validation every 100 steps
        lambda step: 10.0 if step % 50 == 0 else 0.0,  # a checkpoint save every 50
    ],
    ids=["validations", "checkpoint-saves"],
)
def test_time_between_steps_does_not_sway_the_plan_and_each_fraction_decides_once(between):
    # 1 s steps, with 20 s between steps every 100 of them (or 10 s every 50): 1.2 s per step
    # in all, so a 600 s budget less its 3% margin holds about 485 steps
    fake = FakeRun(600)
    steps = fake.run(lambda step: 1.0, between)
    assert 460 <= steps <= 500 and fake.now <= 600
    assert fake.budget.decisions <= 1 + len(TimeBudget.REPLAN_AT)


@pytest.mark.parametrize("slower", [2.0, 3.0])
def test_a_machine_that_slows_down_mid_run_is_seen_at_the_next_decision(slower):
    # another job starts a third of the way in and each step takes `slower` times as long:
    # the run still ends by its plan within the budget, having used most of it
    fake = FakeRun(600)
    steps = fake.run(lambda step: 1.0 if step <= 200 else slower)
    assert fake.now <= 600 and fake.now > 0.9 * 600
    assert steps == fake.budget.pace.planned


def test_the_plan_grows_back_when_steps_speed_up_and_max_steps_caps_it():
    fake = FakeRun(300)
    steps = fake.run(lambda step: 3.0 if step <= 20 else 1.0)  # slow at first, then faster
    assert fake.now <= 300 and steps > 200  # planned again past the first, slow estimate
    capped = FakeRun(300, max_steps=50)
    assert capped.run(lambda step: 1.0) == 50


def test_a_plan_made_with_no_time_left_still_ends_the_schedule_at_its_final_step():
    """A decision that finds the budget spent (the steps slowed 10x just before it) plans the
    soonest end that the schedule can still reach: two steps on, since the rate of the next
    step was set before the decision (`Pace.replan`), so the last step runs at the final rate."""
    fake = FakeRun(100)
    steps = fake.run(lambda step: 1.0 if step <= 60 else 10.0)
    pace = fake.budget.pace
    assert steps == pace.planned
    assert pace(steps) == pace.schedule_steps  # the schedule's end at the last step
    assert pace(steps - 1) < pace.schedule_steps


def test_a_short_budget_keeps_a_few_steps_free_where_its_margin_would_be_less():
    """The margin kept free at the end is 3% of the budget, but never less than
    `RESERVE_STEPS` steps' time: 3% of 20 one-second steps would not cover one slow step."""
    short = FakeRun(20)
    assert short.run(lambda step: 1.0) == 20 - TimeBudget.RESERVE_STEPS
    long = FakeRun(1000)  # 3% of it is 30 steps, more than the reserve
    assert long.run(lambda step: 1.0) == 970
