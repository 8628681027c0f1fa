"""`make bench`: every benchmark in one run, each figure a ratio against a reference measured in
the same run on the same machine.

    python bench/run_all.py [--quick] [--only models,data,loss] [--results-dir DIR]
                            [--models-args "..."] [--data-args "..."] [--loss-args "..."]
    make bench            # about 25 minutes on a 2-core CPU
    make bench QUICK=1    # under 5 minutes, shortened (figures are rough)

1. Model step throughput, fp32 and bf16 autocast where the device has native bf16
   (`bench_models.py`).
2. Data: token-store MB/s and loader batches/s (`bench_data.py`).
3. Time to loss, and with it memory: the peak RSS of those runs and of data preparation
   (`bench_time_to_loss.py`, `bench_memory.py`).
4. On a machine with a CUDA GPU only: bf16 training at BERT-base and GPT-124M, tokens/s, MFU
   and peak memory against transformers (`bench_gpu.py`).

(They run in the order data, time to loss, models, so that missing shared data stops the run in
its first seconds; the report keeps the order above.)

Writes `<results-dir>/<date>_<host>.json` (every benchmark's report, and all figures in one
list) and the same name with `.md` (the summary of figures against their targets, then each
benchmark's table). The results folder is `bench/results` for a full run (results worth
committing) and `outputs/bench/results` for a quick one. `--models-args` etc. pass extra
options to one benchmark (the smoke test shrinks everything this way).
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch

from bench import bench_data, bench_gpu, bench_memory, bench_models, bench_time_to_loss
from bench.common import command_line, figures_table, machine, write_json
from pipeline.training.precision import NATIVE_BF16_FLAGS

BENCHMARKS = ("models", "data", "loss", "gpu")  # the order of the report
# The order of running: those that need the shared data first, so that its absence stops the run
# at once.
RUN_ORDER = ("data", "loss", "models", "gpu")
TITLES = {
    "models": "Model step throughput",
    "data": "Data pipeline",
    "loss": "Time to loss",
    "memory": "Memory",
    "gpu": "GPU training, bf16",
}
MODULES = {
    "models": bench_models,
    "data": bench_data,
    "loss": bench_time_to_loss,
    "gpu": bench_gpu,
}


def default_benchmarks() -> list[str]:
    """Every benchmark; the GPU one only where torch sees a CUDA device."""
    return [name for name in BENCHMARKS if name != "gpu" or torch.cuda.is_available()]


def run_benchmarks(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """The reports of the chosen benchmarks, each run with its own options."""
    quick = ["--quick"] if args.quick else []
    own_options = {  # each benchmark's output file (and work folder)
        "models": ["--out", str(work / "models.json")],
        "data": ["--out", str(work / "data.json")],
        "loss": [
            "--out",
            str(work / "time_to_loss.json"),
            "--work-dir",
            str(work / "time_to_loss"),
        ],
        "gpu": ["--out", str(work / "gpu.json")],
    }
    reports = {}
    for name in (name for name in RUN_ORDER if name in args.only):
        print(f"\n=== {TITLES[name]} ===", flush=True)
        extra = shlex.split(getattr(args, f"{name}_args"))
        reports[name] = MODULES[name].main(quick + own_options[name] + extra)
    return {name: reports[name] for name in BENCHMARKS if name in reports}


def tables(reports: dict[str, dict]) -> dict[str, str]:
    """Each benchmark's own table; memory comes from the time-to-loss runs."""
    out = {name: MODULES[name].table(report) for name, report in reports.items()}
    if "loss" in reports:
        out["memory"] = bench_memory.table(reports["loss"])
    return out


def all_figures(reports: dict[str, dict]) -> list[dict]:
    figures = [f for report in reports.values() for f in report["figures"]]
    if "loss" in reports:
        figures += bench_memory.figures(reports["loss"])
    return figures


def cpu_flags_text(flags: list[str] | None) -> str:
    """The CPU flags of a machine record, and whether its bf16 is native."""
    if flags is None:  # a record written before the flags were
        return "flags not recorded"
    native = set(NATIVE_BF16_FLAGS) & set(flags)
    return f"{' '.join(flags) or 'no AVX2'}; " + ("native bf16" if native else "no native bf16")


def markdown(report: dict, sections: dict[str, str]) -> str:
    m = report["machine"]
    kind = "quick run (`make bench QUICK=1`; rough figures)" if report["quick"] else "full run"
    lines = [
        f"# Benchmarks {report['date']} on {m['host']}",
        "",
        f"{m['cpu']}, {m['cpus']} CPUs"
        + f" ({cpu_flags_text(m.get('cpu_flags'))})"
        + (f", {m['gpu']}" if m["gpu"] else "")
        + f"; torch {m['torch']}, transformers {m['transformers']}; "
        f"{m.get('allocator', 'glibc')} allocator (both sides); {kind}, "
        f"{report['minutes']:.0f} minutes. Load average (1 min) {report['load_average_before'][0]:.1f} "
        f"before, {m['load_average'][0]:.1f} after: other work on the machine skews the ratios. "
        "Ratios are ours / reference, measured in this run.",
        "",
        "## Summary",
        "",
        figures_table(report["figures"]),
    ]
    for name, text in sections.items():
        lines += ["", f"## {TITLES[name]}", "", text]
    return "\n".join(lines) + "\n"


def result_name(date: str, host: str) -> str:
    return f"{date}_{re.sub(r'[^A-Za-z0-9._-]', '-', host)}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark shortened")
    parser.add_argument(
        "--only",
        default=",".join(default_benchmarks()),
        help="comma list of " + ", ".join(BENCHMARKS) + " (default: all, gpu only with a GPU)",
    )
    parser.add_argument(
        "--results-dir", type=Path, help="default bench/results (quick: outputs/bench/results)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=Path("outputs/bench"), help="per-benchmark outputs"
    )
    for name in BENCHMARKS:
        parser.add_argument(
            f"--{name}-args", default="", help=f"extra options of the {name} benchmark"
        )
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",")]
    if unknown := set(args.only) - set(BENCHMARKS):
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(BENCHMARKS)}")
    results_dir = args.results_dir or Path(
        "outputs/bench/results" if args.quick else "bench/results"
    )

    start, load_before = time.perf_counter(), machine()["load_average"]
    reports = run_benchmarks(args, args.work_dir)
    info = machine()
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": info,
        "quick": args.quick,
        "load_average_before": load_before,
        "command": " ".join(
            ["python", "bench/run_all.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "minutes": (time.perf_counter() - start) / 60,
        "figures": all_figures(reports),
        "benchmarks": reports,
    }
    text = markdown(report, tables(reports))
    stem = results_dir / result_name(report["date"], info["host"])
    write_json(report, Path(f"{stem}.json"))
    Path(f"{stem}.md").write_text(text)
    print(f"\n{text}\nwrote {stem}.json and {stem}.md")
    return report


if __name__ == "__main__":
    command_line(main)
