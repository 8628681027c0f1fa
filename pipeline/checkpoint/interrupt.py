"""Stopping a training run on a signal without losing work.

Ctrl-C (SIGINT), SIGTERM (sent by SLURM, Kubernetes and `kill` before a hard kill) and SIGUSR1
(SLURM's usual `--signal=USR1@<seconds>` warning before the time limit) do not stop training at
once: the current optimizer step is finished (every micro-batch of it), a complete checkpoint is
written atomically (`last.ckpt` and a periodic `stepNNNNNNN.ckpt`, as at any checkpoint
interval, so resuming from it is exact), and `TrainingInterrupted` is raised for the command to
print how to resume and exit non-zero (128 + the signal's number, as a shell reports it).

A second Ctrl-C while waiting for the step to end aborts at once (`TrainingAborted`, no
checkpoint), and so does SIGINT or SIGTERM during `fit` before training starts or after it ends
(`signals_abort`): the command says how to continue from the run's newest checkpoint. (Not a
KeyboardInterrupt, which Lightning turns into `sys.exit(1)` without a word.) In a
multi-process run, the processes agree at every step boundary whether any of them was
signalled, so all stop after the same step. Under SLURM, SIGUSR1 also requeues the job
(`scontrol requeue`), whose `resume=auto` then continues the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

from pipeline.checkpoint.saving import StepCheckpoint
from pipeline.training.lightning_compat import step_boundary

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
ABORT_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # outside training steps (`signals_abort`)


class TrainingInterrupted(Exception):
    """Training stopped on a signal after a checkpoint was written.

    Attributes:
        signum: the signal received.
        step: the optimizer steps done (the checkpoint's global step).
        checkpoint: the checkpoint written (None if the run had no checkpoint callback).
        reporter: whether this process is the one that prints how to resume.
    """

    def __init__(
        self, signum: int, step: int, checkpoint: Path | None, reporter: bool = True
    ) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.reporter = reporter  # the process that tells the user (global rank 0)
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class TrainingAborted(BaseException):
    """Training ended at once on a signal, without saving the steps since the run's newest
    checkpoint. A BaseException, as KeyboardInterrupt is (no `except Exception` of a library
    swallows it), but not a KeyboardInterrupt: Lightning lets this one through to the command.

    Attributes:
        signum: the signal received.
    """

    def __init__(self, signum: int, when: str) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} {when}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _abort(signum: int, frame: FrameType | None) -> None:
    raise TrainingAborted(signum, "outside a training step")


@contextlib.contextmanager
def signals_abort() -> Iterator[None]:
    """Within (a run's `fit`): SIGINT and SIGTERM raise `TrainingAborted` at once. While the
    run trains, `GracefulStop` handles them instead (and puts these back when training ends);
    Lightning calls this SIGTERM handler after its own."""
    previous = {signum: signal.signal(signum, _abort) for signum in ABORT_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class GracefulStop(L.Callback):
    """Turns STOP_SIGNALS during training into a checkpoint after the current optimizer step.

    The handlers are installed when training starts (after Lightning's own, which they replace
    for the run's duration) and the previous ones are put back when it ends. Checkpoints are
    written by the run's checkpoint callbacks that keep `last.ckpt` (`save_step`), so a stopped
    run's files are exactly those of a run that reached a checkpoint interval at that step.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._stop: TrainingInterrupted | None = None  # saved at a signal, raised next batch

    # --- signal handlers ---

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            print(
                f"\nreceived {signal.Signals(signum).name}: finishing the current optimizer step, "
                "then saving a checkpoint (press Ctrl-C again to abort without one)",
                file=sys.stderr,
                flush=True,
            )
        elif signum == signal.SIGINT:
            self._restore()
            raise TrainingAborted(signum, "again before the step ended")

    def _install(self) -> None:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    # --- Lightning hooks ---

    def on_train_start(self, trainer, pl_module) -> None:
        # Not earlier (at `setup`): Lightning registers its own SIGTERM handler after setup and
        # would wrap ours, then stop the run its own way (no checkpoint, exit 0). Until training
        # starts (checkpoint restore, sanity validation) a signal goes to Lightning's handlers.
        self.received = None
        self._stop = None
        self._install()

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not step_boundary(trainer):
            return  # mid-step: the gradients of the step so far are in no checkpoint
        signalled = self.received is not None
        if trainer.world_size > 1:  # every process stops after the same step
            signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
        if not signalled:
            return
        signum = self.received if self.received is not None else signal.SIGTERM
        saved = None
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, StepCheckpoint):
                saved = callback.save_step(trainer) or saved
        if signum == signal.SIGUSR1 and trainer.is_global_zero:
            requeue_slurm_job()
        # Raised when the next batch starts: Lightning logs this step's metrics (and runs its
        # validation, when one is due) after this hook, and they belong to the run.
        self._stop = TrainingInterrupted(signum, trainer.global_step, saved, trainer.is_global_zero)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._stop is not None:
            raise self._stop


def requeue_slurm_job() -> None:
    """Under SLURM, put this job back in the queue (its `resume=auto` continues the run)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job is None:
        return
    if "SLURM_ARRAY_TASK_ID" in os.environ and "SLURM_ARRAY_JOB_ID" in os.environ:
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.warning("SIGUSR1 under SLURM: scontrol not found, job %s not requeued", job)
        return
    if result.returncode == 0:
        log.info("requeued SLURM job %s", job)
    else:
        log.warning("requeueing SLURM job %s failed: %s", job, result.stderr.strip())
