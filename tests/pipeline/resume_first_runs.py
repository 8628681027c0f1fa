"""A short gpt-tiny pretraining run that several resume tests continue, trained once per session.

`ten_step_run(tmp_path_factory)` is `make pretrain model=gpt-tiny debug=smoke logger=csv
trainer.max_steps=10 checkpoint.every_n_steps=5 run_name=first` (in-process, caches and outputs
under a folder of the session): periodic checkpoints at steps 5 and 10, a validation at each,
the default `checkpoint.keep_best=1` best file, and last.ckpt. Tests continue copies of it
(`continue_run`), never the run itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_pretrain
from tests.pipeline.smoke_runs import SmokeRun, copy_run

# The first run's settings; a test resumes its copy with these and its own changes.
TEN_STEPS = (
    "model=gpt-tiny",
    "debug=smoke",
    "logger=csv",
    "checkpoint.every_n_steps=5",
)

_RUN: list[SmokeRun] = []


def ten_step_run(factory: pytest.TempPathFactory) -> SmokeRun:
    """The session's ten-step run of TEN_STEPS, trained on first use."""
    if not _RUN:
        base = factory.mktemp("ten-steps")
        done = run_pretrain(base, *TEN_STEPS, "trainer.max_steps=10", "run_name=first")
        assert done.returncode == 0, done.stderr[-3000:]
        _RUN.append(SmokeRun(base / "out" / "gpt-tiny" / "first", done))
    return _RUN[0]


def share_cache(run: SmokeRun, tmp_path: Path) -> None:
    """Make tmp_path/cache the cache of `run` (a link), so that `run_pretrain(tmp_path, ...)`
    reuses its tokenizer and token store rather than building them again, as a command run
    beside it in its own folder would."""
    (tmp_path / "cache").symlink_to(run.folder.parents[2] / "cache", target_is_directory=True)


def continue_run(run: SmokeRun, tmp_path: Path, name: str) -> Path:
    """A copy of `run` as run `name` under tmp_path (tmp_path/out/<model>/<name>, sharing the
    run's cache: `share_cache`), for a test to resume or change; its folder."""
    share_cache(run, tmp_path)
    return copy_run(run, tmp_path / "out" / run.folder.parent.name / name)
