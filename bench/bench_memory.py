"""Peak memory: resident set (RSS) of data preparation and of training both minis, ours against
the `transformers` reference loop.

    python bench/bench_memory.py [--quick] [--budget-s 30] [--out outputs/bench/memory.json]
    make bench-memory

The processes are those of the time-to-loss benchmark (`bench_time_to_loss.py`), run here with a
short budget: `python -m pipeline.commands.prepare` into a fresh cache (tokenizer training and token-store
building, WikiText-2), then per model the reference loop and `python -m pipeline.commands.pretrain`
(which also writes checkpoints and the HF export at the end). A process's peak is its own
`ru_maxrss` from `wait4`, so nothing else on the machine counts. `make bench` takes these figures
from its full-length time-to-loss runs instead of running them again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench import bench_time_to_loss
from bench.common import command_line, figure, finish, markdown_table, number

FULL = {"budget_s": 30, "val_points": 2, "val_batches": 4}


def figures(loss_report: dict) -> list[dict]:
    """Peak RSS of each model's training (ours / reference) and data preparation (ours only)."""
    rows = []
    for name, result in loss_report["results"].items():
        p = result["processes"]
        rows.append(
            figure(
                "memory",
                f"{name} training peak RSS",
                p["ours"]["peak_rss_mb"],
                p["reference"]["peak_rss_mb"],
                "MB",
            )
        )
        rows.append(
            figure(
                "memory",
                f"{name} data preparation peak RSS",
                p["prepare"]["peak_rss_mb"],
                None,
                "MB",
            )
        )
    return rows


def table(loss_report: dict) -> str:
    """One row per model: data preparation, then training ours and reference."""
    rows = []
    for name, result in loss_report["results"].items():
        p = result["processes"]
        rows.append(
            [
                name,
                number(p["prepare"]["peak_rss_mb"]),
                f"{p['prepare']['wall_s']:.0f}",
                number(p["ours"]["peak_rss_mb"]),
                number(p["reference"]["peak_rss_mb"]),
                f"{p['ours']['peak_rss_mb'] / p['reference']['peak_rss_mb']:.2f}x",
            ]
        )
    headers = [
        "model",
        "data preparation MB",
        "preparation s",
        "training MB ours",
        "training MB reference",
        "ours / ref",
    ]
    head = "peak RSS per process (ru_maxrss)"
    return f"{head}\n\n{markdown_table(headers, rows)}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_time_to_loss.add_run_arguments(parser)
    parser.set_defaults(work_dir=Path("outputs/bench/memory"), no_recipe=True)  # not measured here
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/memory.json"))
    args = bench_time_to_loss.resolve(parser.parse_args(argv), FULL)
    runs = bench_time_to_loss.run(args)
    report = {
        "benchmark": "peak RSS of data preparation and training",
        "machine": runs["machine"],
        "budget_s": args.budget_s,
        "results": {name: result["processes"] for name, result in runs["results"].items()},
        "figures": figures(runs),
    }
    return finish(report, table(runs), args.out)


if __name__ == "__main__":
    command_line(main)
