"""`python -m pipeline.commands.pretrain`, given Ctrl-C twice in the middle of its third
optimizer step, as an impatient user does: the first asks for a checkpoint after the step, the
second (before the step ended) aborts at once.

    python -m tests.pipeline.ctrl_c_twice_pretrain model=gpt-tiny ...
"""

import os
import runpy
import signal

from pipeline.checkpoint.interrupt import GracefulStop

_batch_start = GracefulStop.on_train_batch_start


def _ctrl_c_twice_at_step_two(self, trainer, pl_module, batch, batch_idx) -> None:
    _batch_start(self, trainer, pl_module, batch, batch_idx)
    if trainer.global_step == 2:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    GracefulStop.on_train_batch_start = _ctrl_c_twice_at_step_two
    runpy.run_module("pipeline.commands.pretrain", run_name="__main__")
