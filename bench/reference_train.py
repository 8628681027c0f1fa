"""The reference side of the time-to-loss benchmark: a plain PyTorch training loop on the
`transformers` models (`BertForPreTraining`, `LlamaForCausalLM`), fed exactly what our pipeline
gets for the same Hydra overrides.

    python -m bench.reference_train --out ref.json --budget-s 300 [--val-points 6] \
        -- experiment=bert-mini-wikitext2 recipe=bert-reference paths.cache_dir=...

From the composed run config it takes the architecture (mapped with `models.hf`), the tokenizer
and token store (from the cache, as `make pretrain` would), the batches and validation batches
(`datamodules.pretrain.PretrainDataModule` with the same seed), AdamW with the same weight-decay
groups (`pipeline.training.optim`), the same warmup and decay schedule, gradient clipping, the seed, and
`trainer.limit_val_batches`. The model itself, its initialization and its attention are
transformers' own. Losses are defined as ours: BERT = mean MLM cross-entropy over the masked
tokens + mean NSP cross-entropy; GPT = mean next-token cross-entropy over the window.

The LR schedule is set in steps, so its length must be known before training: without
`--max-steps`, a few steps (after a warm-up pass) and validation batches of a throw-away model are
timed first (`calibrate`), and the
schedule gets as many steps as fit in the budget (with `--margin` to spare) with at most
`--val-points` evenly spaced validations. Training stops at `max_steps` or when the budget is spent
(as Lightning's `max_time`), then validates once more. The clock starts at the first batch.
Writes a JSON report: the plan, and per validation {step, time_s, val_loss, terms}.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.common import REPO, BenchError, command_line, plan_steps, write_json

Batch = dict[str, torch.Tensor]
Autocast = Callable[[], AbstractContextManager]


@dataclasses.dataclass
class Run:
    """The parts of a composed run that the reference reproduces."""

    cfg: object  # the composed DictConfig
    family: str
    model_config: object  # BertConfig or GPTConfig with the model's vocabulary size
    datamodule: object  # PretrainDataModule, set up


def compose_run(overrides: list[str]) -> Run:
    """Compose conf/pretrain.yaml with `overrides` as `make pretrain` would, and build the
    tokenizer (from the cache, or trained) and the datamodule of that run."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.pretrain.checks import check_config
    from pipeline.pretrain.run import build_datamodule, sized_model_config
    from pipeline.run.errors import ConfigError
    from pipeline.run.launcher import register_resolvers
    from tokenizer import get_tokenizer

    register_resolvers()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("pretrain", overrides=overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.paths.output_dir = "unused"  # a Hydra run-time value; the reference writes no run folder
    try:
        plan = check_config(cfg)
    except ConfigError as err:
        raise BenchError(str(err)) from err
    if cfg.trainer.accumulate_grad_batches != 1:
        raise BenchError("the reference loop does no gradient accumulation; drop that override")
    if cfg.optim._target_ != "torch.optim.AdamW" or cfg.get("output_bias", "zeros") != "zeros":
        raise BenchError(
            f"the reference loop trains the transformers model with AdamW from a zero output "
            f"bias, not {cfg.optim._target_} (output_bias={cfg.get('output_bias')}); give its "
            f"family's reference recipe (recipe={plan.family}-reference)"
        )
    tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
    datamodule = build_datamodule(cfg, plan, tokenizer)  # accumulation 1: one micro-batch
    datamodule.setup("fit")
    return Run(cfg, plan.family, sized_model_config(plan, tokenizer), datamodule)


def build_model(family: str, model_config, device: torch.device) -> torch.nn.Module:
    """The transformers model of `model_config`'s architecture, with transformers' own init."""
    import transformers

    from models.hf_bert import bert_hf_config
    from models.hf_llama import llama_hf_config

    if family == "bert":
        config = transformers.BertConfig(
            **bert_hf_config(model_config, "BertForPreTraining"), attn_implementation="sdpa"
        )
        model = transformers.BertForPreTraining(config)
    else:
        config = transformers.LlamaConfig(
            **llama_hf_config(model_config), attn_implementation="sdpa"
        )
        model = transformers.LlamaForCausalLM(config)
    return model.to(device)


def losses(
    family: str, model: torch.nn.Module, batch: Batch
) -> dict[str, tuple[torch.Tensor, int]]:
    """Named (mean, count) loss terms of a batch, defined as in `pipeline.pretrain.modules`."""
    if family == "gpt":
        if "doc_ids" in batch:
            raise BenchError("the reference has no document masking; drop that override")
        logits = model(input_ids=batch["input_ids"]).logits
        targets = batch["targets"]
        return {
            "loss": (
                F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()),
                targets.numel(),
            )
        }
    input_ids = batch["input_ids"]
    # transformers scores MLM on every position, with -100 where nothing is predicted.
    labels = torch.full_like(input_ids, -100).flatten()
    labels[batch["masked_positions"]] = batch["mlm_labels"]
    out = model(
        input_ids=input_ids,
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
    )
    logits = out.prediction_logits.flatten(0, 1).float()
    terms = {"mlm_loss": (F.cross_entropy(logits, labels), batch["mlm_labels"].numel())}
    if "nsp_labels" in batch:
        nsp = F.cross_entropy(out.seq_relationship_logits.float(), batch["nsp_labels"])
        terms["nsp_loss"] = (nsp, input_ids.shape[0])
    return terms


