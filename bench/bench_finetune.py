"""Fine-tuning step speed of a pair task read apart (a siamese head): the backbone reading each
side of the pairs at its own width (`models.heads.encode_pair_sides`) against all 2B rows at
the batch's width (as before), on the same model, batches and threads, with the scores
compared.

    python bench/bench_finetune.py [--task rte] [--size mini] [--steps 20] [--repeats 3]
                                   [--threads N] [--out outputs/bench/finetune.json]
    make bench-finetune         # QUICK=1: 3 steps, one repeat

The batches are those `make glue` trains on: the task's fixed sample of 2,000 training
examples (`datamodule.train_examples`), 32 pairs per step, sequences of at most 128 tokens, in
the first epoch's order at seed 1. The model is BERT of the `--size` preset with random weights
(a step costs the same whatever the weights) over a WordPiece tokenizer of `--vocab-size` tokens
trained on WikiText-2's validation text, under the head that `make glue` gives a classification
pair at mini widths (mean pooling, alignment scores). Each timed step is a forward pass, the
loss, the backward pass and an AdamW step; the two ways alternate step by step, each on its
own copy of the model, so that other load on the machine hits both alike.

Reported: the tokens the backbone reads per step (padding included, counted as it reads them), the median seconds per
step of each way and their ratio (wall, and this process's CPU seconds: the steadier ratio on
a machine shared with other jobs, with `--threads 1`), and the largest difference of a dev score between the two on
the same weights (evaluation mode; float rounding only).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch
from omegaconf import OmegaConf

import models.heads
from bench.bench_blimp import random_berts
from bench.common import (
    REPO,
    SHARED,
    BenchError,
    command_line,
    figure,
    figures_table,
    finish,
    machine,
    markdown_table,
    number,
    require_data,
)
from models.heads import SequenceClassifier, sequence_loss
from pipeline.finetune.settings import build_datamodule, task_from
from tokenizer import special_ids

WAYS = ("sides", "whole")  # ours, and all rows at the batch's width (the reference)
SETTINGS = {  # conf/finetune.yaml's batches, conf/suite/quick.yaml's sample
    "max_seq_len": 128,
    "batch_size": 32,
    "eval_batch_size": 64,
    "num_workers": 0,
    "max_examples": None,
    "train_examples": 2000,
}


def whole_batch(encode, input_ids, attention_mask, token_type_ids=None):
    """The reference: `encode` of all the rows, at the batch's width."""
    return encode(input_ids, attention_mask, token_type_ids)


@contextmanager
def reading(way: str):
    """The head reads pairs `way`: "sides" (the code as it is) or "whole" (the reference)."""
    if way == "sides":
        yield
        return
    ours = models.heads.encode_pair_sides
    models.heads.encode_pair_sides = whole_batch
    try:
        yield
    finally:
        models.heads.encode_pair_sides = ours


@contextmanager
def counting_tokens(head: SequenceClassifier, counted: list[int]):
    """Appends to `counted` the token positions (padding included) of each batch the head's
    backbone reads inside the block."""
    hook = head.backbone.register_forward_pre_hook(
        lambda _module, args: counted.append(args[0].numel())
    )
    try:
        yield
    finally:
        hook.remove()


