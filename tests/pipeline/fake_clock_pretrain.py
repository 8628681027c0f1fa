"""`python -m pipeline.commands.pretrain`, with the time budget's clock replaced by one that
advances one second per reading, and read only at the start and once per optimizer step (the
time between steps, validations included, is not measured: none passes on this clock), so that
a run's budget decisions are the same in every process that runs it. Lightning's `max_time`
backstop, which reads the real clock, is switched off here: on a loaded machine it would cut a
run before the plan ends it (tests/pipeline/test_budget.py tests the backstop on real time).

    python -m tests.pipeline.fake_clock_pretrain trainer.budget=45s ...
"""

import itertools
import runpy

from lightning.pytorch.callbacks.timer import Timer

import pipeline.pretrain.budget

if __name__ == "__main__":
    ticks = itertools.count()
    pipeline.pretrain.budget.clock = lambda: float(next(ticks))
    pipeline.pretrain.budget.TimeBudget.on_train_batch_start = lambda self, *args: None
    Timer._check_time_remaining = lambda self, trainer: None
    runpy.run_module("pipeline.commands.pretrain", run_name="__main__")
