"""Processes of their own for commands that a test signals or kills, started before they are needed.

A test that kills a training run, or sends it SIGINT or SIGTERM, needs the run in a process of
its own; starting one costs seconds (a new Python imports torch, Lightning, Hydra and the
pipeline) before the command even parses its arguments. `start(command, ...)` returns that
process (a `subprocess.Popen`, to poll, signal and wait for as usual) from a Python started
earlier with the same folder, environment and output streams, which has imported those and
waits for its command; and starts the next one, which imports while the test goes on.

The waiting Python is `python -m tests.pipeline.ready_process`: it reads one line, a JSON list
`[module, *args]`, from stdin and runs the module as `python -m module *args` would (runpy, as
tests/pipeline/fake_clock_pretrain.py runs the pretraining command). Given no line (stdin
closed), it exits.
"""

from __future__ import annotations

import atexit
import json
import runpy
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_READY: dict[tuple, subprocess.Popen] = {}


def _key(cwd: Path, env: Mapping[str, str], stdout, stderr) -> tuple:
    return str(cwd), tuple(sorted(env.items())), stdout, stderr


def _waiting(cwd: Path, env: Mapping[str, str], stdout, stderr) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.pipeline.ready_process"],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def prepare(*, cwd: Path, env: Mapping[str, str], stdout, stderr) -> None:
    """Start a waiting Python for a later `start` with these settings (none if one waits)."""
    key = _key(cwd, env, stdout, stderr)
    if key not in _READY or _READY[key].poll() is not None:
        _READY[key] = _waiting(cwd, env, stdout, stderr)


def start(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], stdout, stderr
) -> subprocess.Popen:
    """`subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True)`
    for a `command` of the form [sys.executable, "-m", module, *args], run by a waiting Python
    (`prepare`d, or started now); another waits for the next call."""
    python, flag, *module_args = command
    assert python == sys.executable and flag == "-m", command
    prepare(cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    process = _READY.pop(_key(cwd, env, stdout, stderr))
    process.stdin.write(json.dumps(module_args) + "\n")
    process.stdin.close()
    process.stdin = None  # given: communicate() has nothing to send
    process.args = list(command)
    prepare(cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    return process


@atexit.register
def stop() -> None:
    """End the Pythons that wait (unused: no command was given to them)."""
    for process in _READY.values():
        process.kill()
        process.communicate()
    _READY.clear()


def _run_the_given_command() -> None:
    import hydra  # noqa: F401 - what every command imports first, imported while waiting
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import pipeline.pretrain.families
    import pipeline.pretrain.run
    import pipeline.run.cli
    import pipeline.run.launcher  # noqa: F401

    line = sys.stdin.readline()
    if not line:
        return
    module, *args = json.loads(line)
    sys.argv[:] = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_the_given_command()
