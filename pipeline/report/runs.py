"""Reading run folders: what `make pretrain`, `make finetune` and `make glue` leave behind.

A pretraining run folder holds `logs/metrics.csv`, and its config in `logs/hparams.yaml` (written
by pipeline/training/loggers.py), else `.hydra/config.yaml`, and the `blimp*.json` records of
`make evaluate-lm suite=blimp`. A fine-tuning run folder holds
`results.json`; a multirun folder holds one fine-tuning run per numbered subfolder; a suite
folder of `make glue` holds `glue_suite.json` (read by `pipeline.suites.summary`).

Rows of Lightning's CSV log are sparse (training and validation metrics on different rows); a
resumed run repeats the steps between its checkpoint and the crash, and the last row of a step
wins.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.finetune.results import FinetuneResults
from pipeline.run.errors import ResultsError, SuiteRecordError
from pipeline.run.families import family_of_target
from pipeline.run.folder import RESULTS, SUITE_RECORD
from pipeline.suites.blimp import read_reports as read_blimp_reports
from pipeline.suites.summary import SuiteSummary, summarize_suites

Series = dict[int, float]  # step -> value

# Columns of logs/metrics.csv that are reported beside the plotted curves.
TOKENS_PER_S = "perf/tokens_per_s"
MFU = "perf/mfu"
SKIPPED = "train/skipped_steps"


class ReportError(ValueError):
    """A run folder cannot be reported on; the message names it and what is expected."""


def read_metrics(path: Path) -> dict[str, Series]:
    """Columns of a Lightning CSV log: column -> {step: value}, the last row of a step winning
    (a resumed run logs again the steps after its checkpoint). Empty cells are skipped."""
    columns: dict[str, Series] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                step = int(float(row.get("step") or ""))
            except ValueError:
                continue
            for column, cell in row.items():
                if column in (None, "step") or not cell:
                    continue
                try:
                    columns.setdefault(column, {})[step] = float(cell)
                except ValueError:
                    continue
    return columns


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


@dataclass
class PretrainRun:
    """A pretraining run folder: its metrics, config and logged facts."""

    path: Path
    label: str
    metrics: dict[str, Series]
    config: dict[str, Any]
    blimp: dict[str, dict[str, Any]] = field(default_factory=dict)  # blimp*.json, by file name

    @classmethod
    def load(cls, path: Path, label: str) -> PretrainRun:
        hparams = _read_yaml(path / "logs" / "hparams.yaml")  # resolved, with `run` facts
        config = hparams or _read_yaml(path / ".hydra" / "config.yaml")
        choices = _read_yaml(path / ".hydra" / "hydra.yaml").get("hydra", {}).get("runtime", {})
        config = {**config, "choice": choices.get("choices") or {}}
        metrics = read_metrics(path / "logs" / "metrics.csv")
        try:
            blimp = read_blimp_reports(path)
        except ResultsError as err:  # a damaged blimp*.json: named, as make report's error
            raise ReportError(str(err)) from err
        return cls(path, label, metrics, config, blimp)

    def lookup(self, key: str) -> Any:
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def held_out_figure(self) -> str:
        """The held-out language-model loss that best checkpoints follow (`val/mlm_loss` for
        BERT, `val/loss` for GPT), from the run's family's LightningModule; `val/loss` where
        the config names no registered family. (BERT runs begun before the masked-LM loss
        ranked them kept their best files by `val/loss`: docs/checkpoints.md.)"""
        target = self.lookup("model._target_")
        family = family_of_target(target) if isinstance(target, str) else None
        return family.module_class.held_out_figure() if family else "val/loss"

    def series(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a column in step order, finite values only."""
        points = sorted(self.metrics.get(column, {}).items())
        steps = np.array([s for s, _ in points], dtype=float)
        values = np.array([v for _, v in points], dtype=float)
        keep = np.isfinite(values)
        return steps[keep], values[keep]


