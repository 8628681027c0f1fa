"""Training-step throughput of our BERT and GPT against the Hugging Face references.

    python bench/bench_models.py [--quick] [--steps 6] [--warmup 2] [--dtype auto|fp32,bf16]
                                 [--compile] [--matmul-n 2048] [--out bench/results/models.json]
    make bench-models

One fwd + bwd + AdamW step, same config, same weights (ours are imported from the HF model),
same inputs, same optimizer settings on both sides; HF runs its default best attention ("sdpa").
In fp32 and under bf16 autocast (`--dtype`; the default, auto, skips bf16 on a CPU without
native bf16 and says so in the results). Targets on a CPU at the mini sizes: ours >= 2.0x the
tokens/s of transformers for BERT, >= 1.3x for GPT.
Steps of the two implementations alternate after a warm-up, so clock drift hits both alike;
the median step time gives tokens/s = batch * seq / median.

`--compile` (on in `make bench-models`) also times a copy of ours under `torch.compile`
(inductor, on a CPU too), as `module.compile=true` runs it: its step speedup over eager ours, and
the compilation (its first step, less an eager step) reported apart.

MFU: useful FLOPs per second (`models.flops.flops_per_token`: 6 N + attention, BERT's MLM head
on the masked 15%) over the matmul peak of the step's dtype measured first in the same run (the
best of a few timed `n x n` products; `--matmul-n`, 2048 on a CPU). 1 / the reference's MFU is
the ceiling on any speedup over it that the same useful work allows on this machine: where the
reference already runs near the matmul peak, no implementation of the same model can reach a
target above that ceiling.

- BERT mini (4/256/4, seq 128, batch 32) vs `BertForPreTraining`: 15% of real tokens masked
  (a new draw each step, four in turn), NSP labels; HF scores MLM on every token (its API),
  ours gathers the masked positions first.
- GPT mini (4/256, 8 heads, 2 kv heads, SwiGLU 688, seq 256, batch 16, tied embeddings) vs
  `LlamaForCausalLM`; ours computes the loss with the fused chunked output layer.

`--size base` runs BERT-base and GPT-124M (for a GPU, with `--device cuda --dtype bf16`);
`--size tiny` is for the smoke test. `--vocab-size` replaces the presets' vocabularies (30,522 for
BERT, 50,304 for GPT; `make pretrain` trains an 8,192-token tokenizer): the larger the
vocabulary, the more the output layer and its loss weigh in a step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.common import command_line, figure, finish, machine, markdown_table, number
from models import (
    BertConfig,
    GPTConfig,
    flops_per_token,
    load_hf_bert,
    load_hf_gpt,
    masked_positions_from_labels,
    pretraining_loss,
)
from models.hf_bert import bert_hf_config
from models.hf_llama import llama_hf_config
from pipeline.training.precision import native_bf16_flags

MASK_DRAWS = 4  # BERT masks cycled through, one per step
MLM_FRACTION = 0.15  # share of tokens BERT's MLM head runs on (the recipe's masking rate)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Targets of issue 8: ours / transformers tokens/s at the mini sizes on a CPU.
CPU_TARGETS = {"bert": 2.0, "gpt": 1.3}

Autocast = Callable[[], AbstractContextManager]

SIZES = {
    "tiny": {"bert": ("tiny", 32, 4), "gpt": ("tiny", 32, 4)},  # for the smoke test
    "mini": {"bert": ("mini", 128, 32), "gpt": ("mini", 256, 16)},
    "base": {"bert": ("base", 128, 32), "gpt": ("124m", 1024, 8)},
}


@dataclass
class Case:
    """One model pair: a step function per implementation, the tokens each step sees, and the
    shared config and shape (for FLOPs); `predicted_fraction`: the share of tokens its output
    head runs on (`models.flops.flops_per_token`)."""

    name: str
    tokens: int
    steps: dict[str, Callable[[], None]]
    config: BertConfig | GPTConfig
    seq_len: int
    batch: int
    predicted_fraction: float = 1.0


def useful_flops_per_token(case: Case) -> float:
    """Training FLOPs per token that any implementation of the case's model must do
    (`models.flops.flops_per_token`: 6 N + attention, BERT's MLM head on the masked 15%)."""
    return flops_per_token(case.config, case.seq_len, predicted_fraction=case.predicted_fraction)


def default_matmul_n(device: torch.device) -> int:
    """Size of the peak's square matmuls: large enough to reach the device's peak rate."""
    return 8192 if device.type == "cuda" else 2048


def matmul_peak(
    device: torch.device, n: int, dtype: torch.dtype, reps: int = 20, trials: int = 5
) -> dict:
    """Best matmul FLOP/s of `reps` back-to-back `n x n` products in `dtype`, over `trials`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    rates = []
    for _ in range(trials):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        synchronize(device)
        rates.append(2 * n**3 * reps / (time.perf_counter() - start))
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "reps": reps,
        "flops_per_s": max(rates),
        "trials_flops_per_s": rates,
    }


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # The same fused AdamW on both sides (fused kernels exist for CPU and CUDA).
    return torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, fused=True
    )


def _compiled_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (same weights) compiled in place, as `module.compile=true` does."""
    import copy

    compiled = copy.deepcopy(model)
    compiled.compile()
    return compiled


def _train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    autocast: Autocast,
) -> Callable[[], None]:
    def step() -> None:
        with autocast():
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    return step


