"""Time to loss: our full pipeline (`make pretrain`) against a plain training loop on the
`transformers` models, same architecture, data, tokenizer, batches, schedule and seed, for the
same wall-clock budget on this machine.

    python bench/bench_time_to_loss.py [--quick] [--models bert,gpt] [--budget-s 300]
                                       [--out outputs/bench/time_to_loss.json]
    make bench-loss

For each model (BERT mini and GPT mini on WikiText-2, `conf/experiment/*-mini-wikitext2.yaml`),
each side trains with the same recipe (AdamW, warmup then decay, batch, data order, seed) for
the same wall-clock budget; the schedule is set in steps, so each side's length is what that side
completes in the budget, and a faster side trains more steps:

1. Data preparation (`python -m pipeline.commands.prepare`) into a fresh cache: trains the tokenizer and
   builds the token store, measured for wall time and peak RSS. The runs below reuse them.
2. The reference (`bench/reference_train.py`, a subprocess): times a few steps, sizes its
   schedule to the budget, trains, validates at most `--val-points` times on the first
   `--val-batches` validation batches.
3. Ours, timed: a `TIMING_STEPS`-step `python -m pipeline.commands.pretrain` run gives the seconds per
   step and per validation batch, which size our schedule the same way (`common.plan_steps`).
4. Ours (`python -m pipeline.commands.pretrain`) with that schedule, the same validation batches,
   `trainer.max_time` = the budget, and `bench.clock.WallClockLogger` recording when each
   validation loss was logged.

5. Ours with our best recipe: the schedule paced to the budget (`trainer.budget`, no timing
   run needed) plus the model's entry of `RECIPES`, its fast recipe (`--recipe KEY=VALUE`,
   repeated, replaces the whole entry and applies on top of the reference recipe, e.g.
   `--recipe optim=muon --recipe optim.lr=1e-3`; `--no-recipe` to skip
   both recipe runs), with the same validations: how far the recipe gets in the same time.
6. The best recipe again, paced to `RECIPE_TARGET` (0.40) of the reference's time (its final
   validation's): a run sized to that deadline, its warmup and decay complete there, as a user
   with that much time would run it. Target: it reaches the reference's final loss within it.
   A paced schedule holds the rate high until late, so the run of step 5 passes an early,
   higher loss later than a run built to stop there; time to quality in budget mode is the
   shortest budget whose run reaches the quality, and this run tests the target's budget.

Reported per model: the final validation loss of each, the steps and wall time each took, and
the time ours needed to first reach the reference's final loss (linear between validations), as
a share of the reference's time (target: <= 0.60 with the same recipe, <= 0.40 for the best
recipe's run paced to that share), and for GPT the final
validation bits per byte of each (the same validation windows, so the same tokens per byte). Also the peak RSS of each process
(`bench_memory.py` prints it as its own table). Times count from the start of training (model
built, data open); ours includes Lightning's two sanity-validation batches and its checkpoints.
The runs are sequential, so a busy machine skews the ratio: trust it only from a quiet one.

`--quick`: 20 s per run on WikiText-2's validation text (for `make bench QUICK=1`).
`--set KEY=VALUE` adds a Hydra override to every run (e.g. `--set model=bert-tiny`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.clock import read_clock
from bench.common import (
    WIKITEXT2,
    BenchError,
    Measured,
    child_env,
    command_line,
    figure,
    finish,
    machine,
    markdown_table,
    number,
    plan_steps,
    require_data,
    run_measured,
)

EXPERIMENTS = {"bert": "bert-mini-wikitext2", "gpt": "gpt-mini-wikitext2"}
TARGET = 0.60  # ours reaches the reference's final loss in at most this share of its time
RECIPE_TARGET = 0.40  # ... and ours with our best recipe, in at most this share
# Our best recipe beyond the shared one: a schedule paced to the budget (trainer.budget, always),
# plus these overrides per model (`--recipe` replaces them).
# Measured on 2026-11-25 (2-core AVX2 CPU, 300 s): Muon with the paced schedule reached the
# reference's loss in 0.448 (BERT) / 0.505 (GPT) of its time, against 0.481 / 0.555 for AdamW.
# Then, in steps to the reference's loss on a fixed 240-step schedule (one seed), a higher rate
# with a shorter warmup: BERT 67.6 steps at lr 1e-3 and 10% warmup, 53.7 at lr 2e-3 and 2% (64.0 at
# 3e-3); GPT more than 83 at lr 1e-3 and 5%, 60.4 at 2e-3 and 2%, 56.3 at 3e-3 and 2%.
# This bench with them, that afternoon: 0.405 (BERT) / 0.36 (GPT); BERT again: 0.502 (and 0.453
# for the same-recipe row): BERT's figures move more between runs than between recipes.
# 2026-11-26, BERT with output_bias=unigram added: 0.284, then 0.177 (same-recipe rows 0.526,
# 0.539), mostly the bias's head start: 7.55 before any step, against the reference's 7.53
# after 300 s (docs/results/time-to-loss.md).
# 2026-11-27 (Xeon with AMX, bf16, 600 s; the reference ended at 476 s on 7.113): paced to
# 0.40 of the reference's time (190 s), that recipe ended at 7.161 (226 steps) and 7.164 (228)
# in two runs; with dropout off while pretraining (Cramming, Geiping & Goldstein 2022; GPT's
# is already 0) it made 283 steps and ended at 7.094 (results/2026-11-27_vm_bert_dropout_screen.json).
# Those settings are the fast recipes of conf/recipe/ (Muon, lr 2e-3 and 3e-3, 2% warmup; BERT
# also output_bias=unigram and no dropout); the reference and our same-recipe runs train with
# each family's reference recipe, whatever the presets default to.
RECIPES: dict[str, list[str]] = {"bert": ["recipe=bert-fast"], "gpt": ["recipe=gpt-fast"]}


class RecipeRun(NamedTuple):
    """One run of the best recipe: its key in a model's results (its run is named after it),
    its name in the tables and curves, and `share`: its budget as a share of the reference's
    time, which is also the target its ratio must stay within (None: the bench's whole budget
    and no target, a figure for information)."""

    key: str
    label: str
    curve: str
    share: float | None

    @property
    def target(self) -> float | None:
        return self.share


RECIPE_RUNS = (
    RecipeRun("recipe", "best recipe paced to the whole budget", "recipe", None),
    RecipeRun(
        "recipe_at_target",
        f"best recipe paced to {RECIPE_TARGET:.2f} of the reference's time",
        "recipe at target",
        RECIPE_TARGET,
    ),
)
TIMING_STEPS = 8  # the short run of ours that times a step and a validation batch
FULL = {"budget_s": 300, "val_points": 6, "val_batches": 4}
QUICK = {"budget_s": 20, "val_points": 2, "val_batches": 2}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a set of runs (shared with bench_memory.py); defaults come later."""
    parser.add_argument("--quick", action="store_true", help="short runs on a small corpus")
    parser.add_argument("--models", default="bert,gpt", help="comma list of bert, gpt")
    parser.add_argument("--budget-s", type=int, help="wall-clock budget of each training run")
    parser.add_argument("--val-points", type=int, help="validations in the schedule")
    parser.add_argument("--val-batches", type=int, help="batches per validation")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/bench/time_to_loss"))
    parser.add_argument(
        "--recipe",
        action="append",
        metavar="KEY=VALUE",
        help="the best recipe's overrides besides its time budget (repeatable; replaces the "
        "built-in ones, e.g. --recipe optim=muon --recipe optim.lr=1e-3)",
    )
    parser.add_argument("--no-recipe", action="store_true", help="skip both best-recipe runs")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Hydra override for every run (repeatable)",
    )


