"""The HTML tables of a report: a pretraining run's config and final metrics, and the fine-tuning
scores per task (mean ± standard deviation over seeds) and per run."""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from pipeline.report.plots import smoothing_window
from pipeline.report.runs import MFU, SKIPPED, TOKENS_PER_S, FinetuneRun, PretrainRun
from pipeline.suites.blimp import RunsCompared
from pipeline.suites.seeds import summarize_seeds
from pipeline.suites.summary import SuiteSummary

# Config summary rows: (label, key); "choice." keys are the Hydra choices, "run." keys the facts
# logged by pipeline/training/loggers.py:log_run_start.
CONFIG_ROWS = (
    ("model preset", "choice.model"),
    ("experiment", "choice.experiment"),
    ("layers", "model.n_layers"),
    ("width", "model.d_model"),
    ("heads", "model.n_heads"),
    ("positions", "model.position_encoding"),
    ("norm placement", "model.norm_placement"),
    ("parameters", "run.parameters"),
    ("FLOPs per token", "run.flops_per_token"),
    ("tokenizer", "tokenizer.kind"),
    ("vocabulary", "tokenizer.vocab_size"),
    ("data", "choice.data"),
    ("data paths", "data.paths"),
    ("sequence length", "objective.seq_len"),
    ("batch size (per device)", "objective.batch_size"),
    ("objective phases", "objective.phases"),
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


def blimp_table(record: dict[str, Any]) -> str:
    """A BLiMP record (`pipeline.suites.blimp`) as a table: a column per scored or paper row,
    overall first, then each linguistic term."""
    rows = record["rows"]
    terms = list(rows[0]["terms"])
    body = [["overall", *(round(r["overall"], 1) for r in rows)]]
    body += [[term, *(_one_decimal(r["terms"].get(term)) for r in rows)] for term in terms]
    return table(["accuracy (%)", *(r["name"] for r in rows)], body)


def blimp_comparison_table(compared: RunsCompared) -> str:
    """The model rows of one BLiMP record in several runs (`RunsCompared`): its table and
    note."""
    note = f'<p class="note">{html.escape(compared.note())}</p>'
    return table(["accuracy (%)", *compared.labels], compared.body()) + note


def _one_decimal(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


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
    figure = run.held_out_figure()  # what its best checkpoints follow
    val_steps, val_loss = run.series(figure)
    if len(val_loss):
        best = int(np.argmin(val_loss))
        out[f"best {figure}"] = f"{val_loss[best]:.4g} at step {int(val_steps[best])}"
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


def finetune_tables(runs: list[FinetuneRun], groups: dict[str, list[FinetuneRun]]) -> str:
    summary = []
    for name, group in groups.items():
        for split in group[0].scores():
            values = [run.scores()[split] for run in group if split in run.scores()]
            seeds = summarize_seeds(values)
            summary.append([name, split, group[0].main_metric, seeds.n, seeds.mean_std(4)])
    detail = []
    for run in runs:
        best, final = run.scores("best"), run.scores("final")
        best_at = run.results.best
        detail.append(
            [
                run.task,
                run.seed,
                run.results.lr,
                run.main_metric,
                "; ".join(f"{split} {value:.4f}" for split, value in best.items()),
                "; ".join(f"{split} {value:.4f}" for split, value in final.items()),
                best_at.step,
                best_at.epoch,
                run.results.init,
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


def suite_table(summary: SuiteSummary) -> str:
    """A `make glue` suite's table (as in its glue_summary.md)."""
    return table(list(summary.HEADER), summary.cells())
