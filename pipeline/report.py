"""`make report run=PATH[,PATH2,...]`: plots and tables of runs, from their run folders alone.

    python -m pipeline.report outputs/gpt/wiki                      # one run
    python -m pipeline.report outputs/gpt/wiki,outputs/gpt/wiki2    # overlaid, one colour per run
    python -m pipeline.report outputs/bert/wiki --out /tmp/report

Writes `report.html` and one PNG per plot into the output folder (default: `<first run>/report`).
The HTML embeds the PNGs as data URIs, so that the one file can be moved or mailed; the PNG files
beside it are the same images.

A pretraining run folder (`logs/metrics.csv`; the config from `logs/hparams.yaml`, written by
pipeline/loggers.py, else `.hydra/config.yaml`) gets the curves in `PRETRAIN_PLOTS` plus
throughput and MFU, a config summary and its final metrics. A fine-tuning run folder
(`results.json`), or a multirun folder whose subfolders hold one each, gets a table of the main
metric per task and seed, a plot of it per task, and the dev metric over steps per seed.

Rows of Lightning's CSV log are sparse (training and validation metrics on different rows); a
resumed run repeats the steps between its checkpoint and the crash, and the last row of a step
wins. A plot whose columns a run does not have is left out, and the HTML says so.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

# Every PNG has this size: 900 x 450 pixels.
FIGSIZE = (9.0, 4.5)
DPI = 100
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DASHES = ("-", ":", "-.", "--")
STEP_LABEL = "optimizer step"

Series = dict[int, float]  # step -> value


class ReportError(ValueError):
    """A run folder cannot be reported on; the message names it and what is expected."""


# what is plotted -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Curves:
    """One plot of metric columns over steps: training columns smoothed over their faint raw
    curve, validation columns as points joined by a thin line."""

    name: str  # the PNG's file name, without .png
    title: str
    ylabel: str
    columns: tuple[str, ...]
    log_y: bool = False
    smooth: bool = True
    reference: tuple[str, str] | None = None  # (config key, label) of a horizontal line


PRETRAIN_PLOTS = (
    Curves("loss", "Training and validation loss", "loss (nats)", ("train/loss", "val/loss"), True),
    Curves(
        "accuracy",
        "MLM and NSP accuracy",
        "accuracy",
        ("train/mlm_accuracy", "val/mlm_accuracy", "train/nsp_accuracy", "val/nsp_accuracy"),
    ),
    Curves(
        "perplexity",
        "Perplexity (exp of the language-model loss)",
        "perplexity",
        ("train/perplexity", "val/perplexity"),
        log_y=True,
    ),
    Curves("learning_rate", "Learning rate", "learning rate", ("train/lr",), smooth=False),
    Curves(
        "grad_norm",
        "Gradient norm (before clipping)",
        "L2 norm",
        ("train/grad_norm",),
        log_y=True,
        reference=("trainer.gradient_clip_val", "clipped to"),
    ),
)
TOKENS_PER_S = "perf/tokens_per_s"
MFU = "perf/mfu"
SKIPPED = "train/skipped_steps"

# Config summary rows: (label, key); "choice." keys are the Hydra choices, "run." keys the facts
# logged by pipeline/loggers.py:log_run_start.
CONFIG_ROWS = (
    ("model preset", "choice.model"),
    ("experiment", "choice.experiment"),
    ("layers", "model.n_layers"),
    ("width", "model.d_model"),
    ("heads", "model.n_heads"),
    ("parameters", "run.parameters"),
    ("FLOPs per token", "run.flops_per_token"),
    ("tokenizer", "tokenizer.kind"),
    ("vocabulary", "tokenizer.vocab_size"),
    ("data", "choice.data"),
    ("data paths", "data.paths"),
    ("sequence length", "objective.seq_len"),
    ("batch size (per device)", "objective.batch_size"),
    ("accumulation", "trainer.accumulate_grad_batches"),
    ("devices", "trainer.devices"),
    ("precision", "trainer.precision"),
    ("max steps", "trainer.max_steps"),
    ("max time", "trainer.max_time"),
    ("gradient clipping", "trainer.gradient_clip_val"),
    ("learning rate", "optim.lr"),
    ("weight decay", "optim.weight_decay"),
    ("schedule", "choice.schedule"),
    ("seed", "seed"),
    ("git commit", "run.git_commit"),
    ("uncommitted changes", "run.git_dirty"),
    ("data fingerprint", "run.data_fingerprint"),
    ("tokenizer fingerprint", "run.tokenizer_fingerprint"),
    ("HF export", "hf_export"),
)


# reading run folders ---------------------------------------------------------------------------


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

    @classmethod
    def load(cls, path: Path, label: str) -> PretrainRun:
        hparams = _read_yaml(path / "logs" / "hparams.yaml")  # resolved, with `run` facts
        config = hparams or _read_yaml(path / ".hydra" / "config.yaml")
        choices = _read_yaml(path / ".hydra" / "hydra.yaml").get("hydra", {}).get("runtime", {})
        config = {**config, "choice": choices.get("choices") or {}}
        return cls(path, label, read_metrics(path / "logs" / "metrics.csv"), config)

    def lookup(self, key: str) -> Any:
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

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
    results: dict[str, Any]
    metrics: dict[str, Series]

    @classmethod
    def load(cls, path: Path) -> FinetuneRun:
        try:
            results = json.loads((path / "results.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ReportError(f"{path / 'results.json'} is not readable JSON ({err})") from err
        metrics_csv = path / "logs" / "metrics.csv"
        metrics = read_metrics(metrics_csv) if metrics_csv.is_file() else {}
        return cls(path, results, metrics)

    @property
    def task(self) -> str:
        return str(self.results.get("task", self.path.name))

    @property
    def seed(self) -> Any:
        return self.results.get("seed")

    @property
    def main_metric(self) -> str:
        return str(self.results.get("main_metric", "accuracy"))

    def scores(self, which: str = "best") -> dict[str, float]:
        """split -> the main metric in `which` ("best" or "final") results."""
        splits = (self.results.get(which) or {}).get("metrics") or {}
        return {
            split: float(values[self.main_metric])
            for split, values in splits.items()
            if isinstance(values, dict) and self.main_metric in values
        }


def find_runs(paths: Iterable[Path]) -> tuple[list[PretrainRun], list[FinetuneRun]]:
    """The runs in the given folders.

    Raises:
        ReportError: a path that is not a folder or holds no run this report understands.
    """
    paths = list(paths)
    if not paths:
        raise ReportError("no run given: make report run=outputs/<model>/<run_name>[,PATH2,...]")
    names = [p.name for p in paths]
    pretrain: list[PretrainRun] = []
    finetune: list[FinetuneRun] = []
    for path in paths:
        if not path.is_dir():
            raise ReportError(
                f"run={path}: no such folder; give a run folder of make pretrain or make "
                "finetune, e.g. run=outputs/gpt/<run_name> (several: run=PATH1,PATH2)"
            )
        if (path / "results.json").is_file():
            finetune.append(FinetuneRun.load(path))
        elif jobs := sorted(path.glob("*/results.json"), key=_job_order):
            finetune.extend(FinetuneRun.load(job.parent) for job in jobs)
        elif (path / "logs" / "metrics.csv").is_file():
            label = path.name if names.count(path.name) == 1 else f"{path.parent.name}/{path.name}"
            pretrain.append(PretrainRun.load(path, label))
        else:
            raise ReportError(
                f"run={path}: found neither logs/metrics.csv (a pretraining run folder) nor "
                "results.json (a fine-tuning run folder, or a multirun folder of them)"
            )
    return pretrain, finetune


def _job_order(path: Path) -> tuple[int, str]:
    name = path.parent.name
    return (int(name), "") if name.isdigit() else (sys.maxsize, name)


# plotting --------------------------------------------------------------------------------------


def smooth(values: np.ndarray, window: int, *, log: bool = False) -> np.ndarray:
    """Centered moving average over `window` points, narrowed symmetrically near the ends (so
    the smoothed curve neither lags a falling loss nor bends at the ends); in log space when
    `log` (a geometric mean, for log-scaled plots)."""
    v = np.log(values) if log else np.asarray(values, dtype=float)
    n, half = len(v), window // 2
    index = np.arange(n)
    reach = np.minimum(half, np.minimum(index, n - 1 - index))
    sums = np.concatenate([[0.0], np.cumsum(v)])
    out = (sums[index + reach + 1] - sums[index - reach]) / (2 * reach + 1)
    return np.exp(out) if log else out


def smoothing_window(n_points: int) -> int:
    """About a tenth of the points, odd."""
    return 2 * (n_points // 20) + 1


def new_figure(title: str, ylabel: str, xlabel: str = STEP_LABEL) -> tuple[Figure, Any]:
    figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, which="major", alpha=0.3)
    return figure, axes


def draw_series(
    axes: Any,
    steps: np.ndarray,
    values: np.ndarray,
    *,
    label: str,
    color: str,
    dash: str = "-",
    validation: bool = False,
    smoothed: bool = True,
    log: bool = False,
) -> None:
    """One column: validation as points on a thin line; training smoothed, raw curve faint."""
    window = smoothing_window(len(values))
    if validation:
        axes.plot(steps, values, dash, color=color, lw=1.2, marker="o", ms=4, label=label)
    elif smoothed and window > 1:
        axes.plot(steps, values, dash, color=color, lw=0.8, alpha=0.25)
        smoothed_values = smooth(values, window, log=log)
        axes.plot(
            steps, smoothed_values, dash, color=color, lw=1.8, label=f"{label} (mean of {window})"
        )
    else:
        axes.plot(steps, values, dash, color=color, lw=1.5, label=label)


def draw_reference(axes: Any, runs: list[PretrainRun], key: str, label: str) -> None:
    """A grey horizontal line at each distinct positive value of config `key` among the runs."""
    values = {run.lookup(key) for run in runs}
    for value in sorted(v for v in values if isinstance(v, (int, float)) and v > 0):
        axes.axhline(value, color="grey", lw=1, ls="--", label=f"{label} {value:g} ({key})")


def log_scale(axes: Any) -> None:
    """A log y axis labelled with plain numbers (7, 8, 9 rather than 7x10^0); the ticks
    between powers of ten are labelled too when the data spans less than two of them."""
    axes.set_yscale("log")
    low, high = axes.get_ylim()
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    if high / low < 100:
        axes.yaxis.set_minor_formatter(plain)
        axes.grid(True, which="minor", axis="y", alpha=0.15)
    else:
        axes.yaxis.set_minor_formatter(NullFormatter())


def plot_curves(spec: Curves, runs: list[PretrainRun], path: Path) -> bool:
    """Draw `spec` for every run that has any of its columns; False when none has."""
    present = [c for c in spec.columns if any(run.metrics.get(c) for run in runs)]
    if not present:
        return False
    figure, axes = new_figure(spec.title, spec.ylabel)
    kinds = list(dict.fromkeys(c.split("/", 1)[-1] for c in present))  # mlm_accuracy, ...
    many = len(runs) > 1
    for r, run in enumerate(runs):
        for column in present:
            steps, values = run.series(column)
            if spec.log_y:
                steps, values = steps[values > 0], values[values > 0]
            if not len(values):
                continue
            k = kinds.index(column.split("/", 1)[-1])
            draw_series(
                axes,
                steps,
                values,
                label=f"{run.label}: {column}" if many else column,
                color=PALETTE[(r if many else k) % len(PALETTE)],
                dash=DASHES[k % len(DASHES)] if many else "-",
                validation=column.startswith("val/"),
                smoothed=spec.smooth,
                log=spec.log_y,
            )
    if spec.reference is not None:
        draw_reference(axes, runs, *spec.reference)
    if spec.log_y:
        log_scale(axes)
    else:
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    axes.legend(fontsize="small")
    figure.savefig(path)
    return True


def plot_throughput(runs: list[PretrainRun], path: Path) -> bool:
    """Tokens/s (left axis) and, where logged, MFU in percent (right axis)."""
    if not any(run.metrics.get(TOKENS_PER_S) for run in runs):
        return False
    figure, axes = new_figure("Throughput and model FLOPs utilization", "tokens/s")
    has_mfu = any(run.metrics.get(MFU) for run in runs)
    right = axes.twinx() if has_mfu else None
    if right is not None:
        right.set_ylabel("MFU (% of the device's bf16 peak)")
    for r, run in enumerate(runs):
        name = f"{run.label}: " if len(runs) > 1 else ""
        for column, target, scale, what, dash in (
            (TOKENS_PER_S, axes, 1.0, "tokens/s", "-"),
            (MFU, right, 100.0, "MFU", ":"),
        ):
            steps, values = run.series(column)
            if target is not None and len(values):
                color = PALETTE[r % len(PALETTE)]
                label = f"{name}{what}"
                draw_series(target, steps, scale * values, label=label, color=color, dash=dash)
    axes.set_ylim(bottom=0)
    handles, labels = axes.get_legend_handles_labels()
    if right is not None:
        right.set_ylim(bottom=0)
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axes.legend(handles, labels, fontsize="small", loc="lower right")
    figure.savefig(path)
    return True


def _metric_columns(run: FinetuneRun) -> dict[str, str]:
    """split -> its column of the main metric in the run's metrics (`val/<split>/<metric>`)."""
    suffix = f"/{run.main_metric}"
    return {
        column[len("val/") : -len(suffix)]: column
        for column in run.metrics
        if column.startswith("val/") and column.endswith(suffix)
    }


