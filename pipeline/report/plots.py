"""The matplotlib figures of a report, each drawn into one PNG of 900 x 450 pixels.

Training columns are drawn smoothed over their faint raw curve, validation columns as points
joined by a thin line; overlaid runs get one colour each. Every `plot_*` function returns False,
drawing nothing, when no run has the columns it plots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from pipeline.report.runs import MFU, TOKENS_PER_S, FinetuneRun, PretrainRun, lr_differs
from pipeline.suites.seeds import summarize_seeds
from pipeline.suites.summary import SuiteSummary

BLIMP_PROBE = "probe/blimp"  # the overall BLiMP accuracy of `make pretrain probe=blimp`
# Every PNG has this size: 900 x 450 pixels.
FIGSIZE = (9.0, 4.5)
DPI = 100
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DASHES = ("-", ":", "-.", "--")
STEP_LABEL = "optimizer step"


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
    Curves(
        "bits_per_byte",
        "Validation bits per byte (comparable across tokenizers)",
        "bits per byte",
        ("val/bits_per_byte",),
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


def probe_columns(runs: list[PretrainRun]) -> list[str]:
    """The `probe/<task>/<metric>` columns any run logged (pipeline/pretrain/probe.py), and
    `probe/blimp` (pipeline/pretrain/blimp_probe.py)."""
    names = {
        c
        for run in runs
        for c in run.metrics
        if (c.startswith("probe/") and c.count("/") == 2) or c == BLIMP_PROBE
    }
    return sorted(names)


def plot_probes(runs: list[PretrainRun], path: Path) -> bool:
    """Downstream probe scores over steps, each with a dotted line at its step-0 value (the
    starting model: random, or with `word_vectors=ppmi` the counted word vectors)."""
    columns = probe_columns(runs)
    if not columns:
        return False
    figure, axes = new_figure(
        "Linear probes of the frozen features (dotted: at step 0)", "probe score"
    )
    many = len(runs) > 1
    for r, run in enumerate(runs):
        for k, column in enumerate(columns):
            steps, values = run.series(column)
            if not len(values):
                continue
            color = PALETTE[(r if many else k) % len(PALETTE)]
            dash = DASHES[k % len(DASHES)] if many else "-"
            label = f"{run.label}: {column}" if many else column
            draw_series(axes, steps, values, label=label, color=color, dash=dash, validation=True)
            if steps[0] == 0:
                axes.axhline(values[0], color=color, lw=1, ls=":")
    axes.legend(fontsize="small")
    figure.savefig(path)
    return True


def source_columns(runs: list[PretrainRun], figure: str) -> list[str]:
    """The per-source columns of mixture runs: `data/<source>/<figure>` for a training figure
    (`epochs`, `tokens`, ...), `val/<source>/<figure>` for "val/loss" and the like."""
    split, _, name = figure.rpartition("/")
    prefix = f"{split or 'data'}/"
    return sorted(
        {
            c
            for run in runs
            for c in run.metrics
            if c.startswith(prefix) and c.count("/") == 2 and c.endswith(f"/{name}")
        }
    )


def plot_blimp(record: dict[str, Any], path: Path) -> bool:
    """A BLiMP record's overall accuracy per row as bars, with chance (50%) dashed."""
    rows = record["rows"]
    figure, axes = new_figure("BLiMP: zero-shot grammar (mean over phenomena)", "accuracy (%)", "")
    names = [row["name"] for row in rows]
    values = [row["overall"] for row in rows]
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(rows))]
    bars = axes.barh(range(len(rows)), values, color=colors)
    axes.bar_label(bars, fmt="%.1f", padding=3, fontsize="small")
    axes.set_yticks(range(len(rows)), names, fontsize="small")
    axes.invert_yaxis()
    axes.axvline(50.0, color="#555", lw=1, ls="--", label="chance")
    axes.set_xlim(0, 100)
    axes.set_xlabel("accuracy (%)")
    axes.set_ylabel("")
    axes.legend(fontsize="small", loc="lower right")
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
        if lr_differs(runs):
            label += f" lr {run.results.lr}"
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
        seeds = summarize_seeds(values)
        offsets = np.linspace(-0.12, 0.12, len(values)) if len(values) > 1 else np.zeros(1)
        axes.scatter(x + offsets, values, color=PALETTE[0], s=24, zorder=3)
        axes.hlines(seeds.mean, x - 0.25, x + 0.25, color=PALETTE[1], lw=2)
        axes.annotate(
            f"{seeds.mean_std(3)}\n{seeds.n} seed(s)",
            (x + 0.27, seeds.mean),
            va="center",
            fontsize="small",
        )
    labels = [f"{label}\n({runs[0].main_metric})" for label, _, runs in columns]
    axes.set_xticks(range(len(columns)), labels, fontsize="small")
    axes.set_xlim(-0.5, len(columns) - 0.2)
    axes.margins(y=0.15)
    figure.savefig(path)
    return True


def plot_suite(summary: SuiteSummary, path: Path) -> bool:
    """A `make glue` suite: per task, the best non-neural baseline, the from-scratch twin and
    the pretrained model (GLUE scores; bars at the mean, whiskers one standard deviation)."""
    rows = [r for r in summary.rows if r.pretrained.summary or r.scratch.summary]
    if not rows:
        return False
    figure, axes = new_figure(f"Suite of {summary.ckpt}", "score (GLUE, x100)", "")
    width = 0.27
    x = np.arange(len(rows))
    axes.bar(
        x - width,
        [r.baseline_score for r in rows],
        width,
        color="#bbbbbb",
        label="best non-neural baseline",
    )
    for offset, side, colour, label in (
        (0.0, "scratch", PALETTE[1], "from scratch"),
        (width, "pretrained", PALETTE[0], "pretrained"),
    ):
        summaries = [getattr(r, side).summary for r in rows]
        means = [s.mean if s else np.nan for s in summaries]
        spread = [s.std if s else 0.0 for s in summaries]
        axes.bar(x + offset, means, width, yerr=spread, color=colour, label=label, capsize=3)
    axes.set_xticks(x, [r.task for r in rows], fontsize="small")
    axes.legend(fontsize="small")
    figure.savefig(path)
    return True
