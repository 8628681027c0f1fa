"""The summary of a `make glue` suite folder (pipeline/suites/glue.py runs the suite): one row per
task with the pretrained model's and its from-scratch twin's scores over seeds, their paired
difference with a confidence interval, and the best non-neural baseline; then the average row.

    summary = summarize_suite("outputs/glue/<run>")   # from the folder's files alone
    print(summary.table())                            # Markdown
    summary.write(folder)                             # glue_summary.md and glue_summary.json
    summarize_suites([a, b])   # one table of suites that ran other tasks or seeds of one checkpoint

A task's score is GLUE's: the mean of its metrics on its main dev split, times 100.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.finetune.results import Baselines, FinetuneResults
from pipeline.run.folder import RESULTS
from pipeline.suites.record import SuiteRecord
from pipeline.suites.seeds import PairedDifference, SeedSummary, paired_difference, summarize_seeds
from tokenizer import write_text_atomic

SUMMARY = "glue_summary"  # .md and .json
BASELINES = "baselines.json"
PRETRAINED, SCRATCH = "pretrained", "scratch"
INITS = (PRETRAINED, SCRATCH)


@dataclass(frozen=True)
class Job:
    """One fine-tuning run of the suite."""

    task: str
    init: str  # PRETRAINED or SCRATCH
    seed: int

    @property
    def folder(self) -> str:
        """Its run folder, relative to the suite folder."""
        return f"{self.task}/{self.init}-seed{self.seed}"


# --- the summary ------------------------------------------------------------------------------


def task_score(metrics: dict[str, float], names: Sequence[str]) -> float:
    """GLUE's score of a task: the mean of its metrics, times 100."""
    return 100 * statistics.fmean(metrics[n] for n in names)


@dataclass(frozen=True)
class Side:
    """One init's scores on a task: seed -> score, and their summary."""

    scores: dict[int, float]
    summary: SeedSummary | None


def _side(scores: dict[int, float]) -> Side:
    return Side(scores, summarize_seeds(scores.values()) if scores else None)


@dataclass(frozen=True)
class TaskRow:
    """One line of the suite table (scores are GLUE scores, 0-100).

    Attributes:
        task: the task's name ("average" for the suite's mean over tasks).
        metrics: the metrics its score averages.
        baseline: the best non-neural baseline's name.
        baseline_score: its score.
        pretrained: the pretrained model's scores.
        scratch: the from-scratch twin's scores.
        difference: pretrained - scratch, paired over seeds (None until both have a seed).
    """

    task: str
    metrics: list[str]
    baseline: str
    baseline_score: float
    pretrained: Side
    scratch: Side
    difference: PairedDifference | None

    def below_baseline(self, side: Side) -> bool:
        return side.summary is not None and side.summary.mean <= self.baseline_score


@dataclass(frozen=True)
class SuiteSummary:
    """The suite's table: one row per task with results, then the average row."""

    ckpt: str
    rows: list[TaskRow]
    folders: list[str] = dataclasses.field(default_factory=list)  # the suite folders read

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    HEADER = (
        "task",
        "metric",
        "non-neural baseline",
        "pretrained",
        "scratch",
        "pretrained - scratch (95% CI)",
        "seeds",
    )

    def cells(self) -> list[list[str]]:
        """The table's rows as text, one cell per `HEADER` column."""
        return [
            [
                row.task,
                "/".join(row.metrics),
                f"{row.baseline_score:.1f} ({row.baseline})",
                _shown(row, row.pretrained),
                _shown(row, row.scratch),
                _difference(row.difference),
                str(row.difference.n if row.difference else 0),
            ]
            for row in self.rows
        ]

    def table(self) -> str:
        """The rows as a Markdown table."""
        lines = ["| " + " | ".join(self.HEADER) + " |", "|---|---|" + "---:|" * 5]
        lines += ["| " + " | ".join(cells) + " |" for cells in self.cells()]
        return "\n".join(lines)

    def write(self, folder: Path) -> None:
        write_text_atomic(folder / f"{SUMMARY}.json", json.dumps(self.to_dict(), indent=2) + "\n")
        header = f"# GLUE-style suite of {self.ckpt}\n\n"
        note = (
            "\n\nScores are GLUE's (the mean of a task's metrics on its dev split, x100), mean "
            "± standard deviation over seeds. BELOW BASELINE: the mean does not beat the best "
            "non-neural baseline.\n"
        )
        write_text_atomic(folder / f"{SUMMARY}.md", header + self.table() + note)


def _shown(row: TaskRow, side: Side) -> str:
    if side.summary is None:
        return "-"
    flag = " BELOW BASELINE" if row.below_baseline(side) else ""
    return side.summary.mean_std(1) + flag


def _difference(diff: PairedDifference | None) -> str:
    return "-" if diff is None else diff.text()


def summarize_suite(folder: str | Path) -> SuiteSummary:
    """The summary of a suite folder, from its record, baselines and finished runs.

    Raises:
        FileNotFoundError: `folder` holds no suite record.
        SuiteRecordError: its record is not readable.
        ResultsError: a run's results.json, or a task's baselines.json, that cannot be read.
    """
    (summary,) = summarize_suites([folder])
    return summary


