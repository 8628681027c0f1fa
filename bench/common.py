"""What the benchmarks share: the shared data folder, facts about the machine, child processes
measured for wall time and peak memory, figures with their targets, and Markdown tables.

A *figure* is one measured comparison, ours against a reference measured in the same run on the
same machine: `ratio` is always ours / reference, and `met` says whether the ratio meets the
target (`at_least` or `at_most`), or is None where the figure has no target.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LMPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))
WIKITEXT2 = SHARED / "wikitext" / "wikitext-2-tokenized"


class BenchError(RuntimeError):
    """A benchmark cannot run or a run it started failed; the message says why and what to do."""


def require_data(path: Path, what: str) -> Path:
    """`path` if it exists, else a BenchError naming it and the fix."""
    if not path.exists():
        raise BenchError(
            f"{what} not found at {path}; put the shared data folder beside the checkout "
            "(../shared/data) or point LMPIPE_SHARED_DATA at it"
        )
    return path


def allocator() -> str:
    """The memory allocator this process (and its children) run with: a preloaded one, or glibc."""
    for library in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        name = Path(library).name
        for known in ("tcmalloc", "jemalloc"):
            if known in name:
                return known
    return "glibc"


CPU_FLAGS_REPORTED = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine() -> dict:
    """Where the figures were measured: host, CPU, cores, library versions."""
    import torch

    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:  # only the reference side needs it
        transformers_version = None
    from pipeline.training.precision import cpu_flags

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    flags = cpu_flags()
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpus": len(os.sched_getaffinity(0)),
        # what the CPU's matmuls can use: fp32 speed follows the vector width, and bf16 is
        # native only with avx512_bf16 or amx_bf16 (emulated, and slow, elsewhere)
        "cpu_flags": [flag for flag in CPU_FLAGS_REPORTED if flag in flags],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        # the Makefile preloads tcmalloc when installed; both sides of every ratio share it
        "allocator": allocator(),
        # other work on the machine skews the ratios: 1, 5 and 15-minute averages
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


@dataclasses.dataclass
class Measured:
    """A finished child process: exit status, wall time and peak resident memory."""

    returncode: int
    wall_s: float
    peak_rss_mb: float
    log: Path


def run_measured(
    command: Sequence[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    check: bool = True,
) -> Measured:
    """Run `command` from the repository root with its output in `log`; measure its wall time
    and peak RSS (its own `ru_maxrss`, through `bench/rss.py`, so that neither this process nor
    anything else on the machine counts).

    Raises:
        BenchError: with `check`, a non-zero exit (quoting the end of the log) or a timeout.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    peak_file = log.with_name(log.name + ".peak_kb")
    peak_file.unlink(missing_ok=True)
    wrapped = [sys.executable, "-I", "-S", str(REPO / "bench" / "rss.py"), str(peak_file)]
    start = time.perf_counter()
    with log.open("w") as out:
        # A session of its own: a timeout ends the go-between and the command together.
        process = subprocess.Popen(
            [*wrapped, *command],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except BaseException as err:  # a timeout, or Ctrl-C (which the child's session misses)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if isinstance(err, subprocess.TimeoutExpired):
                raise BenchError(
                    f"{' '.join(command[:4])} ... ran over {timeout_s:.0f} s; see {log}"
                ) from None
            raise
    wall_s = time.perf_counter() - start
    peak_kb = float(peak_file.read_text()) if peak_file.is_file() else float("nan")
    measured = Measured(returncode, wall_s, peak_kb / 1024, log)
    if check and returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BenchError(
            f"{' '.join(command[:4])} ... exited with status {returncode}; end of {log}:\n{tail}"
        )
    return measured


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child run: offline, without make's override hand-over."""
    env = {k: v for k, v in os.environ.items() if k not in ("LMPIPE_FROM_MAKE", "LMPIPE_RUN_STAMP")}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true", **extra})
    return env


def plan_steps(
    budget_s: float,
    step_s: float,
    val_batch_s: float,
    val_points: int,
    val_batches: int,
    margin: float = 0.9,
) -> tuple[int, int]:
    """(max_steps, val_every): the most steps whose training and at most `val_points`
    validations of `val_batches` fit in `margin` x the budget; max_steps is a multiple of
    val_every, so that the last step is validated."""
    spare = margin * budget_s - val_points * val_batches * val_batch_s
    steps = max(1, int(spare / step_s))
    val_every = -(-steps // val_points)  # rounded up: no more than val_points validations
    return steps - steps % val_every, val_every


def figure(
    benchmark: str,
    name: str,
    ours: float | None,
    reference: float | None,
    unit: str,
    *,
    at_least: float | None = None,
    at_most: float | None = None,
    target_on: str = "ratio",
) -> dict:
    """One comparison: ratio = ours / reference, checked against at most one target.

    The target applies to the ratio, or with `target_on="ours"` to our own value (an absolute
    target such as MFU >= 0.45). A figure with a target whose value is missing (e.g. ours never
    reached the loss) is not met; one without a target has `met` None.
    """
    if target_on not in ("ratio", "ours"):
        raise ValueError(f"target_on must be 'ratio' or 'ours', got {target_on!r}")
    ratio = ours / reference if ours is not None and reference else None
    value = ratio if target_on == "ratio" else ours
    prefix = "" if target_on == "ratio" else "ours "
    target, met = None, None
    if at_least is not None:
        target, met = f"{prefix}>= {at_least:g}", value is not None and value >= at_least
    elif at_most is not None:
        target, met = f"{prefix}<= {at_most:g}", value is not None and value <= at_most
    return {
        "benchmark": benchmark,
        "name": name,
        "ours": ours,
        "reference": reference,
        "unit": unit,
        "ratio": ratio,
        "target": target,
        "met": met,
    }


def number(value: float | None, digits: int = 3) -> str:
    """A figure for a table: thousands separated, `digits` significant digits below 1000."""
    if value is None:
        return "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A Markdown table, the first `left` columns left-aligned and the others right-aligned."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * left + "---:|" * (len(headers) - left),
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def figures_table(figures: Sequence[dict]) -> str:
    """The figures as a table: ours, the reference, their ratio and the target."""
    rows = []
    for f in figures:
        met = {True: "yes", False: "**no**", None: ""}[f["met"]]
        rows.append(
            [
                f["benchmark"],
                f"{f['name']} ({f['unit']})",
                number(f["ours"]),
                number(f["reference"]),
                number(f["ratio"]) + ("x" if f["ratio"] is not None else ""),
                f["target"] or "",
                met,
            ]
        )
    headers = ["benchmark", "figure", "ours", "reference", "ours / ref", "target", "met"]
    return markdown_table(headers, rows, left=2)


def write_json(report: dict, path: Path) -> Path:
    """Write `report` to `path` atomically: an interrupted write leaves the previous file."""
    # imported here, as pipeline is in machine(): importing bench.common needs no tokenizers
    from tokenizer.cache import write_text_atomic

    write_text_atomic(path, json.dumps(report, indent=2) + "\n")
    return path


def finish(report: dict, table: str, out: Path) -> dict:
    """Print a benchmark's table, write its report to `out` and say where; returns the report."""
    print(f"\n{table}")
    write_json(report, out)
    print(f"\nwrote {out}")
    return report


def command_line(main: Callable[[], object]) -> None:
    """Run a benchmark's `main` as a command: a BenchError ends it with one line, status 1."""
    try:
        main()
    except BenchError as err:
        sys.exit(f"error: {err}")
