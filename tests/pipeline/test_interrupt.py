"""Signal handling of a training run (pipeline/checkpoint/interrupt.py); the end-to-end behaviour (a
checkpoint at the signalled step, exact resume) is in test_resume.py."""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.checkpoint.interrupt import (
    STOP_SIGNALS,
    GracefulStop,
    TrainingAborted,
    TrainingInterrupted,
    requeue_slurm_job,
    signals_abort,
)


@pytest.fixture
def handlers():
    """GracefulStop with its handlers installed; the test process's own are put back after."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    stop = GracefulStop()
    stop._install()
    yield stop
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_the_first_signal_is_recorded_and_the_second_ctrl_c_aborts(handlers, capsys):
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers.received == signal.SIGTERM
    assert "finishing the current optimizer step" in capsys.readouterr().err
    os.kill(os.getpid(), signal.SIGTERM)  # another SIGTERM: still waiting for the step
    assert handlers.received == signal.SIGTERM
    # not a KeyboardInterrupt, which Lightning would turn into exit(1) without a word
    with pytest.raises(TrainingAborted, match="stopped by SIGINT again") as aborted:
        os.kill(os.getpid(), signal.SIGINT)
    assert not isinstance(aborted.value, KeyboardInterrupt) and aborted.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) != handlers._handle  # the previous handlers are back
    assert handlers._previous == {}


def test_outside_training_steps_sigint_and_sigterm_abort_at_once_until_put_back():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with signals_abort():
        with pytest.raises(TrainingAborted, match="stopped by SIGTERM outside a training step"):
            os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(TrainingAborted) as aborted:
            os.kill(os.getpid(), signal.SIGINT)
        assert aborted.value.exit_code == 130
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_handlers_are_put_back_when_training_ends(handlers):
    assert signal.getsignal(signal.SIGUSR1) == handlers._handle
    handlers.on_train_end(None, None)
    assert signal.getsignal(signal.SIGUSR1) != handlers._handle


def test_the_exit_code_is_the_shells_for_the_signal():
    stop = TrainingInterrupted(signal.SIGINT, 12, None)
    assert stop.exit_code == 130 and "stopped by SIGINT after step 12" in str(stop)
    assert TrainingInterrupted(signal.SIGTERM, 3, None).exit_code == 143


def test_sigusr1_requeues_the_slurm_job(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    requeue_slurm_job()  # not under SLURM: nothing to requeue
    assert not calls.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    requeue_slurm_job()
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4200")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    requeue_slurm_job()
    assert calls.read_text().splitlines() == ["requeue 4242", "requeue 4200_7"]
