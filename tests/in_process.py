"""Run a command (`python -m pipeline.commands.<name> ...`) inside the test's own Python.

Starting a Python that imports torch, Lightning and Hydra costs seconds; most tests of a command
check what it prints, writes and exits with, not the process boundary. `run_module` runs the
module as `python -m` would (`runpy` makes it `__main__`, with its `sys.argv`), in the
environment and folder given, and returns what `subprocess.run(..., capture_output=True,
text=True)` would: exit status, stdout, stderr. Everything a command changes in the process is
put back afterwards (environment, folder, signal handlers, logging, warnings filters, Hydra's
global state, torch's global settings and random generators), so one test's run cannot leak into
the next.

Tests of what only a separate process shows (signals, locks held by another process, `make`,
file descriptors written by child processes) keep using `subprocess`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import runpy
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import lightning.pytorch  # noqa: F401 - its log handler exists before any run (see _output_captured)
import numpy as np
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from pipeline.run.lock import release_all

# The signals whose handlers a command may change (interrupts, Lightning's SLURM handling).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.root.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    return [
        h
        for logger in loggers
        for h in logger.handlers
        if isinstance(h, logging.StreamHandler)
        and not isinstance(h, logging.FileHandler)
        and not isinstance(getattr(type(h), "stream", None), property)  # logging's last resort
    ]


@contextlib.contextmanager
def _output_captured(out: io.StringIO, err: io.StringIO) -> Iterator[None]:
    """sys.stdout and sys.stderr, and the log handlers that write to them (Lightning's own),
    write to `out` and `err`; handlers a command makes for them are pointed back afterwards."""
    ours = {id(sys.stdout): out, id(sys.stderr): err}
    theirs = {id(out): sys.stdout, id(err): sys.stderr}
    moved = [(h, h.stream) for h in _stream_handlers() if id(h.stream) in ours]
    for handler, stream in moved:
        handler.setStream(ours[id(stream)])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)
        for handler in _stream_handlers():
            if id(handler.stream) in theirs:
                handler.setStream(theirs[id(handler.stream)])


def _distributed_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    environ = dict(os.environ)
    cwd = os.getcwd()
    argv = list(sys.argv)
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    loggers = {
        name: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    torch_state = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
        torch.get_default_dtype(),
        torch.get_rng_state(),
    )
    np_state, py_state = np.random.get_state(), random.getstate()
    distributed = _distributed_initialized()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        release_all()  # the run folders' locks, which the command's exit would free
        if not distributed and _distributed_initialized():  # rank 0 of a DDP run was here
            torch.distributed.destroy_process_group()
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # the run's config, which Hydra leaves set
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv[:] = argv
        for s, handler in handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for handler in set(root.handlers) - set(root_handlers):
            handler.close()  # a run's log file
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
        for name, (level, kept, propagate, disabled) in loggers.items():
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.handlers[:] = kept
            logger.propagate, logger.disabled = propagate, disabled
        threads, deterministic, matmul, dtype, rng = torch_state
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision(matmul)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        np.random.set_state(np_state)
        random.setstate(py_state)


def run_module(
    module: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess:
    """`python -m module *args` in this process: the environment is `env` exactly (as a
    subprocess given `env=` sees it; None keeps this one), the working folder `cwd`. Returns
    the exit status (SystemExit's code; 1 and the traceback on stderr for an exception that
    escapes, as Python would) and what was written to sys.stdout and sys.stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with _process_state_restored():
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv[:] = [module, *args]
        with _output_captured(out, err):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as stop:
                code = _exit_status(stop.code)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                for handler in logging.getLogger().handlers:
                    handler.flush()
    return subprocess.CompletedProcess(
        [sys.executable, "-m", module, *args], code, out.getvalue(), err.getvalue()
    )


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1
