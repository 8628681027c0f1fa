"""GPU training throughput at BERT-base (seq 128) and a GPT-124M-class model (seq 1024) in bf16:
tokens/s, sequences/s, MFU against the bf16 matmul peak measured in the same run, and peak step
memory; ours (`torch.compile`, SDPA, as `make pretrain module.compile=true` runs it)
against transformers (`BertForPreTraining`, `LlamaForCausalLM`, sdpa, eager).

    python bench/bench_gpu.py [--quick] [--steps 20] [--warmup 5] [--bert-batch 256]
                              [--gpt-batch 16] [--no-compile] [--profile DIR]
                              [--out bench/results/gpu.json]
    make bench-gpu

Targets of issue 8 on one H200: GPT-124M-class MFU >= 45%, BERT-base >= 3,000 sequences/s.

- Peak: the best of several timed runs of `n x n @ n x n` bf16 matmuls (n = 8192 on a GPU),
  measured first in the same process, so MFU is against what this device reaches, not a
  datasheet figure.
- MFU = FLOPs per token x tokens/s / peak, with `models.flops.flops_per_token` (6 N + attention,
  PaLM's count; BERT's MLM head counted on the 15% masked tokens) for both implementations, so
  the two MFUs compare useful work (transformers' BERT also scores MLM on every token). The
  target is checked against the measured peak, as issue 8 asks; MFU against the datasheet bf16
  peak (`pipeline.training.callbacks.BF16_PEAK_FLOPS`, what `make pretrain` logs; 989 TFLOP/s for an
  H100/H200, which a plain matmul reaches only ~70-80% of) is reported beside it.
- BERT's masks are redrawn every step (four precomputed draws in turn, as
  `bench_models`), so a compiled model meets the changing number of masked tokens that real
  batches bring. BERT's padding mask rules out SDPA's flash kernel (it runs the
  memory-efficient one); GPT's causal attention runs flash.
- Steps: fwd + bwd + fused AdamW on the same weights and inputs (`bench_models`' cases), each
  implementation timed over its own run of steps after its warm-up (compilation included in the
  warm-up), synchronized around each step; the median step gives tokens/s.
- Peak step memory: the most `torch.cuda.max_memory_allocated` rises above what is allocated
  before a step (activations, gradients, workspaces), so the other implementation's resident
  weights do not count; the resident weights and optimizer state are reported beside it.
- `--profile DIR` writes the PyTorch profiler's op table of three steps of each implementation.

It runs on a CPU too (`--device cpu`, a smaller matmul for the peak), which is how the test suite
checks it; the targets only apply on CUDA at the base sizes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.bench_models import (
    SIZES,
    Case,
    bert_case,
    default_matmul_n,
    gpt_case,
    matmul_peak,
    synchronize,
    useful_flops_per_token,
)
from bench.common import BenchError, command_line, figure, finish, machine, markdown_table, number
from models import param_count
from pipeline.training.callbacks import device_peak_flops

# Issue 8's targets, on a GPU at the base sizes.
GPT_MFU_TARGET = 0.45
BERT_SEQ_PER_S_TARGET = 3000.0


def measure_implementation(
    step: Callable[[], None], steps: int, warmup: int, device: torch.device
) -> dict:
    """Step times and the peak memory a step adds over what was allocated before it."""
    for _ in range(warmup):
        step()
    times, peaks = [], []
    for _ in range(steps):
        synchronize(device)
        if device.type == "cuda":
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) - before)
    return {
        "median_step_s": statistics.median(times),
        "steps_s": times,
        "peak_step_mb": max(peaks) / 2**20 if peaks else None,
    }


def profile_steps(step: Callable[[], None], device: torch.device, path: Path) -> None:
    """The profiler's op table (by device time on a GPU) of three steps, written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")


def resident_mb(case: Case) -> float:
    """Weights (fp32) + AdamW's two moments of one implementation: 12 bytes per parameter."""
    return 12 * param_count(case.config) / 2**20


