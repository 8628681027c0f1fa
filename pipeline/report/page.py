"""Assembling a report: `write_report` writes `report.html` and one PNG per plot into a folder.

The HTML embeds the PNGs as data URIs, so that the one file can be moved or mailed; the PNG files
beside it are the same images. A plot whose columns no run has is left out, and the HTML says so.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.report.plots import (
    DPI,
    FIGSIZE,
    PRETRAIN_PLOTS,
    Curves,
    plot_blimp,
    plot_curves,
    plot_finetune_curves,
    plot_finetune_scores,
    plot_probes,
    plot_suite,
    plot_throughput,
    source_columns,
)
from pipeline.report.runs import (
    MFU,
    TOKENS_PER_S,
    FinetuneRun,
    PretrainRun,
    find_runs,
    finetune_groups,
)
from pipeline.report.tables import (
    blimp_comparison_table,
    blimp_table,
    config_table,
    final_metrics_table,
    finetune_tables,
    suite_table,
)
from pipeline.suites.blimp import RunsCompared, compare_runs
from pipeline.suites.summary import SuiteSummary


@dataclass
class Report:
    """What `write_report` wrote."""

    html: Path
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    suites: list[SuiteSummary] = field(default_factory=list)  # the tables of `make glue` folders
    blimp_compared: list[RunsCompared] = field(default_factory=list)  # runs' BLiMP side by side


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
        "probes",
        "Downstream probes during pretraining",
        lambda path: plot_probes(runs, path),
        "no run logged probe/<task>/<metric> (make pretrain probe=glue)",
    )
    for name, figure, title, ylabel in (
        ("sources_read", "epochs", "Mixture: passes over each source", "epochs of the source"),
        ("sources_val_loss", "val/loss", "Mixture: validation loss per source", "loss (nats)"),
    ):
        columns = tuple(source_columns(runs, figure))
        if columns:  # only runs trained on a mixture have them
            spec = Curves(name, title, ylabel, columns, smooth=False)
            builder.plot(name, title, lambda path, spec=spec: plot_curves(spec, runs, path), "")
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
    for run in runs:
        for name, record in run.blimp.items():
            stem = Path(name).stem
            title = f"BLiMP: {run.label} ({name})"
            builder.heading(title)
            builder.raw(blimp_table(record))
            png = f"{run.label.replace('/', '_')}-{stem}"
            builder.plot(png, title, lambda p, r=record: plot_blimp(r, p), "")
    compared, left_out = compare_runs([(run.label, run.blimp) for run in runs])
    builder.report.blimp_compared = compared
    for comparison in compared:
        builder.heading(f"BLiMP across runs ({comparison.name})")
        builder.raw(blimp_comparison_table(comparison))
    for line in left_out:
        builder.note(line)
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


def _suite_section(builder: _Builder, suites: list[SuiteSummary]) -> None:
    builder.report.suites = suites
    for number, summary in enumerate(suites, start=1):
        builder.heading(f"Downstream suite (make glue): {summary.ckpt}")
        builder.raw(f"<p>{html.escape(_folders_line(summary))}</p>")
        builder.raw(suite_table(summary))
        builder.plot(
            f"suite_{number}",
            f"Suite of {summary.ckpt}: baseline, from scratch, pretrained",
            lambda path, summary=summary: plot_suite(summary, path),
            "no task of the suite has finished",
        )


def _folders_line(summary: SuiteSummary) -> str:
    """Which suite folders a table reads (several when it joins them)."""
    return ("from the suite folders " if len(summary.folders) > 1 else "from ") + ", ".join(
        summary.folders
    )


def write_report(paths: Iterable[str | Path], out: str | Path | None = None) -> Report:
    """Write `report.html` and its PNGs for the runs in `paths` into `out` (default: the first
    run's `report/` folder).

    Raises:
        ReportError: a path that is missing or holds no run this report understands.
    """
    paths = [Path(p) for p in paths]
    pretrain, finetune, suites = find_runs(paths)
    out = Path(out) if out is not None else paths[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    earlier = set(out.glob("*.png")) if (out / "report.html").is_file() else set()
    builder = _Builder(out)
    if pretrain:
        _pretrain_section(builder, pretrain)
    if finetune:
        _finetune_section(builder, finetune)
    if suites:
        _suite_section(builder, suites)
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