def resolve(args: argparse.Namespace, full: dict) -> argparse.Namespace:
    """Fill the options left unset from `full` (or the quick settings)."""
    for key, value in (QUICK if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def data_overrides(args: argparse.Namespace) -> list[str]:
    """The corpus overrides: none when the caller chose data, else WikiText-2 (its validation
    text when quick), which must exist."""
    if any(o.split("=")[0].split(".")[0].lstrip("+~") == "data" for o in args.overrides):
        return []
    if args.quick:
        valid = require_data(WIKITEXT2 / "valid.txt", "WikiText-2")
        return [f"data.paths=['{valid}']"]
    require_data(WIKITEXT2 / "train.txt.gz", "WikiText-2")
    return [f"data.paths=['{WIKITEXT2}/train.txt*']"]


def device_overrides(device: str, dtype: str) -> list[str]:
    precision = "bf16-mixed" if dtype == "bf16" else "32-true"
    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    return [f"trainer.accelerator={accelerator}", f"trainer.precision={precision}"]


def max_time(seconds: int) -> str:
    """Lightning's DD:HH:MM:SS, quoted for Hydra."""
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    return f"'{days:02d}:{h:02d}:{m:02d}:{s:02d}'"


def run_family(family: str, args: argparse.Namespace) -> dict:
    """Prepare the data, train the reference, time ours, train ours; the measured runs of one
    model."""
    work = args.work_dir / family
    shutil.rmtree(work, ignore_errors=True)  # a fresh cache: preparation is measured from scratch
    common = [
        f"experiment={EXPERIMENTS[family]}",
        f"recipe={family}-reference",  # a later recipe= (the best recipe's runs) replaces it
        *data_overrides(args),
        f"paths.cache_dir={work / 'cache'}",
        f"paths.output_root={work / 'runs'}",
        f"trainer.limit_val_batches={args.val_batches}",
        *device_overrides(args.device, args.dtype),
        *args.overrides,
    ]

    def measured(name: str, module: str, *arguments: str) -> Measured:
        return run_measured(
            [sys.executable, "-m", module, *arguments],
            work / f"{name}.log",
            env=child_env(),
            timeout_s=3 * args.budget_s + 900,
        )

    def pretrain(name: str, max_steps: int, val_every: int, *extra: str):
        # sized in steps from its own timing, like the reference, unless `extra` sets a budget
        budget = (
            [] if any(e.startswith("trainer.budget=") for e in extra) else ["trainer.budget=null"]
        )
        clock = work / f"{name}.clock.jsonl"
        run = measured(
            name,
            "pipeline.commands.pretrain",
            *common,
            f"run_name={family}-{name}",
            "+trainer.enable_progress_bar=false",
            f"trainer.max_steps={max_steps}",
            f"trainer.val_check_interval={val_every}",
            "+logger.clock._target_=bench.clock.WallClockLogger",
            f"+logger.clock.path={clock}",
            *budget,
            *extra,
        )
        return run, read_clock(clock)

    print(f"{family}: preparing data", flush=True)
    prepare = measured(
        "prepare", "pipeline.commands.prepare", *common, f"run_name={family}-prepare"
    )
    print(f"{family}: reference (transformers), {args.budget_s} s", flush=True)
    reference_json = work / "reference.json"
    reference_run = measured(
        "reference",
        "bench.reference_train",
        *("--out", str(reference_json), "--budget-s", str(args.budget_s)),
        *("--val-points", str(args.val_points), "--device", args.device, "--dtype", args.dtype),
        *("--", *common),
    )
    reference = json.loads(reference_json.read_text())
    if reference["family"] != family:
        raise BenchError(
            f"the overrides {args.overrides} turn the {family} run into a {reference['family']} run"
        )
    print(f"{family}: ours (make pretrain), timing {TIMING_STEPS} steps", flush=True)
    _, rows = pretrain("timing", TIMING_STEPS, TIMING_STEPS, "trainer.log_every_n_steps=1")
    timing = step_timing(rows, args.val_batches)
    max_steps, val_every = plan_steps(
        args.budget_s, timing["step_s"], timing["val_batch_s"], args.val_points, args.val_batches
    )
    print(f"{family}: ours (make pretrain), {max_steps} steps or {args.budget_s} s", flush=True)
    ours_run, rows = pretrain(
        "ours", max_steps, val_every, f"trainer.max_time={max_time(args.budget_s)}"
    )
    recipes: dict[str, dict] = {}
    processes = {}
    if not args.no_recipe:
        overrides = args.recipe if args.recipe is not None else RECIPES[family]
        for spec in RECIPE_RUNS:
            budget_s, every = args.budget_s, val_every
            if spec.share is not None:  # validating as often for its length as the others
                budget_s = target_budget_s(reference, spec.share)
                every = max(1, round(val_every * spec.share))
            paced = [f"trainer.budget={budget_s}s", "trainer.max_time=null", *overrides]
            print(f"{family}: ours, best recipe ({' '.join(paced)})", flush=True)
            processes[spec.key], recipe_rows = pretrain(
                spec.key.replace("_", "-"), 1_000_000, every, *paced
            )
            recipe_points = validation_points(recipe_rows)
            recipes[spec.key] = {
                "budget_s": budget_s,
                "overrides": paced,
                "steps": recipe_points[-1]["step"] if recipe_points else 0,
                "points": recipe_points,
            }
    for checkpoints in (work / "runs").glob("*/*/checkpoints"):
        shutil.rmtree(checkpoints)  # ~0.5 GB of by-products; logs and the HF export stay
    points = validation_points(rows)
    steps = points[-1]["step"] if points else 0
    ours = {
        "max_steps": max_steps,
        "val_every": val_every,
        "calibration": timing,
        "steps": steps,
        "stopped_by": "max_steps" if steps >= max_steps else "budget",
        "points": points,
    }
    processes = {"prepare": prepare, "reference": reference_run, "ours": ours_run} | processes
    return summarize(family, reference, ours, recipes) | {
        "processes": {
            name: {"wall_s": m.wall_s, "peak_rss_mb": m.peak_rss_mb, "log": str(m.log)}
            for name, m in processes.items()
        }
    }


def target_budget_s(reference: dict, share: float = RECIPE_TARGET) -> int:
    """The budget of the best recipe's run at the target: `share` of the reference's time to
    its final validation, in whole seconds (at least 1)."""
    if not reference["points"]:
        raise BenchError("the reference logged no validation loss; see reference.log")
    return max(1, math.floor(share * reference["points"][-1]["time_s"]))


def step_timing(rows: list[dict], val_batches: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds between training steps (after `warmup`) and seconds per validation
    batch, from the clock of a run that logged every step and validated after its last."""
    train = {row["step"]: row["elapsed_s"] for row in rows if "train/loss" in row["metrics"]}
    # steps are numbered from 1: the gap before step s is step s's time, warm-up steps left out
    gaps = [train[step] - train[step - 1] for step in sorted(train) if step - 1 > warmup]
    validations = [row for row in rows if "val/loss" in row["metrics"]]
    if not gaps or not validations or validations[-1]["step"] not in train:
        raise BenchError("the timing run of ours logged too few steps; see its log")
    last = validations[-1]
    return {
        "step_s": statistics.median(gaps),
        "val_batch_s": (last["elapsed_s"] - train[last["step"]]) / val_batches,
    }


def validation_points(rows: list[dict]) -> list[dict]:
    """(steps done, seconds since training began, val loss) of each validation ours logged.

    Rows are logged at the steps done (`pipeline.training.loggers.numbered_from_one`).
    """
    return [
        {
            "step": row["step"],
            "time_s": row["elapsed_s"],
            "val_loss": row["metrics"]["val/loss"],
        }
        | (
            {"bits_per_byte": row["metrics"]["val/bits_per_byte"]}
            if "val/bits_per_byte" in row["metrics"]
            else {}
        )
        for row in rows
        if "val/loss" in row["metrics"]
    ]


def time_to_reach(points: list[dict], loss: float) -> float | None:
    """Seconds until the validation loss first reaches `loss`, linear between validations
    (the first validation's time when that one already does); None when it never does."""
    previous = None
    for point in points:
        if point["val_loss"] <= loss:
            if previous is None:
                return point["time_s"]
            share = (previous["val_loss"] - loss) / (previous["val_loss"] - point["val_loss"])
            return previous["time_s"] + share * (point["time_s"] - previous["time_s"])
        previous = point
    return None


def summarize(
    family: str,
    reference: dict,
    ours: dict,
    recipes: dict[str, dict] | None = None,
) -> dict:
    """Final losses, times and the time-to-reference-loss ratio of one model (and of the runs
    of our best recipe that ran, keyed as in `RECIPE_RUNS`)."""
    if not reference["points"] or not ours["points"]:
        raise BenchError(f"{family}: a run logged no validation loss; see the logs")
    ref_final, ours_final = reference["points"][-1], ours["points"][-1]
    reached = time_to_reach(ours["points"], ref_final["val_loss"])
    ratio = reached / ref_final["time_s"] if reached is not None else None
    summary = {
        "family": family,
        "reference": reference,
        "ours": ours,
        "reference_final_loss": ref_final["val_loss"],
        "reference_time_s": ref_final["time_s"],
        "ours_final_loss": ours_final["val_loss"],
        "ours_time_s": ours_final["time_s"],
        "ours_time_to_reference_loss_s": reached,
        "time_ratio": ratio,
        "target": TARGET,
        "met": ratio is not None and ratio <= TARGET,
    }
    if "bits_per_byte" in ours_final:
        # both sides validate on the same windows: the same tokens per byte
        bits_per_nat = ours_final["bits_per_byte"] / ours_final["val_loss"]
        summary["reference_final_bits_per_byte"] = ref_final["val_loss"] * bits_per_nat
        summary["ours_final_bits_per_byte"] = ours_final["bits_per_byte"]
    for spec in RECIPE_RUNS:
        if (run := (recipes or {}).get(spec.key)) is not None:
            summary[spec.key] = run | recipe_summary(ref_final, run["points"], spec.target)
    return summary


def recipe_summary(ref_final: dict, points: list[dict], target: float | None) -> dict:
    """A run of our best recipe against the reference's final validation; `met` is None
    without a target."""
    if not points:
        return {"final_loss": None, "time_ratio": None, "target": target, "met": False}
    reached = time_to_reach(points, ref_final["val_loss"])
    ratio = reached / ref_final["time_s"] if reached is not None else None
    return {
        "final_loss": points[-1]["val_loss"],
        "final_bits_per_byte": points[-1].get("bits_per_byte"),
        "time_s": points[-1]["time_s"],
        "time_to_reference_loss_s": reached,
        "time_ratio": ratio,
        "target": target,
        "met": None if target is None else ratio is not None and ratio <= target,
    }


def figures(report: dict) -> list[dict]:
    rows = []
    for name, r in report["results"].items():
        rows.append(
            figure(
                "time to loss",
                f"{name} final val loss",
                r["ours_final_loss"],
                r["reference_final_loss"],
                "loss",
            )
        )
        rows.append(
            figure(
                "time to loss",
                f"{name} time to the reference's final val loss",
                r["ours_time_to_reference_loss_s"],
                r["reference_time_s"],
                "s",
                at_most=TARGET,
            )
        )
        for spec in RECIPE_RUNS:
            if (recipe := r.get(spec.key)) is not None:
                rows.append(
                    figure(
                        "time to loss",
                        f"{name} {spec.label}: time to the reference's final val loss",
                        recipe["time_to_reference_loss_s"] if recipe["final_loss"] else None,
                        r["reference_time_s"],
                        "s",
                        at_most=spec.target,
                    )
                )
    return rows


def table(report: dict) -> str:
    """A summary row per model, then each model's validation curves side by side."""
    head = (
        f"{report['budget_s']} s per run, {report['device']} {report['dtype']}, "
        f"validation on {report['val_batches']} batches; times from the start of training"
    )
    rows = []
    for name, r in report["results"].items():
        rows.append(
            [
                name,
                f"{r['ours']['steps']} / {r['reference']['steps']}",
                f"{r['ours_final_loss']:.3f} / {r['reference_final_loss']:.3f}",
                f"{r['ours_time_s']:.0f} / {r['reference_time_s']:.0f}",
                number(r["ours_time_to_reference_loss_s"]),
                number(r["time_ratio"]),
                "yes" if r["met"] else "**no**",
            ]
        )
    for name, r in report["results"].items():
        for spec in RECIPE_RUNS:
            if (recipe := r.get(spec.key)) is None:
                continue
            # results written before 2026-11-27 held the full run to 0.40: its verdict is not shown
            target = spec.target
            rows.append(
                [
                    f"{name}, {spec.label}",
                    f"{recipe['steps']} / {r['reference']['steps']}",
                    f"{number(recipe['final_loss'])} / {r['reference_final_loss']:.3f}",
                    f"{number(recipe.get('time_s'))} / {r['reference_time_s']:.0f}",
                    number(recipe.get("time_to_reference_loss_s")),
                    number(recipe["time_ratio"]) + (f" (<= {target:.2f})" if target else ""),
                    {True: "yes", False: "**no**", None: ""}[recipe["met"] if target else None],
                ]
            )
    headers = [
        "model",
        "steps ours / ref",
        "final val loss ours / ref",
        "time s ours / ref",
        "ours s to ref loss",
        "ratio (<= 0.60)",
        "met",
    ]
    parts = [head, markdown_table(headers, rows)]
    for name, r in report["results"].items():
        if "ours_final_bits_per_byte" in r:
            recipes = [
                f", {spec.label} {bits:.4f}"
                for spec in RECIPE_RUNS
                if (bits := (r.get(spec.key) or {}).get("final_bits_per_byte")) is not None
            ]
            parts.append(
                f"{name} final validation bits per byte: reference "
                f"{r['reference_final_bits_per_byte']:.4f}, ours {r['ours_final_bits_per_byte']:.4f}"
                + "".join(recipes)
            )
        for spec in RECIPE_RUNS:
            if r.get(spec.key):
                parts.append(f"{name} {spec.label}: {' '.join(r[spec.key]['overrides'])}")
    for name, r in report["results"].items():
        curves = {"ours": r["ours"]["points"], "ref": r["reference"]["points"]}
        curves |= {s.curve: r[s.key]["points"] for s in RECIPE_RUNS if r.get(s.key)}
        curve_rows = []
        for i in range(max(len(points) for points in curves.values())):
            cells = [str(i + 1)]
            for points in curves.values():
                p = points[i] if i < len(points) else None
                cells += (
                    [str(p["step"]), f"{p['time_s']:.1f}", f"{p['val_loss']:.3f}"]
                    if p
                    else ["—"] * 3
                )
            curve_rows.append(cells)
        headers = [""] + [h for side in curves for h in (f"{side} step", "s", "val loss")]
        parts += [f"{name} validation curves:", markdown_table(headers, curve_rows)]
    return "\n\n".join(parts)


def run(args: argparse.Namespace) -> dict:
    """Every model's runs, as a report (also the measurements bench_memory.py reads)."""
    families = [f.strip() for f in args.models.split(",")]
    if unknown := set(families) - set(EXPERIMENTS):
        raise BenchError(f"--models: unknown {sorted(unknown)}; use bert, gpt or bert,gpt")
    report = {
        "benchmark": "time to the reference's final validation loss, same wall-clock budget",
        "machine": machine(),
        "quick": args.quick,
        "budget_s": args.budget_s,
        "val_points": args.val_points,
        "val_batches": args.val_batches,
        "device": args.device,
        "dtype": args.dtype,
        "overrides": args.overrides,
        "results": {family: run_family(family, args) for family in families},
    }
    report["figures"] = figures(report)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/time_to_loss.json"))
    args = resolve(parser.parse_args(argv), FULL)
    report = run(args)
    return finish(report, table(report), args.out)


if __name__ == "__main__":
    command_line(main)