def validate(
    family: str, model: torch.nn.Module, batches: Iterable[Batch], autocast: Autocast
) -> dict[str, float]:
    """Prediction-weighted mean of each loss term over `batches`, and their sum as "loss"
    (as `PretrainModule` logs val/loss)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    model.eval()
    with torch.no_grad(), autocast():
        for batch in batches:
            for name, (mean, count) in losses(family, model, batch).items():
                sums[name] = sums.get(name, 0.0) + float(mean) * count
                counts[name] = counts.get(name, 0) + count
    model.train()
    means = {name: sums[name] / counts[name] for name in sums}
    if "loss" not in means:
        means["loss"] = sum(means.values())
    return means


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {name: tensor.to(device) for name, tensor in batch.items()}


def train_step(
    family: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: Batch,
    clip: float | None,
    autocast: Autocast,
) -> None:
    """One optimizer step: forward, backward, clipping, AdamW, schedule."""
    with autocast():
        loss = sum(mean for mean, _ in losses(family, model, batch).values())
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def make_optimizer(run: Run, model: torch.nn.Module, total_steps: int):
    """AdamW with our weight-decay groups and the run's schedule, as `PretrainModule` builds."""
    from hydra.utils import instantiate

    from pipeline.training.optim import build_optimizer

    optimizer = build_optimizer(model, instantiate(run.cfg.optim))
    return optimizer, instantiate(run.cfg.schedule)(optimizer, total_steps=total_steps)


CALIBRATION_STEPS = 8  # timed steps, after a warm-up pass over the sample batches


def calibrate(
    run: Run, device: torch.device, autocast: Autocast, steps: int = CALIBRATION_STEPS
) -> dict:
    """Median seconds of a training step and seconds per validation batch of a throw-away
    model, on the first 4 validation batches (the training loader is left untouched). One
    warm-up pass over those batches is left out of the timing (a first step pays one-off
    costs: allocations, kernel selection), and the median of the next `steps` (default 8) is taken, so that a
    plan is priced from warm steps. Every step is reported (`warmup_step_times_s`,
    `step_times_s`): once a machine's slow moment made the timed steps 5x the later ones and
    the plan used a third of the budget, which these lists show at once."""
    sample = [
        to_device(b, device)
        for b, _ in zip(run.datamodule.val_dataloader(), range(4), strict=False)
    ]
    if not sample:
        raise BenchError("no validation batches: the reference needs datamodule.val_fraction > 0")
    model = build_model(run.family, run.model_config, device)
    optimizer, scheduler = make_optimizer(run, model, total_steps=1000)
    clip = run.cfg.trainer.gradient_clip_val
    warmup_times, step_times = [], []
    batches = itertools.cycle(sample)
    for i in range(len(sample) + steps):
        start = time.perf_counter()
        train_step(run.family, model, optimizer, scheduler, next(batches), clip, autocast)
        (warmup_times if i < len(sample) else step_times).append(time.perf_counter() - start)
    start = time.perf_counter()
    validate(run.family, model, sample, autocast)
    return {
        "step_s": statistics.median(step_times),
        "val_batch_s": (time.perf_counter() - start) / len(sample),
        "warmup_step_times_s": [round(t, 4) for t in warmup_times],
        "step_times_s": [round(t, 4) for t in step_times],
    }