def bert_case(
    size: str,
    device: torch.device,
    autocast: Autocast,
    seed: int = 0,
    vocab_size: int | None = None,
    batch: int | None = None,
    compile_ours: bool = False,
    compare_compiled: bool = False,
) -> Case:
    import transformers

    preset, T, B = SIZES[size]["bert"]
    B = batch or B
    c = BertConfig.from_preset(preset, **({"vocab_size": vocab_size} if vocab_size else {}))
    hf = transformers.BertForPreTraining(
        transformers.BertConfig(
            **bert_hf_config(c, "BertForPreTraining"), attn_implementation="sdpa"
        )
    ).to(device)
    ours = load_hf_bert(hf).to(device)
    compiled = _compiled_copy(ours) if compare_compiled else None
    if compile_ours:
        ours.compile()  # in place, as `module.compile=true` does in make pretrain

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, c.vocab_size, (B, T), generator=g)
    lengths = torch.where(
        torch.rand(B, generator=g) < 0.1, torch.randint(8, T, (B,), generator=g), T
    )
    attention_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    token_type_ids = (torch.arange(T)[None] >= (lengths // 2)[:, None]).long() * attention_mask
    # Masks redrawn each step (four draws in turn): the number of masked tokens changes from
    # step to step as in real batches, which a compiled model must cope with.
    label_draws = []
    for _ in range(MASK_DRAWS):
        masked = (torch.rand(B, T, generator=g) < 0.15) & attention_mask.bool()
        masked[:, 0] = False  # never [CLS]
        label_draws.append(torch.where(masked, input_ids, -100).to(device))
    nsp = torch.randint(0, 2, (B,), generator=g)
    input_ids, attention_mask, token_type_ids, nsp = (
        t.to(device) for t in (input_ids, attention_mask, token_type_ids, nsp)
    )
    hf_labels = itertools.cycle(label_draws)

    def hf_loss() -> torch.Tensor:
        return hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            labels=next(hf_labels),
            next_sentence_label=nsp,
        ).loss

    def our_loss(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
        labels = itertools.cycle(label_draws)  # each model sees the draws in the same turn

        def loss() -> torch.Tensor:
            positions, targets = masked_positions_from_labels(next(labels))
            out = model(
                input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                masked_positions=positions,
            )
            return pretraining_loss(out, targets, nsp).total

        return loss

    steps = {
        "ours": _train_step(ours, _optimizer(ours), our_loss(ours), autocast),
        "hf": _train_step(hf, _optimizer(hf), hf_loss, autocast),
    }
    if compiled is not None:
        steps["ours_compiled"] = _train_step(
            compiled, _optimizer(compiled), our_loss(compiled), autocast
        )
    return Case(
        name=f"bert-{preset}",
        tokens=B * T,
        steps=steps,
        config=c,
        seq_len=T,
        batch=B,
        predicted_fraction=MLM_FRACTION,
    )


def gpt_case(
    size: str,
    device: torch.device,
    autocast: Autocast,
    seed: int = 0,
    vocab_size: int | None = None,
    batch: int | None = None,
    compile_ours: bool = False,
    compare_compiled: bool = False,
) -> Case:
    import transformers

    preset, T, B = SIZES[size]["gpt"]
    B = batch or B
    c = GPTConfig.from_preset(
        preset, max_seq_len=T, **({"vocab_size": vocab_size} if vocab_size else {})
    )
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**llama_hf_config(c), attn_implementation="sdpa")
    ).to(device)
    ours = load_hf_gpt(hf).to(device)
    compiled = _compiled_copy(ours) if compare_compiled else None
    if compile_ours:
        ours.compile()  # in place, as `module.compile=true` does in make pretrain

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, c.vocab_size, (B, T), generator=g).to(device)
    # Next-token targets aligned with the inputs; the last position has none (as HF's shift).
    targets = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1)

    def hf_loss() -> torch.Tensor:
        return hf(input_ids=input_ids, labels=input_ids).loss

    steps = {
        "ours": _train_step(
            ours, _optimizer(ours), lambda: ours(input_ids, targets=targets).loss, autocast
        ),
        "hf": _train_step(hf, _optimizer(hf), hf_loss, autocast),
    }
    if compiled is not None:
        steps["ours_compiled"] = _train_step(
            compiled,
            _optimizer(compiled),
            lambda: compiled(input_ids, targets=targets).loss,
            autocast,
        )
    return Case(
        name=f"gpt-{preset}",
        tokens=B * T,
        steps=steps,
        config=c,
        seq_len=T,
        batch=B,
    )