def scores_of(head: SequenceClassifier, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return head(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
    )


def train_step(head: SequenceClassifier, optimizer, batch: dict[str, torch.Tensor]) -> tuple:
    """(wall seconds, CPU seconds of this process) of one optimizer step on `batch`."""
    wall, cpu = time.perf_counter(), time.process_time()
    scores = scores_of(head, batch)
    sequence_loss(scores, batch["labels"]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="rte", help="a GLUE pair task of conf/task/")
    parser.add_argument("--size", default="mini", help="the BERT preset")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20, help="training steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 steps, one repeat")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/finetune.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 1
    torch.set_num_threads(args.threads)
    node = OmegaConf.load(REPO / "conf" / "task" / f"{args.task}.yaml")
    node.data_dir = str(require_data(SHARED / "glue" / Path(node.data_dir).name, "GLUE"))
    task = task_from(node)
    if not task.is_pair:
        raise BenchError(
            f"--task {args.task} has one text column; this bench times pairs read apart: give a "
            "pair task, e.g. --task rte (or mrpc, stsb, qnli)"
        )
    [(name, pretrained)] = random_berts([args.size], args.vocab_size)
    data = build_datamodule(
        task, pretrained.tokenizer, dict(SETTINGS), 1, siamese=True, family="bert"
    )
    data.setup("fit")
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(args.steps)]
    torch.manual_seed(0)
    head = SequenceClassifier(
        pretrained.model,
        len(task.labels),
        pooling="mean",
        siamese=True,
        pair_score="alignment",
        special_ids=special_ids(pretrained.tokenizer).ordered(),
    )
    heads = {way: copy.deepcopy(head).train() for way in WAYS}
    optimizers = {way: torch.optim.AdamW(h.parameters(), lr=1e-4) for way, h in heads.items()}
    for way in WAYS:  # warm-up: allocator, kernels, the optimizer's state
        with reading(way):
            for batch in batches[:2]:
                train_step(heads[way], optimizers[way], batch)
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu_seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    counted: dict[str, list[int]] = {way: [] for way in WAYS}  # tokens read, first repeat
    for repeat in range(args.repeats):
        wall, cpu = {way: 0.0 for way in WAYS}, {way: 0.0 for way in WAYS}
        for step, batch in enumerate(batches):
            for way in WAYS if step % 2 == 0 else WAYS[::-1]:
                with reading(way), counting_tokens(heads[way], counted[way] if not repeat else []):
                    step_wall, step_cpu = train_step(heads[way], optimizers[way], batch)
                wall[way] += step_wall
                cpu[way] += step_cpu
        for way in WAYS:
            seconds[way].append(wall[way] / len(batches))
            cpu_seconds[way].append(cpu[way] / len(batches))
        print(
            f"{name} {args.task} {repeat + 1}/{args.repeats}: "
            + ", ".join(f"{way} {seconds[way][-1]:.3f} s/step" for way in WAYS),
            flush=True,
        )
    head.eval()
    dev = next(iter(data.val_dataloader()[0]))  # the first 64 dev pairs
    with torch.no_grad():
        scores = {}
        for way in WAYS:
            with reading(way):
                scores[way] = scores_of(head, dev)
    tokens = {way: sum(counted[way]) / len(batches) for way in WAYS}
    median = {way: statistics.median(seconds[way]) for way in WAYS}
    median_cpu = {way: statistics.median(cpu_seconds[way]) for way in WAYS}
    row = {
        "model": f"{name} (random weights)",
        "task": args.task,
        "steps": args.steps,
        "tokens_per_step": tokens,
        "seconds_per_step": seconds,
        "cpu_seconds_per_step": cpu_seconds,
        "median_s": median,
        "median_cpu_s": median_cpu,
        "speedup": median["whole"] / median["sides"],
        "cpu_speedup": median_cpu["whole"] / median_cpu["sides"],
        "token_ratio": tokens["whole"] / tokens["sides"],
        "dev_pairs_compared": int(dev["labels"].shape[0]),
        "max_score_difference": float((scores["sides"] - scores["whole"]).abs().max()),
    }
    figures = [
        figure(
            "finetune",
            f"{name} {args.task} pair steps/s, sides apart",
            1 / median["sides"],
            1 / median["whole"],
            "steps/s",
        )
    ]
    headers = ["model", "task", "tokens/step, whole", "tokens/step, sides", "whole s/step",
               "sides s/step", "speed-up", "CPU s speed-up", "max |score diff|"]  # fmt: skip
    cells = [[
        row["model"], args.task, f"{tokens['whole']:,.0f}", f"{tokens['sides']:,.0f}",
        number(median["whole"]), number(median["sides"]), f"{row['speedup']:.2f}x",
        f"{row['cpu_speedup']:.2f}x", f"{row['max_score_difference']:.1e}",
    ]]  # fmt: skip
    report = {
        "benchmark": "fine-tuning steps of a pair task read apart: each side at its own width "
        "vs all rows at the batch's width",
        "machine": machine(),
        "threads": args.threads,
        "settings": SETTINGS,
        "results": [row],
        "figures": figures,
    }
    return finish(
        report, markdown_table(headers, cells) + "\n\n" + figures_table(figures), args.out
    )


if __name__ == "__main__":
    command_line(main)
