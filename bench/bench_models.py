"""Training-step throughput of our BERT and GPT against the Hugging Face references.

    python bench/bench_models.py [--quick] [--steps 10] [--warmup 3] [--out bench/results/models.json]
    make bench-models

One fwd + bwd + AdamW step, same config, same weights (ours are imported from the HF model),
same inputs, same optimizer settings on both sides; HF runs its default best attention ("sdpa").
Steps of the two implementations alternate after a warm-up, so clock drift hits both alike;
the median step time gives tokens/s = batch * seq / median.

- BERT mini (4/256/4, seq 128, batch 32) vs `BertForPreTraining`: 15% of real tokens masked,
  NSP labels; HF scores MLM on every token (its API), ours gathers the masked positions first.
- GPT mini (4/256, 8 heads, 2 kv heads, SwiGLU 688, seq 256, batch 16, tied embeddings) vs
  `LlamaForCausalLM`; ours computes the loss with the fused chunked output layer.

`--size base` runs BERT-base and GPT-124M (for a GPU, with `--device cuda --dtype bf16`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from models import (
    BertConfig,
    GPTConfig,
    load_hf_bert,
    load_hf_gpt,
    masked_positions_from_labels,
    pretraining_loss,
)
from models.hf import bert_hf_config, llama_hf_config

Autocast = Callable[[], AbstractContextManager]

SIZES = {
    "mini": {"bert": ("mini", 128, 32), "gpt": ("mini", 256, 16)},
    "base": {"bert": ("base", 128, 32), "gpt": ("124m", 1024, 8)},
}


@dataclass
class Case:
    """One model pair: a step function per implementation and the tokens each step sees."""

    name: str
    tokens: int
    steps: dict[str, Callable[[], None]]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # The same fused AdamW on both sides (fused kernels exist for CPU and CUDA).
    return torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, fused=True
    )


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


def bert_case(size: str, device: torch.device, autocast: Autocast, seed: int = 0) -> Case:
    import transformers

    preset, T, B = SIZES[size]["bert"]
    c = BertConfig.from_preset(preset)
    hf = transformers.BertForPreTraining(
        transformers.BertConfig(
            **bert_hf_config(c, "BertForPreTraining"), attn_implementation="sdpa"
        )
    ).to(device)
    ours = load_hf_bert(hf).to(device)

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, c.vocab_size, (B, T), generator=g)
    lengths = torch.where(
        torch.rand(B, generator=g) < 0.1, torch.randint(8, T, (B,), generator=g), T
    )
    attention_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    token_type_ids = (torch.arange(T)[None] >= (lengths // 2)[:, None]).long() * attention_mask
    masked = (torch.rand(B, T, generator=g) < 0.15) & attention_mask.bool()
    masked[:, 0] = False  # never [CLS]
    labels = torch.where(masked, input_ids, -100)
    nsp = torch.randint(0, 2, (B,), generator=g)
    input_ids, attention_mask, token_type_ids, labels, nsp = (
        t.to(device) for t in (input_ids, attention_mask, token_type_ids, labels, nsp)
    )

    def hf_loss() -> torch.Tensor:
        return hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            labels=labels,
            next_sentence_label=nsp,
        ).loss

    def our_loss() -> torch.Tensor:
        positions, targets = masked_positions_from_labels(labels)
        out = ours(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            masked_positions=positions,
        )
        return pretraining_loss(out, targets, nsp).total

    return Case(
        name=f"bert-{preset}",
        tokens=B * T,
        steps={
            "ours": _train_step(ours, _optimizer(ours), our_loss, autocast),
            "hf": _train_step(hf, _optimizer(hf), hf_loss, autocast),
        },
    )


def gpt_case(size: str, device: torch.device, autocast: Autocast, seed: int = 0) -> Case:
    import transformers

    preset, T, B = SIZES[size]["gpt"]
    c = GPTConfig.from_preset(preset, max_seq_len=T)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**llama_hf_config(c), attn_implementation="sdpa")
    ).to(device)
    ours = load_hf_gpt(hf).to(device)

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, c.vocab_size, (B, T), generator=g).to(device)
    # Next-token targets aligned with the inputs; the last position has none (as HF's shift).
    targets = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1)

    def hf_loss() -> torch.Tensor:
        return hf(input_ids=input_ids, labels=input_ids).loss

    def our_loss() -> torch.Tensor:
        return ours(input_ids, targets=targets).loss

    return Case(
        name=f"gpt-{preset}",
        tokens=B * T,
        steps={
            "ours": _train_step(ours, _optimizer(ours), our_loss, autocast),
            "hf": _train_step(hf, _optimizer(hf), hf_loss, autocast),
        },
    )


def measure(case: Case, steps: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Step times per implementation, alternating implementations step by step."""

    def timed(step: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for step in case.steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {impl: [] for impl in case.steps}
    for _ in range(steps):
        for impl, step in case.steps.items():
            times[impl].append(timed(step))
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,gpt", help="comma list of bert, gpt")
    parser.add_argument("--size", choices=sorted(SIZES), default="mini")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=Path("bench/results/models.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    builders = {"bert": bert_case, "gpt": gpt_case}
    results = []
    for name in args.models.split(","):
        case = builders[name.strip()](args.size, device, autocast)
        times = measure(case, args.steps, args.warmup, device)
        row = {"model": case.name, "tokens_per_step": case.tokens}
        for impl, ts in times.items():
            median, best = statistics.median(ts), min(ts)
            row[impl] = {
                "median_step_s": median,
                "best_step_s": best,
                "tokens_per_s": case.tokens / median,
                "steps_s": ts,
            }
        row["speedup"] = row["hf"]["median_step_s"] / row["ours"]["median_step_s"]
        # Shared or throttled CPUs make single steps noisy; the best-step ratio is the bound
        # that noise cannot inflate.
        row["speedup_best_step"] = row["hf"]["best_step_s"] / row["ours"]["best_step_s"]
        results.append(row)
        del case

    import transformers

    report = {
        "benchmark": "fwd+bwd+AdamW training step, tokens/s",
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "dtype": args.dtype,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }
    print(f"\n{args.device} {args.dtype}, {args.threads} threads, median of {args.steps} steps\n")
    print("| model | ours tok/s | HF tok/s | ours / HF (median) | ours / HF (best step) |")
    print("|---|---:|---:|---:|---:|")
    for row in results:
        print(
            f"| {row['model']} | {row['ours']['tokens_per_s']:,.0f} | "
            f"{row['hf']['tokens_per_s']:,.0f} | {row['speedup']:.2f}x | "
            f"{row['speedup_best_step']:.2f}x |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