def run_case(
    case: Case, args: argparse.Namespace, device: torch.device, peak: float, datasheet: float | None
) -> dict:
    flops = useful_flops_per_token(case)
    row = {
        "model": case.name,
        "seq_len": case.seq_len,
        "batch": case.batch,
        "flops_per_token": flops,
        "resident_mb": resident_mb(case),
    }
    for impl, step in case.steps.items():
        result = measure_implementation(step, args.steps, args.warmup, device)
        tokens_per_s = case.tokens / result["median_step_s"]
        row[impl] = result | {
            "tokens_per_s": tokens_per_s,
            "sequences_per_s": case.batch / result["median_step_s"],
            "mfu": flops * tokens_per_s / peak,
            "mfu_datasheet": flops * tokens_per_s / datasheet if datasheet else None,
        }
        if args.profile:
            profile_steps(step, device, args.profile / f"{case.name}_{impl}.txt")
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,gpt", help="comma list of bert, gpt")
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (and compilation)")
    parser.add_argument("--bert-batch", type=int, default=256, help="sequences of 128 tokens")
    parser.add_argument("--gpt-batch", type=int, default=16, help="sequences of 1024 tokens")
    parser.add_argument("--quick", action="store_true", help="5 timed steps after 3")
    parser.add_argument("--no-compile", action="store_true", help="run ours eagerly")
    parser.add_argument("--matmul-n", type=int, help="peak matmul size (8192 on GPU, 2048 CPU)")
    parser.add_argument("--profile", type=Path, help="write profiler op tables into this folder")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 5, 3
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no GPU visible to torch; use --device cpu to try it here")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    if unknown := {m.strip() for m in args.models.split(",")} - {"bert", "gpt"}:
        parser.error(f"--models: unknown {sorted(unknown)}; use bert, gpt or bert,gpt")
    peak = matmul_peak(device, args.matmul_n or default_matmul_n(device), torch.bfloat16)
    datasheet = device_peak_flops(device)
    print(f"bf16 matmul peak: {peak['flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    builders = {"bert": (bert_case, args.bert_batch), "gpt": (gpt_case, args.gpt_batch)}
    results = []
    for name in args.models.split(","):
        build, batch = builders[name.strip()]
        torch.manual_seed(0)
        case = build(args.size, device, autocast, batch=batch, compile_ours=not args.no_compile)
        print(f"{case.name}: batch {case.batch} x {case.seq_len}", flush=True)
        results.append(run_case(case, args, device, peak["flops_per_s"], datasheet))
        del case
        gc.collect()
        torch._dynamo.reset()  # let the compiled model go before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()

    import transformers

    report = {
        "benchmark": "bf16 training step on a GPU: tokens/s, MFU, peak step memory",
        "machine": machine(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": args.size,
        "compile": not args.no_compile,
        "steps": args.steps,
        "warmup": args.warmup,
        "peak": peak,
        "datasheet_peak_flops_per_s": datasheet,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }
    report["figures"] = figures(report)
    return finish(report, table(report), args.out)


def figures(report: dict) -> list[dict]:
    """Per model, MFU and sequences/s of ours against transformers; the targets (on our value)
    are GPT's MFU and BERT's sequences/s, on CUDA at the base size only."""
    on_target = report["device"].startswith("cuda") and report["size"] == "base"
    measures = (  # key, name, unit, the family whose target it is, the target
        ("mfu", "MFU", "fraction of peak", "gpt", GPT_MFU_TARGET),
        ("sequences_per_s", "sequences/s", "seq/s", "bert", BERT_SEQ_PER_S_TARGET),
    )
    rows = []
    for row in report["results"]:
        family = row["model"].split("-")[0]
        for key, name, unit, target_family, target in measures:
            rows.append(
                figure(
                    "gpu",
                    f"{row['model']} {name}",
                    row["ours"][key],
                    row["hf"][key],
                    unit,
                    at_least=target if on_target and family == target_family else None,
                    target_on="ours",
                )
            )
    return rows


def table(report: dict) -> str:
    peak = report["peak"]["flops_per_s"]
    head = (
        f"{report['device_name']}, bf16 autocast, ours {'compiled' if report['compile'] else 'eager'}"
        f" vs transformers {report['transformers']} (sdpa, eager); median of {report['steps']} "
        f"steps after {report['warmup']}; measured bf16 matmul peak {peak / 1e12:.1f} TFLOP/s "
        f"(n = {report['peak']['n']})"
    )
    rows = []
    for row in report["results"]:
        for impl in ("ours", "hf"):
            r = row[impl]
            rows.append(
                [
                    row["model"],
                    impl,
                    f"{row['batch']} x {row['seq_len']}",
                    number(r["tokens_per_s"]),
                    number(r["sequences_per_s"]),
                    f"{100 * r['mfu']:.1f}%",
                    f"{100 * r['mfu_datasheet']:.1f}%" if r["mfu_datasheet"] else "—",
                    number(r["peak_step_mb"]),
                    number(row["resident_mb"]),
                ]
            )
    headers = [
        "model",
        "impl",
        "batch x seq",
        "tokens/s",
        "seq/s",
        "MFU (measured peak)",
        "MFU (datasheet)",
        "peak step MB",
        "resident MB",
    ]
    return f"{head}\n\n{markdown_table(headers, rows)}"


if __name__ == "__main__":
    command_line(main)