def train(
    run: Run,
    model: torch.nn.Module,
    max_steps: int,
    val_every: int,
    budget_s: float,
    device: torch.device,
    autocast: Autocast,
) -> dict:
    """Train until `max_steps` or the budget; validate every `val_every` steps and at the end.

    Returns the steps done, why training stopped, and the validation points with their time
    since the first batch.
    """
    optimizer, scheduler = make_optimizer(run, model, max_steps)
    val_loader = run.datamodule.val_dataloader()
    val_batches = run.cfg.trainer.limit_val_batches
    clip = run.cfg.trainer.gradient_clip_val
    loader = run.datamodule.train_dataloader()
    points, step, start = [], 0, time.perf_counter()
    model.train()
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)  # as Lightning does: a new order every epoch
        for batch in loader:
            train_step(
                run.family, model, optimizer, scheduler, to_device(batch, device), clip, autocast
            )
            step += 1
            out_of_time = time.perf_counter() - start >= budget_s
            if step % val_every == 0 or step == max_steps or out_of_time:
                val = [
                    to_device(b, device)
                    for b, _ in zip(val_loader, range(val_batches), strict=False)
                ]
                terms = validate(run.family, model, val, autocast)
                elapsed = time.perf_counter() - start
                points.append(
                    {"step": step, "time_s": elapsed, "val_loss": terms["loss"], "terms": terms}
                )
                logging.info("step %d, %.1f s: val loss %.4f", step, elapsed, terms["loss"])
            if step >= max_steps or out_of_time:
                stopped_by = "max_steps" if step >= max_steps else "budget"
                return {"steps": step, "stopped_by": stopped_by, "points": points}
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run (after --)")
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    parser.add_argument("--budget-s", type=float, required=True, help="wall-clock budget")
    parser.add_argument("--max-steps", type=int, help="schedule length (default: calibrated)")
    parser.add_argument("--val-every", type=int, help="steps between validations")
    parser.add_argument("--val-points", type=int, default=6, help="at most this many validations")
    parser.add_argument("--margin", type=float, default=0.9, help="share of the budget planned")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device(args.device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    import lightning as L

    run = compose_run(args.overrides)
    calibration = None
    if args.max_steps is None:
        calibration = calibrate(run, device, autocast)
        args.max_steps, args.val_every = plan_steps(
            args.budget_s,
            calibration["step_s"],
            calibration["val_batch_s"],
            args.val_points,
            run.cfg.trainer.limit_val_batches,
            args.margin,
        )
        logging.info(
            "calibrated %s: %d steps, validation every %d",
            calibration,
            args.max_steps,
            args.val_every,
        )
    val_every = args.val_every or args.max_steps
    L.seed_everything(run.cfg.seed, workers=True)  # as pipeline.pretrain.run, before the model
    model = build_model(run.family, run.model_config, device)
    result = train(run, model, args.max_steps, val_every, args.budget_s, device, autocast)
    report = {
        "family": run.family,
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": args.device,
        "dtype": args.dtype,
        "budget_s": args.budget_s,
        "max_steps": args.max_steps,
        "val_every": val_every,
        "val_batches": run.cfg.trainer.limit_val_batches,
        "calibration": calibration,
        **result,
    }
    write_json(report, args.out)
    return report


if __name__ == "__main__":
    command_line(main)
