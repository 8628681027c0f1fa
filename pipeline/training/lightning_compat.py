"""Every use of Lightning's private internals, in one place.

Lightning's public API does not say whether a training batch completed an optimizer step, lets
no one set the step that loggers see, saves checkpoints only at its own moments and deletes a
CSV log on resume. The pipeline needs each of these, so it reaches into Lightning here and
nowhere else. `pyproject.toml` pins Lightning to the minor release this was written against,
and `check_internals()` (run by tests/pipeline/test_lightning_compat.py) names any internal
that a new release removed or renamed.
"""

from __future__ import annotations

import csv
import inspect
import re
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loops import _TrainingEpochLoop

TESTED_WITH = "2.6"
# (owner, attribute): each private name used below, for `check_internals`.
INTERNALS: tuple[tuple[type, str], ...] = (
    (_TrainingEpochLoop, "_should_accumulate"),
    (_TrainingEpochLoop, "_batches_that_stepped"),
    (_TrainingEpochLoop, "max_steps"),
    # read by datamodules/pretrain.py (`_position`), which sits below pipeline/ and so cannot
    # import this module: listed here so that the check still covers it
    (_TrainingEpochLoop, "batch_progress"),
    (ModelCheckpoint, "_monitor_candidates"),
    (ModelCheckpoint, "_save_topk_checkpoint"),
    (ModelCheckpoint, "_save_last_checkpoint"),
    (ModelCheckpoint, "_remove_checkpoint"),
    (ModelCheckpoint, "_last_global_step_saved"),
    (ModelCheckpoint, "_defer_save_until_validation"),
    (ModelCheckpoint, "_should_remove_checkpoint"),
    (ExperimentWriter, "_check_log_dir_exists"),
    (ExperimentWriter, "metrics_keys"),
    (CSVLogger, "_experiment"),
    (CSVLogger, "_fs"),
)


def check_internals() -> None:
    """Raise `RuntimeError` naming every internal of `INTERNALS` this Lightning lacks."""
    missing = [
        f"{owner.__name__}.{name}"
        for owner, name in INTERNALS
        if not hasattr(owner, name) and name not in _instance_attributes(owner)
    ]
    if missing:
        raise RuntimeError(
            f"lightning {L.__version__} lacks {', '.join(missing)}, which "
            f"pipeline/training/lightning_compat.py uses (written for {TESTED_WITH}.x); install the "
            f"locked version (`make setup`) or port those uses"
        )


def _instance_attributes(owner: type) -> set[str]:
    """Attributes that the `__init__` of `owner` or a base class assigns (not on the class),
    read from their source."""
    found: set[str] = set()
    for klass in owner.__mro__:
        init = klass.__dict__.get("__init__")
        try:
            source = inspect.getsource(init) if init is not None else ""
        except (OSError, TypeError):
            continue
        found.update(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=", source))
    return found


# --- the training loop --------------------------------------------------------------------------


def step_boundary(trainer: L.Trainer) -> bool:
    """Whether the training batch that just ended completed an optimizer step."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def set_logging_step(trainer: L.Trainer, step: int) -> None:
    """Make the step that loggers see `step` (Lightning counts it apart from `global_step`)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def run_max_steps(trainer: L.Trainer) -> int:
    """The optimizer steps after which the run stops (`trainer.max_steps`, or a budget's plan
    set with `set_max_steps`; -1: none)."""
    return trainer.fit_loop.epoch_loop.max_steps


def set_max_steps(trainer: L.Trainer, steps: int) -> None:
    """Stop training after `steps` optimizer steps (`trainer.max_steps` is read-only)."""
    trainer.fit_loop.epoch_loop.max_steps = steps


# --- checkpoint callbacks -----------------------------------------------------------------------


def last_saved_step(callback: ModelCheckpoint) -> int:
    return callback._last_global_step_saved


def mark_saved(callback: ModelCheckpoint, step: int) -> None:
    """Tell `callback` that `step` is on disk (e.g. the step a run resumed from)."""
    callback._last_global_step_saved = step


def save_now(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Save `callback`'s top-k and `last` checkpoints of the current step, outside Lightning's
    own moments (at a signal, at the end of a run that saved nothing since)."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def saved_now_not_deferred(callback: ModelCheckpoint) -> None:
    """Forget a save that `callback` put off to the validation it expects after an epoch's last
    batch (the save was just made)."""
    callback._defer_save_until_validation = False


def remove_checkpoint(callback: ModelCheckpoint, trainer: L.Trainer, path: str) -> None:
    callback._remove_checkpoint(trainer, path)


class ResumeFileRankedCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint that removes the file a run resumed from like any other of its files,
    once its ranking drops it. Lightning's keeps that file forever (against a crash between
    writing a new file and removing the old), so a run resumed from a best-by-validation file
    ended with `keep_best + 1` of them. Here every file is complete under its name before an
    older one is removed (written to a temporary name, then renamed), so nothing is at risk."""

    def _should_remove_checkpoint(self, trainer: L.Trainer, previous: str, current: str) -> bool:
        if previous == current:
            return False
        return Path(str(self.dirpath)).absolute() in Path(previous).absolute().parents


# --- a CSV log that survives a resume -----------------------------------------------------------


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing metrics.csv is kept and appended to
    (Lightning's deletes it when the log folder is not empty, i.e. on every resume)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                # rows are appended under the file's header; new columns rewrite it
                self.metrics_keys = next(csv.reader(handle), [])


class AppendingCSVLogger(CSVLogger):
    """`CSVLogger` whose `metrics.csv` survives a resume: the resumed run appends its rows, so
    the file holds the whole run (the steps between the last checkpoint and a crash twice; the
    later row is the resumed run's)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