def plot_finetune_curves(task: str, runs: list[FinetuneRun], path: Path) -> bool:
    """The dev metric of one task over steps, one colour per seed, one dash per split."""
    curves = [
        (run, split, column) for run in runs for split, column in _metric_columns(run).items()
    ]
    if not curves:
        return False
    metric = runs[0].main_metric
    figure, axes = new_figure(f"{task}: dev {metric} per seed", metric)
    seeds = list(dict.fromkeys(str(run.seed) for run in runs))
    splits = list(dict.fromkeys(split for _, split, _ in curves))
    for run, split, column in curves:
        points = sorted(run.metrics[column].items())
        label = f"seed {run.seed}" + (f" {split}" if len(splits) > 1 else "")
        if _lr_differs(runs):
            label += f" lr {run.results.get('lr')}"
        axes.plot(
            [s for s, _ in points],
            [v for _, v in points],
            DASHES[splits.index(split) % len(DASHES)],
            color=PALETTE[seeds.index(str(run.seed)) % len(PALETTE)],
            marker="o",
            ms=4,
            lw=1.4,
            label=label,
        )
    axes.legend(fontsize="small")
    figure.savefig(path)
    return True


def plot_finetune_scores(groups: dict[str, list[FinetuneRun]], path: Path) -> bool:
    """The best dev main metric per task (and split): one point per seed, a bar at the mean
    labelled with mean ± standard deviation."""
    columns = [
        (f"{name}\n{split}" if len(runs[0].scores()) > 1 else name, split, runs)
        for name, runs in groups.items()
        for split in runs[0].scores()
    ]
    if not columns:
        return False
    figure, axes = new_figure("Fine-tuning: best dev score per seed", "best dev score", "")
    for x, (_, split, runs) in enumerate(columns):
        values = [run.scores()[split] for run in runs if split in run.scores()]
        mean = statistics.fmean(values)
        offsets = np.linspace(-0.12, 0.12, len(values)) if len(values) > 1 else np.zeros(1)
        axes.scatter(x + offsets, values, color=PALETTE[0], s=24, zorder=3)
        axes.hlines(mean, x - 0.25, x + 0.25, color=PALETTE[1], lw=2)
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        axes.annotate(
            f"{mean:.3f}{spread}\n{len(values)} seed(s)",
            (x + 0.27, mean),
            va="center",
            fontsize="small",
        )
    labels = [f"{label}\n({runs[0].main_metric})" for label, _, runs in columns]
    axes.set_xticks(range(len(columns)), labels, fontsize="small")
    axes.set_xlim(-0.5, len(columns) - 0.2)
    axes.margins(y=0.15)
    figure.savefig(path)
    return True