@dataclass
class FinetuneRun:
    """A fine-tuning run folder: its results.json and, when present, its metrics."""

    path: Path
    results: FinetuneResults
    metrics: dict[str, Series]

    @classmethod
    def load(cls, path: Path) -> FinetuneRun:
        try:
            results = FinetuneResults.read(path / RESULTS)
        except ResultsError as err:
            raise ReportError(str(err)) from err
        metrics_csv = path / "logs" / "metrics.csv"
        metrics = read_metrics(metrics_csv) if metrics_csv.is_file() else {}
        return cls(path, results, metrics)

    @property
    def task(self) -> str:
        return self.results.task

    @property
    def seed(self) -> int:
        return self.results.seed

    @property
    def main_metric(self) -> str:
        return self.results.main_metric

    def scores(self, which: str = "best") -> dict[str, float]:
        """split -> the main metric in `which` ("best" or "final") results."""
        return self.results.scores(which)


def find_runs(
    paths: Iterable[Path],
) -> tuple[list[PretrainRun], list[FinetuneRun], list[SuiteSummary]]:
    """The runs in the given folders: pretraining runs, fine-tuning runs, `make glue` suites.

    Raises:
        ReportError: a path that is not a folder or holds no run this report understands.
    """
    paths = list(paths)
    if not paths:
        raise ReportError("no run given: make report run=outputs/<model>/<run_name>[,PATH2,...]")
    names = [p.name for p in paths]
    resolved = [p.resolve() for p in paths]
    for path, where in zip(paths, resolved, strict=True):
        if resolved.count(where) > 1:
            raise ReportError(f"run={path} is named twice; name each run once")
    pretrain: list[PretrainRun] = []
    finetune: list[FinetuneRun] = []
    suite_folders: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise ReportError(
                f"run={path}: no such folder; give a run folder of make pretrain or make "
                "finetune, e.g. run=outputs/gpt/<run_name> (several: run=PATH1,PATH2)"
            )
        if (path / SUITE_RECORD).is_file():
            suite_folders.append(path)
        elif (path / "results.json").is_file():
            finetune.append(FinetuneRun.load(path))
        elif jobs := sorted(path.glob("*/results.json"), key=_job_order):
            finetune.extend(FinetuneRun.load(job.parent) for job in jobs)
        elif (path / "logs" / "metrics.csv").is_file():
            label = path.name if names.count(path.name) == 1 else f"{path.parent.name}/{path.name}"
            pretrain.append(PretrainRun.load(path, label))
        else:
            raise ReportError(
                f"run={path}: found neither logs/metrics.csv (a pretraining run folder), "
                f"results.json (a fine-tuning run folder, or a multirun folder of them) nor "
                f"{SUITE_RECORD} (a make glue folder)"
            )
    try:  # suites of one checkpoint and settings that ran other tasks or seeds join into one table
        suites = summarize_suites(suite_folders)
    except (SuiteRecordError, ResultsError) as err:
        raise ReportError(str(err)) from err
    return pretrain, finetune, suites


def _job_order(path: Path) -> tuple[int, str]:
    name = path.parent.name
    return (int(name), "") if name.isdigit() else (sys.maxsize, name)


def finetune_groups(runs: list[FinetuneRun]) -> dict[str, list[FinetuneRun]]:
    """Runs by task, and by learning rate and starting model when a task was run with several
    (only runs that differ in nothing but the seed are pooled)."""
    by_task: dict[str, list[FinetuneRun]] = {}
    for run in runs:
        by_task.setdefault(run.task, []).append(run)
    groups: dict[str, list[FinetuneRun]] = {}
    for task, task_runs in by_task.items():
        for run in task_runs:
            parts = [task]
            if lr_differs(task_runs):
                parts.append(f"lr {run.results.lr}")
            if len({_init_label(r) for r in task_runs}) > 1:
                parts.append(_init_label(run))
            groups.setdefault(" ".join(parts), []).append(run)
    return groups


def _init_label(run: FinetuneRun) -> str:
    """What the run started from: "random init" or the pretrained model's folder name."""
    init = run.results.init
    return "random init" if init == "random" else Path(init).name or init


def lr_differs(runs: list[FinetuneRun]) -> bool:
    """Whether the runs were not all trained with the same learning rate."""
    return len({str(run.results.lr) for run in runs}) > 1
