"""Summary of a fine-tuning sweep: the median and spread over seeds of each setting.

    make finetune task=rte ckpt=... -m optim.lr=2e-5,3e-5,5e-5 seed=1,2,3

runs one job per combination, each writing `results.json` into its numbered folder of the sweep
folder. `SweepSummary` (a Hydra callback, `hydra.callbacks` in conf/finetune.yaml) then groups
the jobs by their overrides other than `seed`, prints a table (n seeds, median, min, max, std of
the main metric on the main split) and writes `sweep_summary.json` and `sweep_summary.md` beside
them. `summarize_sweep(folder)` does the same for a finished sweep folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline.finetune.results import FinetuneResults, read_record, write_record
from pipeline.run.errors import ResultsError
from pipeline.run.launcher import override_key
from pipeline.suites.seeds import summarize_seeds
from tokenizer import write_text_atomic

log = logging.getLogger(__name__)

SEED_KEYS = ("seed",)
SUMMARY = "sweep_summary"  # .json and .md


@dataclass(frozen=True)
class SweepRow:
    """One setting of a sweep, as `sweep_summary.json` lists them (in this field order).

    Attributes:
        setting: the overrides that define it ("(default)" when only seeds vary).
        task: the task name.
        metric: `<split>/<metric>`, the main metric on the main split.
        seeds: its jobs' seeds, ascending.
        values: the metric of each job, at its best checkpoint (in the order of `seeds`).
        median, min, max, std: over `values`.
    """

    setting: str
    task: str
    metric: str
    seeds: list[int]
    values: list[float]
    median: float
    min: float
    max: float
    std: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def write_all(path: str | os.PathLike, rows: list[SweepRow]) -> None:
        write_record(path, [row.to_dict() for row in rows])

    @classmethod
    def read_all(cls, path: str | os.PathLike) -> list[SweepRow]:
        """The rows of a sweep_summary.json.

        Raises:
            ResultsError: naming the file: not readable JSON, or not a list of rows.
        """
        data = read_record(path)
        try:
            return [cls(**row) for row in data]
        except TypeError as err:
            raise ResultsError(f"{path}: malformed ({err})") from err


def setting_of(overrides: list[str], common: set[str] = frozenset()) -> str:
    """The overrides that define a setting: all but the seed and those every job shares,
    sorted ("" when only seeds vary)."""
    kept = [o for o in overrides if o not in common and override_key(o) not in SEED_KEYS]
    return " ".join(sorted(kept))


def summarize_results(results: list[FinetuneResults]) -> list[SweepRow]:
    """One row per setting: the main metric's median, min, max and std over its seeds."""
    groups: dict[str, list[FinetuneResults]] = defaultdict(list)
    common = set.intersection(*(set(r.overrides) for r in results)) if results else set()
    for result in results:
        groups[setting_of(result.overrides, common)].append(result)
    rows = []
    for setting, members in sorted(groups.items()):
        members = sorted(members, key=lambda m: m.seed)  # seeds and values in the same order
        first = members[0]
        metric, split = first.main_metric, first.main_split
        values = [m.best.metrics[split][metric] for m in members]
        summary = summarize_seeds(values)
        rows.append(
            SweepRow(
                setting=setting or "(default)",
                task=first.task,
                metric=f"{split}/{metric}",
                seeds=[m.seed for m in members],
                values=values,
                median=summary.median,
                min=summary.min,
                max=summary.max,
                std=summary.std,
            )
        )
    return rows


def summary_table(rows: list[SweepRow]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| setting | metric | seeds | median | min | max | std |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.setting} | {r.task} {r.metric} | {len(r.seeds)} | "
            f"{r.median:.4f} | {r.min:.4f} | {r.max:.4f} | {r.std:.4f} |"
        )
    return "\n".join(lines)


def summarize_sweep(folder: str | Path) -> list[SweepRow]:
    """Read every `*/results.json` of a sweep folder, write the summary files, return the rows.

    Raises:
        FileNotFoundError: no job of the folder finished (no results.json).
    """
    folder = Path(folder)
    files = sorted(folder.glob("*/results.json"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no */results.json: no job of the sweep finished (see the jobs' logs)"
        )
    rows = summarize_results([FinetuneResults.read(f) for f in files])
    SweepRow.write_all(folder / f"{SUMMARY}.json", rows)
    write_text_atomic(folder / f"{SUMMARY}.md", summary_table(rows) + "\n")
    return rows


class SweepSummary(Callback):
    """Prints and saves the sweep summary when a Hydra multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("task") is None:  # a sweep of evaluate/predict: no fine-tuning results
            return
        folder = Path(config.hydra.sweep.dir)
        try:
            rows = summarize_sweep(folder)
        except (FileNotFoundError, ResultsError) as err:
            log.warning("%s", err)
            return
        print(f"\nsweep summary (median and spread over seeds), {folder}:")
        print(summary_table(rows))
