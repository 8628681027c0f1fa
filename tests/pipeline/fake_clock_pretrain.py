"""`python -m pipeline.commands.pretrain`, with the time budget's clock replaced by one that
advances one second per reading, and read only at the start and once per optimizer step (the
time between steps, validations included, is not measured: none passes on this clock), so that
a run's budget decisions are the same in every process that runs it. Lightning's `max_time`
backstop, which reads the real clock, is switched off here: on a loaded machine it would cut a
run before the plan ends it (tests/pipeline/test_budget.py tests the backstop on real time).

    python -m tests.pipeline.fake_clock_pretrain trainer.budget=45s ...

A test that runs the command in its own process installs the same clock with `install`.
"""

import itertools
import runpy

from lightning.pytorch.callbacks.timer import Timer

import pipeline.pretrain.budget


def install(setattr=setattr) -> None:
    """Replace the clock (ticking from 0) and switch off the backstop, with `setattr` (pytest's
    `monkeypatch.setattr` puts them back after the test)."""
    ticks = itertools.count()
    setattr(pipeline.pretrain.budget, "clock", lambda: float(next(ticks)))
    setattr(pipeline.pretrain.budget.TimeBudget, "on_train_batch_start", lambda self, *a: None)
    setattr(Timer, "_check_time_remaining", lambda self, trainer: None)


if __name__ == "__main__":
    install()
    runpy.run_module("pipeline.commands.pretrain", run_name="__main__")