def _lr_differs(runs: list[FinetuneRun]) -> bool:
    return len({str(run.results.get("lr")) for run in runs}) > 1


# tables ----------------------------------------------------------------------------------------


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)  # 1234 (a seed), 1,045,154
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(fmt(cell))}</td>" for cell in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def config_table(runs: list[PretrainRun]) -> str:
    rows = [[label, *(run.lookup(key) for run in runs)] for label, key in CONFIG_ROWS]
    rows = [row for row in rows if any(cell not in (None, "") for cell in row[1:])]
    return table(["setting", *(run.label for run in runs)], rows)


def final_metrics(run: PretrainRun) -> dict[str, Any]:
    """The numbers a reader wants at the end of a run."""
    out: dict[str, Any] = {}
    steps = [s for series in run.metrics.values() for s in series]
    out["last logged step"] = max(steps) if steps else None
    for column in sorted(c for c in run.metrics if c.startswith("val/")):
        _, values = run.series(column)
        if len(values):
            out[f"final {column}"] = float(values[-1])
    val_steps, val_loss = run.series("val/loss")
    if len(val_loss):
        best = int(np.argmin(val_loss))
        out["best val/loss"] = f"{val_loss[best]:.4g} at step {int(val_steps[best])}"
    _, train_loss = run.series("train/loss")
    if len(train_loss):
        window = min(smoothing_window(len(train_loss)), len(train_loss))
        out[f"train/loss, mean of the last {window} logged"] = float(np.mean(train_loss[-window:]))
    for column, name, scale in ((TOKENS_PER_S, "tokens/s", 1.0), (MFU, "MFU (%)", 100.0)):
        _, values = run.series(column)
        if len(values):
            out[f"median {name}"] = float(np.median(values)) * scale
    _, skipped = run.series(SKIPPED)
    if len(skipped):
        out["skipped non-finite steps"] = int(skipped.max())
    return out