def summarize_suites(folders: Iterable[str | Path]) -> list[SuiteSummary]:
    """The tables of several suite folders. Folders of one checkpoint fine-tuned with the same
    settings whose runs differ (one `make glue` per task, or per seed, run side by side) join
    into one table: a task's row holds its seeds from every folder, and one average follows.
    A folder that finished a task and seed the table already has gets a table of its own, as
    does any other folder, and one that finished nothing; what a folder planned and did not
    finish does not keep it apart (a suite cut short joins the folders that ran its missing
    tasks side by side).

    Raises:
        FileNotFoundError: a folder holds no suite record.
        SuiteRecordError: a record is not readable.
        ResultsError: a run's results.json, or a task's baselines.json, that cannot be read.
    """
    tables: list[_Table] = []
    for folder in map(Path, folders):
        record = SuiteRecord.in_folder(folder)
        found = {task: _task_scores(folder, task, record.seeds) for task in record.tasks}
        runs = {(task, seed) for task, scores in found.items() for seed in scores.seeds()}
        key = record.join_key({task for task, _ in runs})
        table = next((t for t in tables if runs and t.key == key and not t.runs & runs), None)
        if table is None:
            table = _Table(key, record.ckpt)
            tables.append(table)
        table.runs |= runs
        table.folders.append(str(folder))
        for task, scores in found.items():
            table.add(task, scores)
    return [t.summary() for t in tables]


@dataclass
class _TaskScores:
    """A task's results in one or more suite folders: its metrics, best non-neural baseline
    (None until fitted) and each init's score per seed."""

    metrics: list[str]
    baseline: tuple[str, float] | None
    scores: dict[str, dict[int, float]]

    def seeds(self) -> set[int]:
        """The seeds with a finished fine-tune, of either init."""
        return {seed for by_seed in self.scores.values() for seed in by_seed}


@dataclass
class _Table:
    """Suite folders being joined: what they share (`key`), the (task, seed) runs they hold,
    each task's scores so far, and the folders."""

    key: str
    ckpt: str
    runs: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    tasks: dict[str, _TaskScores] = dataclasses.field(default_factory=dict)
    folders: list[str] = dataclasses.field(default_factory=list)

    def add(self, task: str, found: _TaskScores) -> None:
        known = self.tasks.setdefault(task, _TaskScores([], None, {i: {} for i in INITS}))
        known.metrics = known.metrics or found.metrics
        known.baseline = known.baseline or found.baseline
        for init in INITS:
            known.scores[init].update(found.scores[init])

    def summary(self) -> SuiteSummary:
        rows = [
            _row(task, t.metrics, *t.baseline, t.scores[PRETRAINED], t.scores[SCRATCH])
            for task, t in self.tasks.items()
            if t.metrics and t.baseline is not None
        ]
        return SuiteSummary(
            self.ckpt, [*rows, _average_row(rows)] if len(rows) > 1 else rows, self.folders
        )


def _task_scores(folder: Path, task: str, seeds: Sequence[int]) -> _TaskScores:
    """A task's finished runs and fitted baselines in one suite folder."""
    scores: dict[str, dict[int, float]] = {init: {} for init in INITS}
    names: list[str] = []
    for init in INITS:
        for seed in seeds:
            results_path = folder / Job(task, init, seed).folder / RESULTS
            if not results_path.is_file():
                continue
            results = FinetuneResults.read(results_path)
            metrics = results.best.metrics[results.main_split]
            names = names or [
                results.main_metric,
                *sorted(set(metrics) - {results.main_metric, "loss"}),
            ]
            scores[init][seed] = task_score(metrics, names)
    baselines_path = folder / task / BASELINES
    if not names or not baselines_path.is_file():
        return _TaskScores(names, None, scores)
    best = Baselines.read(baselines_path).best(lambda metrics: task_score(metrics, names))
    return _TaskScores(names, best, scores)


def _average_row(rows: Sequence[TaskRow]) -> TaskRow:
    """The mean over tasks, per seed that every task has for that init."""

    def per_seed(side: str) -> dict[int, float]:
        runs = [getattr(r, side).scores for r in rows]
        seeds = set.intersection(*(set(s) for s in runs))
        return {s: statistics.fmean(r[s] for r in runs) for s in sorted(seeds)}

    baseline = statistics.fmean(r.baseline_score for r in rows)
    return _row(
        "average",
        ["GLUE score"],
        "best per task",
        baseline,
        per_seed(PRETRAINED),
        per_seed(SCRATCH),
    )


def _row(
    task: str,
    metrics: list[str],
    baseline: str,
    baseline_score: float,
    pretrained: dict[int, float],
    scratch: dict[int, float],
) -> TaskRow:
    """A row from both inits' scores (seed -> score), paired over the seeds they share."""
    common = set(pretrained) & set(scratch)
    return TaskRow(
        task=task,
        metrics=metrics,
        baseline=baseline,
        baseline_score=baseline_score,
        pretrained=_side(pretrained),
        scratch=_side(scratch),
        difference=paired_difference(pretrained, scratch) if common else None,
    )
