"""Smoke pretraining runs that several test files read, trained once per test session.

`smoke_run(tmp_path_factory, model)` is `make pretrain model=<model> debug=smoke
run_name=smoke` (in-process, caches and outputs under a folder of the session), made the first
time a test asks for it and handed to every later one. Tests only read it; a test that writes
into a run (an evaluation's record, a report) works on a copy (`copy_run`).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import run_pretrain


@dataclass(frozen=True)
class SmokeRun:
    """A finished smoke run: its folder and what the command printed and exited with."""

    folder: Path
    done: subprocess.CompletedProcess


_RUNS: dict[str, SmokeRun] = {}


def smoke_run(factory: pytest.TempPathFactory, model: str) -> SmokeRun:
    """The session's smoke run of `model` (`bert-tiny`, `gpt-tiny`), trained on first use."""
    if model not in _RUNS:
        base = factory.mktemp(f"smoke-{model}")
        done = run_pretrain(base, f"model={model}", "debug=smoke", "run_name=smoke")
        assert done.returncode == 0, done.stderr[-3000:]
        _RUNS[model] = SmokeRun(base / "out" / model / "smoke", done)
    return _RUNS[model]


def copy_run(run: SmokeRun, to: Path) -> Path:
    """A copy of the run's folder at `to` (made with its parents), for a test that writes."""
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run.folder, to)
    return to