def measure(
    case: Case, steps: int, warmup: int, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(step times per implementation, alternating implementations step by step; the time of
    each implementation's first step, which compiles a compiled model)."""

    def timed(step: Callable[[], None]) -> float:
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        return time.perf_counter() - start

    first: dict[str, float] = {}
    for impl, step in case.steps.items():
        first[impl] = timed(step)  # compiles, for a compiled model
        for _ in range(warmup - 1):
            step()
    times: dict[str, list[float]] = {impl: [] for impl in case.steps}
    for _ in range(steps):
        for impl, step in case.steps.items():
            times[impl].append(timed(step))
    return times, first


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,gpt", help="comma list of bert, gpt")
    parser.add_argument("--size", choices=sorted(SIZES), default="mini")
    parser.add_argument(
        "--vocab-size", type=int, help="default: the preset's (30,522 BERT, 50,304 GPT)"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation")
    parser.add_argument(
        "--warmup", type=int, default=2, help="steps first, outside the medians (at least 1)"
    )
    parser.add_argument("--quick", action="store_true", help="1 timed step after 1 warm-up")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="comma list of fp32, bf16 (bf16 = autocast); auto: fp32, and bf16 where the "
        "device computes it natively (a GPU, or a CPU with avx512_bf16 or amx_bf16)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time ours under torch.compile (module.compile=true): step speedup over "
        "eager, and the compilation time apart",
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--matmul-n", type=int, help="peak matmul size (2048 on CPU, 8192 GPU)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/models.json"))
    args = parser.parse_args(argv)
    peak_runs = {"reps": 5, "trials": 3}
    if args.quick:
        args.steps, args.warmup = 1, 1
        peak_runs = {"reps": 2, "trials": 1}
    dtypes, skipped = chosen_dtypes(args.dtype, args.device)
    if unknown := set(dtypes) - {"fp32", "bf16"}:
        parser.error(f"--dtype: unknown {sorted(unknown)}; use fp32, bf16, fp32,bf16 or auto")
    for dtype, why in skipped.items():
        print(f"{dtype} skipped: {why}", flush=True)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    builders = {"bert": bert_case, "gpt": gpt_case}
    results, peaks = [], {}
    matmul_n = args.matmul_n or default_matmul_n(device)
    for dtype in dtypes:
        peaks[dtype] = matmul_peak(device, matmul_n, DTYPES[dtype], **peak_runs)
        print(f"{dtype} matmul peak: {peaks[dtype]['flops_per_s'] / 1e9:,.0f} GFLOP/s", flush=True)

        def autocast(dtype=dtype):
            return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

        for name in args.models.split(","):
            torch.manual_seed(0)
            case = builders[name.strip()](
                args.size,
                device,
                autocast,
                vocab_size=args.vocab_size,
                compare_compiled=args.compile,
            )
            times, first = measure(case, args.steps, args.warmup, device)
            row = compare(case, times, peaks[dtype]["flops_per_s"]) | {"dtype": dtype}
            if "ours_compiled" in times:
                row["compile"] = {
                    "speedup": row["ours"]["median_step_s"] / row["ours_compiled"]["median_step_s"],
                    # the first compiled step, less an eager one: the compilation itself
                    "compile_s": first["ours_compiled"] - row["ours"]["median_step_s"],
                }
            results.append(row)
            del case

    import transformers

    report = {
        "benchmark": "fwd+bwd+AdamW training step, tokens/s",
        "machine": machine(),
        "device": args.device,
        "size": args.size,
        "vocab_size": args.vocab_size,
        "dtypes": dtypes,
        "skipped": skipped,
        "compile": args.compile,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "matmul_peaks": peaks,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }
    report["figures"] = figures(report)
    return finish(report, table(report), args.out)


def chosen_dtypes(spelled: str, device: str) -> tuple[list[str], dict[str, str]]:
    """(the dtypes to run, {dtype: why it is skipped}); `auto` runs bf16 only where it is
    native, since an emulated bf16 (a CPU without avx512_bf16 or amx_bf16) takes many times
    longer than fp32 and measures nothing a user would run."""
    if spelled != "auto":
        return [d.strip() for d in spelled.split(",")], {}
    if device.startswith("cuda") or native_bf16_flags():
        return ["fp32", "bf16"], {}
    why = (
        "this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag): bf16 autocast is "
        "emulated there, several times slower than fp32 (--dtype fp32,bf16 runs it anyway)"
    )
    return ["fp32"], {"bf16": why}


def compare(case: Case, times: dict[str, list[float]], peak_flops_per_s: float) -> dict:
    """Median and best step times of both implementations, tokens/s, MFU and the ratios.

    MFU is the useful FLOPs per second (`useful_flops_per_token`) over the matmul peak measured
    in the same run. `speedup_ceiling` = 1 / the reference's MFU: the most any implementation
    doing the same useful FLOPs could gain over the reference, were all its time spent in
    matmuls at the peak rate.
    """
    flops = useful_flops_per_token(case)
    row = {"model": case.name, "tokens_per_step": case.tokens, "flops_per_token": flops}
    for impl, ts in times.items():
        median, best = statistics.median(ts), min(ts)
        tokens_per_s = case.tokens / median
        row[impl] = {
            "median_step_s": median,
            "best_step_s": best,
            "tokens_per_s": tokens_per_s,
            "mfu": flops * tokens_per_s / peak_flops_per_s,
            "steps_s": ts,
        }
    row["speedup"] = row["hf"]["median_step_s"] / row["ours"]["median_step_s"]
    # Shared or throttled CPUs make single steps noisy; the best-step ratio is the bound
    # that noise cannot inflate.
    row["speedup_best_step"] = row["hf"]["best_step_s"] / row["ours"]["best_step_s"]
    row["speedup_ceiling"] = 1 / row["hf"]["mfu"]
    return row


def figures(report: dict) -> list[dict]:
    """tokens/s of ours against HF per model and dtype; the CPU targets apply to the mini
    sizes on a CPU only."""
    rows = []
    for row in report["results"]:
        family = row["model"].split("-")[0]
        target = (
            CPU_TARGETS[family] if (report["device"], report["size"]) == ("cpu", "mini") else None
        )
        rows.append(
            figure(
                f"model step, {row['dtype']}",
                f"{row['model']} training step",
                row["ours"]["tokens_per_s"],
                row["hf"]["tokens_per_s"],
                "tokens/s",
                at_least=target,
            )
        )
    return rows


def table(report: dict) -> str:
    """The report as Markdown: a heading line and one row per model and dtype."""
    peaks = ", ".join(
        f"{dtype} {peak['flops_per_s'] / 1e9:,.0f} GFLOP/s"
        for dtype, peak in report["matmul_peaks"].items()
    )
    head = (
        f"{report['device']}, {report['threads']} threads, vocabulary "
        f"{report['vocab_size'] or 'of the preset'}, median of {report['steps']} steps "
        f"after {report['warmup']} warm-up (ours vs transformers {report['transformers']}); "
        f"measured matmul peak {peaks}; ceiling = 1 / HF's MFU, the most any implementation "
        "of the same useful FLOPs could gain at that peak"
    )
    rows = [
        [
            row["model"],
            row["dtype"],
            number(row["ours"]["tokens_per_s"]),
            number(row["hf"]["tokens_per_s"]),
            f"{row['speedup']:.2f}x",
            f"{row['speedup_best_step']:.2f}x",
            f"{100 * row['ours']['mfu']:.0f}% / {100 * row['hf']['mfu']:.0f}%",
            f"{row['speedup_ceiling']:.2f}x",
        ]
        for row in report["results"]
    ]
    headers = [
        "model",
        "dtype",
        "ours tok/s",
        "HF tok/s",
        "ours / HF (median)",
        "(best step)",
        "MFU ours / HF",
        "ceiling",
    ]
    compiled = [
        f"{row['model']} {row['dtype']}: compiled {row['compile']['speedup']:.2f}x eager's speed "
        f"(compiling took {row['compile']['compile_s']:.0f} s)"
        for row in report["results"]
        if "compile" in row
    ]
    if compiled:
        notes_compiled = "\n\ntorch.compile (module.compile=true): " + "; ".join(compiled)
    else:
        notes_compiled = ""
    notes = notes_compiled + "".join(
        f"\n\n{dtype} not run: {why}" for dtype, why in report.get("skipped", {}).items()
    )
    return f"{head}\n\n{markdown_table(headers, rows)}{notes}"


if __name__ == "__main__":
    command_line(main)