def final_metrics_table(runs: list[PretrainRun]) -> str:
    finals = [final_metrics(run) for run in runs]
    keys = list(dict.fromkeys(k for final in finals for k in final))
    rows = [[key, *(final.get(key) for final in finals)] for key in keys]
    return table(["metric", *(run.label for run in runs)], rows)


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
            if _lr_differs(task_runs):
                parts.append(f"lr {run.results.get('lr')}")
            if len({_init_label(r) for r in task_runs}) > 1:
                parts.append(_init_label(run))
            groups.setdefault(" ".join(parts), []).append(run)
    return groups


def _init_label(run: FinetuneRun) -> str:
    """What the run started from: "random init" or the pretrained model's folder name."""
    init = str(run.results.get("init", ""))
    return "random init" if init == "random" else Path(init).name or init


def finetune_tables(runs: list[FinetuneRun], groups: dict[str, list[FinetuneRun]]) -> str:
    summary = []
    for name, group in groups.items():
        for split in group[0].scores():
            values = [run.scores()[split] for run in group if split in run.scores()]
            spread = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
            summary.append(
                [
                    name,
                    split,
                    group[0].main_metric,
                    len(values),
                    f"{statistics.fmean(values):.4f}{spread}",
                ]
            )
    detail = []
    for run in runs:
        best, final = run.scores("best"), run.scores("final")
        best_at = run.results.get("best") or {}
        detail.append(
            [
                run.task,
                run.seed,
                run.results.get("lr"),
                run.main_metric,
                "; ".join(f"{split} {value:.4f}" for split, value in best.items()),
                "; ".join(f"{split} {value:.4f}" for split, value in final.items()),
                best_at.get("step"),
                best_at.get("epoch"),
                run.results.get("init"),
                run.path.name,
            ]
        )
    return (
        "<h3>Per task: mean ± standard deviation over seeds of the best dev score</h3>"
        + table(["task", "split", "metric", "seeds", "best dev"], summary)
        + "<h3>Per run</h3>"
        + table(
            [
                "task",
                "seed",
                "lr",
                "metric",
                "best dev",
                "final dev",
                "best step",
                "best epoch",
                "initialized from",
                "folder",
            ],
            detail,
        )
    )


