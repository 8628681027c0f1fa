"""`python -m pipeline.commands.pretrain`, with the time budget's clock replaced by one that
advances one second per reading, and read only at the start and once per optimizer step (the
time between steps, validations included, is not measured: none passes on this clock), so that
a run's budget decisions are the same in every process that runs it.

    python -m tests.pipeline.fake_clock_pretrain trainer.budget=45s ...
"""

import itertools
import runpy

import pipeline.budget

if __name__ == "__main__":
    ticks = itertools.count()
    pipeline.budget.clock = lambda: float(next(ticks))
    pipeline.budget.TimeBudget.on_train_batch_start = lambda self, *args: None
    runpy.run_module("pipeline.commands.pretrain", run_name="__main__")