# the report ------------------------------------------------------------------------------------


@dataclass
class Report:
    """What `write_report` wrote."""

    html: Path
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Builder:
    """Collects the HTML sections and the PNGs of one report."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.parts: list[str] = []
        self.report = Report(out / "report.html")

    def heading(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def raw(self, fragment: str) -> None:
        self.parts.append(fragment)

    def note(self, text: str) -> None:
        self.report.notes.append(text)
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def plot(self, name: str, title: str, draw: Callable[[Path], bool], missing: str) -> None:
        """Draw a PNG with `draw(path)`, embed it; when `draw` finds nothing, note `missing`."""
        path = self.out / f"{name}.png"
        if not draw(path):
            self.note(f"not plotted: {title}: {missing}")
            return
        self.report.plots.append(path)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        self.parts.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(title)}" '
            f'width="{int(FIGSIZE[0] * DPI)}" height="{int(FIGSIZE[1] * DPI)}">'
            f'<figcaption>{html.escape(title)} (<a href="{path.name}">{path.name}</a>)'
            "</figcaption></figure>"
        )


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
.note { color: #8a5a00; font-size: 0.9em; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _pretrain_section(builder: _Builder, runs: list[PretrainRun]) -> None:
    builder.heading("Pretraining")
    builder.raw(
        "<p>Training curves are smoothed by a centered moving average over the number of "
        "logged points shown in the legend (a geometric mean on log scales), with the raw "
        "values faint behind; validation values are points. Of a step logged twice (a resumed "
        "run repeats the steps after its checkpoint), the last value is shown.</p>"
    )
    for spec in PRETRAIN_PLOTS:
        columns = ", ".join(spec.columns)
        builder.plot(
            spec.name,
            spec.title,
            lambda path, spec=spec: plot_curves(spec, runs, path),
            f"no run logged any of {columns} in logs/metrics.csv",
        )
    builder.plot(
        "throughput",
        "Throughput and MFU",
        lambda path: plot_throughput(runs, path),
        f"no run logged {TOKENS_PER_S} in logs/metrics.csv",
    )
    if not any(run.metrics.get(MFU) for run in runs):
        builder.note(
            f"no MFU: no run logged {MFU} (it is logged on GPUs whose peak FLOP/s is known, "
            "never on CPU)"
        )
    builder.heading("Final metrics")
    builder.raw(final_metrics_table(runs))
    builder.heading("Configuration")
    builder.raw(config_table(runs))


def _finetune_section(builder: _Builder, runs: list[FinetuneRun]) -> None:
    groups = finetune_groups(runs)
    builder.heading("Fine-tuning")
    builder.raw(finetune_tables(runs, groups))
    builder.plot(
        "finetune_scores",
        "Best dev score per task and seed",
        lambda path: plot_finetune_scores(groups, path),
        "no results.json holds best dev metrics",
    )
    for name, group in groups.items():
        slug = "".join(c if c.isalnum() else "_" for c in name)
        builder.plot(
            f"finetune_{slug}",
            f"{name}: dev {group[0].main_metric} over steps",
            lambda path, name=name, group=group: plot_finetune_curves(name, group, path),
            f"no logs/metrics.csv with val/<split>/{group[0].main_metric} columns",
        )


def write_report(paths: Iterable[str | Path], out: str | Path | None = None) -> Report:
    """Write `report.html` and its PNGs for the runs in `paths` into `out` (default: the first
    run's `report/` folder).

    Raises:
        ReportError: a path that is missing or holds no run this report understands.
    """
    paths = [Path(p) for p in paths]
    pretrain, finetune = find_runs(paths)
    out = Path(out) if out is not None else paths[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    earlier = set(out.glob("*.png")) if (out / "report.html").is_file() else set()
    builder = _Builder(out)
    if pretrain:
        _pretrain_section(builder, pretrain)
    if finetune:
        _finetune_section(builder, finetune)
    title = "Report: " + ", ".join(str(p) for p in paths)
    runs = "".join(f"<li><code>{html.escape(str(p.resolve()))}</code></li>" for p in paths)
    builder.report.html.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>Runs:</p><ul>{runs}</ul>"
        + "".join(builder.parts)
        + "</body></html>\n"
    )
    for stale in earlier - set(builder.report.plots):  # an earlier report's plot, not redrawn
        stale.unlink()
    return builder.report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make report",
        description="HTML report with PNG plots of runs, from their run folders alone.",
    )
    parser.add_argument(
        "runs", help="run folder(s), comma-separated: outputs/gpt/wiki[,outputs/gpt/wiki2]"
    )
    parser.add_argument("--out", help="output folder (default: <first run>/report)")
    args = parser.parse_args(argv)
    paths = [p.strip() for p in args.runs.split(",") if p.strip()]
    try:
        report = write_report(paths, args.out)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for note in report.notes:
        print(f"note: {note}")
    names = ", ".join(p.name for p in report.plots)
    print(f"wrote {report.html} with {len(report.plots)} plots ({names})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
