"""The recipe study: which recipe should each family's presets default to?

For every family (BERT mini, GPT mini), corpus (WikiText-2, tiny Shakespeare), time budget and
seed, `make pretrain` trains the model twice, once with each recipe of conf/recipe/
(`<family>-reference`: the paper's or nanoGPT's AdamW recipe; `<family>-fast`: Muon, a higher
rate, a short warmup, and for BERT no dropout and the unigram output bias), both runs paced to
the same budget (`trainer.budget`) on the same seed, one after the other. Each run is scored on
its held-out documents at its last step (the run's own validation: GPT bits per byte, BERT
masked-LM loss, lower is better; the last step is what `ckpt=<run>` loads, and it decides the
cell) and, unless `--blimp-pairs 0`, on the first N pairs of each BLiMP phenomenon
(`make evaluate-lm suite=blimp`, without twin or n-gram; higher is better). The lowest held-out
figure during the run, and its step, are reported beside: a run whose last figure sits above its
lowest has memorized its corpus (its kept best checkpoint is the better model).

Reported per cell (family, corpus, budget): each recipe's mean over seeds, and fast - reference
paired by seed with a 95% t interval. A recipe wins a cell when the interval of its held-out
difference excludes zero; the verdict per family counts the cells each recipe wins.

The study is long (3 seeds x {2, 10, 20} minutes x 2 corpora x 2 families x 2 recipes is about
13 hours of training on one machine), so it runs in pieces: each finished run is kept as
`<work-dir>/cells/<run>.json` with the machine it ran on, a later call skips the runs already
there and reports every run it finds, and runs are paired only with a run of the same seed on
the same CPU. The report holds every run it counted (`runs`), so a study continues on a fresh
checkout from a report kept in the repository (`--resume-from`). Runs are sequential; anything
else on the machine takes steps from both recipes.

    make bench-recipes ARGS="--budgets 2m --seeds 1 2 3"
    make bench-recipes ARGS="--models bert --corpora wikitext2 --budgets 20m"
    make bench-recipes ARGS="--models gpt --corpora shakespeare --budgets 20m \\
        --resume-from bench/results/2026-11-30_vm_recipes_gpt_shakespeare_20m.json"
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.common import (
    REPO,
    SHARED,
    BenchError,
    child_env,
    command_line,
    finish,
    machine,
    markdown_table,
    require_data,
    run_measured,
    write_json,
)
from pipeline.report import read_metrics
from pipeline.suites.seeds import PairedDifference, paired_difference, summarize_seeds

EXPERIMENTS = {"bert": "bert-mini-wikitext2", "gpt": "gpt-mini-wikitext2"}
RECIPES = ("reference", "fast")
TINY_SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
BLIMP = SHARED / "blimp"
# The corpus overrides on top of the family's experiment (which trains on WikiText-2).
CORPORA: dict[str, list[str]] = {
    "wikitext2": [],
    "shakespeare": [
        "data=text_files",
        f"data.paths=[{TINY_SHAKESPEARE}]",
        "data.doc_split=blank_line",
    ],
}
# The held-out figure of each family, read from the run's last validation (lower is better).
HELD_OUT = {"bert": "val/mlm_loss", "gpt": "val/bits_per_byte"}


class Cell(NamedTuple):
    """One training run of the study."""

    family: str
    corpus: str
    budget: str
    recipe: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.family}-{self.corpus}-{self.budget}-{self.recipe}-seed{self.seed}"

    def overrides(self) -> list[str]:
        return [
            f"experiment={EXPERIMENTS[self.family]}",
            f"recipe={self.family}-{self.recipe}",
            *CORPORA[self.corpus],
            f"trainer.budget={self.budget}",
            f"seed={self.seed}",
            f"run_name={self.name}",
        ]


def plan(args: argparse.Namespace) -> list[Cell]:
    """The runs in the order they run: the two recipes of one seed back to back, so that a
    machine whose speed drifts over the study treats both alike."""
    return [
        Cell(family, corpus, budget, recipe, seed)
        for budget in args.budgets
        for family in args.models
        for corpus in args.corpora
        for seed in args.seeds
        for recipe in RECIPES
    ]


def validations(metrics_csv: Path) -> list[dict]:
    """Every validation of the run in `logs/metrics.csv`, in step order: its step and every
    `val/` figure logged at it (read as `make report` reads the log)."""
    if not metrics_csv.is_file():
        raise BenchError(f"no metrics at {metrics_csv}: the run wrote no CSV log")
    columns = read_metrics(metrics_csv)
    if not columns.get("val/loss"):
        raise BenchError(f"{metrics_csv} has no validation row")
    return [
        {
            "step": float(step),
            **{k: v[step] for k, v in columns.items() if k.startswith("val/") and step in v},
        }
        for step in sorted(columns["val/loss"])
    ]


def lowest_validation(rows: list[dict], metric: str) -> dict:
    """Of a run's `validations`, the one with the lowest `metric` (the run's kept best checkpoint
    is the one with the lowest held-out language-model loss, `PretrainModule.held_out_figure`;
    for GPT bits per byte falls and rises with it)."""
    return min(rows, key=lambda row: row.get(metric, float("inf")))


def run_cell(cell: Cell, args: argparse.Namespace, where: dict) -> dict:
    """Train one run, score it, and keep its result as `cells/<name>.json`."""
    runs = args.work_dir / "runs"
    run_dir = runs / cell.family / cell.name  # each experiment's model preset is its family
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier attempt that did not finish
    log_dir = args.work_dir / "logs"
    python = [sys.executable, "-m"]
    print(f"{cell.name}: training", flush=True)
    trained = run_measured(
        [
            *python,
            "pipeline.commands.pretrain",
            *cell.overrides(),
            f"paths.output_root={runs}",
            "logger=csv",
            "+trainer.enable_progress_bar=false",
            *args.overrides,
        ],
        log_dir / f"{cell.name}.log",
        env=child_env(),
    )
    rows = validations(run_dir / "logs" / "metrics.csv")
    result = {
        "cell": cell._asdict(),
        "machine": where,
        "date": datetime.date.today().isoformat(),
        "overrides": cell.overrides() + list(args.overrides),
        "set": list(args.overrides),
        "wall_s": trained.wall_s,
        "validation": rows[-1],  # the last step: what `ckpt=<run>` and the HF export hold
        "lowest_validation": lowest_validation(rows, HELD_OUT[cell.family]),
        "blimp": None,
    }
    if args.blimp_pairs:
        print(f"{cell.name}: BLiMP, {args.blimp_pairs} pairs per phenomenon", flush=True)
        scores = args.work_dir / "blimp" / f"{cell.name}.json"
        run_measured(
            [
                *python,
                "pipeline.commands.evaluate_lm",
                f"ckpt={run_dir}",
                "suite=blimp",
                f"suite.dir={BLIMP}",
                f"suite.pairs={args.blimp_pairs}",
                "suite.twin=false",
                "suite.ngram_order=null",
                f"out={scores}",
            ],
            log_dir / f"{cell.name}.blimp.log",
            env=child_env(),
        )
        model_row = json.loads(scores.read_text())["rows"][0]
        result["blimp"] = {"pairs": args.blimp_pairs, "overall": model_row["overall"]}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~50 MB each; the logs stay
    write_json(result, args.work_dir / "cells" / f"{cell.name}.json")
    return result


def load_cells(cells_dir: Path) -> list[dict]:
    """The runs kept in `cells_dir`; a run kept before the study read its lowest validation
    gets it from its log in the study's `runs/` folder, where that is still there."""
    results = [json.loads(p.read_text()) for p in sorted(cells_dir.glob("*-seed*.json"))]
    for result in results:
        if "lowest_validation" not in result:
            cell = Cell(**result["cell"])
            log = cells_dir.parent / "runs" / cell.family / cell.name / "logs" / "metrics.csv"
            result["lowest_validation"] = (
                lowest_validation(validations(log), HELD_OUT[cell.family])
                if log.is_file()
                else None
            )
    return results


def made_with(run: dict) -> list[str]:
    """The `--set` overrides a kept run was made with (none for a run kept before --set)."""
    return list(run.get("set", []))


def report_runs(report: Path, overrides: list[str]) -> list[dict]:
    """The runs a study's `report` counted, each checked to be a run of this study made with
    the same `--set` overrides; a BenchError names the first that is not."""
    if not report.is_file():
        raise BenchError(
            f"no report at {report}; give one that make bench-recipes wrote, e.g. "
            f"--resume-from bench/results/2026-11-30_vm_recipes_gpt_shakespeare_20m.json"
        )
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except ValueError as err:
        raise BenchError(
            f"{report} is not valid JSON ({err}); if it is in the repository, restore it: "
            f"git checkout -- {report}"
        ) from err
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise BenchError(
            f"{report} holds no runs: reports written before 2026-11-30 kept only summaries and "
            f"cannot be resumed from; make those runs again"
        )
    for i, run in enumerate(data["runs"]):
        problem = _run_problem(run, overrides)
        if problem:
            raise BenchError(f"{report}: run {i} {problem}; nothing was kept from it")
    return data["runs"]


def _run_problem(run: dict, overrides: list[str]) -> str | None:
    """What makes `run` unfit to be kept in this study (None: nothing)."""
    try:
        cell = Cell(**run["cell"])
        known = (
            cell.family in EXPERIMENTS
            and cell.corpus in CORPORA
            and cell.recipe in RECIPES
            and isinstance(cell.seed, int)
            and isinstance(cell.budget, str)
            and "/" not in cell.budget
        )
        if not known:
            return f"is not a run of this study ({run['cell']})"
        float(run["validation"][HELD_OUT[cell.family]])
        float(run["validation"]["step"])
        if not isinstance(run["machine"], dict) or "blimp" not in run:
            return "has no machine or no blimp entry"
    except (KeyError, TypeError, ValueError) as err:
        return f"is incomplete ({type(err).__name__}: {err})"
    if made_with(run) != list(overrides):
        return (
            f"was made with --set {made_with(run)}, this call gives {overrides}: give the "
            f"same --set, or resume it in another --work-dir"
        )
    return None


def resume_from(reports: list[Path], cells_dir: Path, overrides: list[str]) -> int:
    """Keep in `cells_dir` the runs of earlier studies' `reports` (all checked before any is
    kept) that `cells_dir` does not hold yet: a run kept here wins, and a report's run whose
    partner (same seed, other recipe) is kept here from another CPU is left out, to be made
    again beside it. Returns how many runs were kept."""
    runs = [run for report in reports for run in report_runs(report, overrides)]
    kept = {Cell(**r["cell"]): r for r in load_cells(cells_dir)}
    added = 0
    for run in runs:
        cell = Cell(**run["cell"])
        partner = kept.get(cell._replace(recipe=RECIPES[1 - RECIPES.index(cell.recipe)]))
        if cell in kept or (partner is not None and not _same_cpu(partner, run)):
            continue
        write_json(run, cells_dir / f"{cell.name}.json")
        kept[cell] = run
        added += 1
    return added


def summarize(results: list[dict]) -> list[dict]:
    """One row per (family, corpus, budget): each recipe over seeds, and fast - reference paired
    by seed (runs of one seed on different CPUs are not paired)."""
    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in results:
        c = r["cell"]
        key = (c["family"], c["corpus"], c["budget"])
        groups.setdefault(key, {}).setdefault(c["recipe"], {})[c["seed"]] = r
    rows = []
    for (family, corpus, budget), by_recipe in sorted(groups.items()):
        metric = HELD_OUT[family]
        ref, fast = by_recipe.get("reference", {}), by_recipe.get("fast", {})
        paired = [s for s in ref if s in fast and _same_cpu(ref[s], fast[s])]
        row = {"family": family, "corpus": corpus, "budget": budget, "metric": metric}
        for recipe, runs in (("reference", ref), ("fast", fast)):
            row[recipe] = {
                "seeds": sorted(runs),
                "held_out": _summary([r["validation"][metric] for r in runs.values()]),
                "steps": _summary([r["validation"]["step"] for r in runs.values()]),
                "lowest_held_out": _summary([_lowest(r, metric) for r in runs.values()]),
                "lowest_at_step": _summary([_lowest(r, "step") for r in runs.values()]),
                "blimp": _summary([_blimp(r) for r in runs.values()]),
            }
        row["fast_minus_reference"] = {
            "held_out": _difference(fast, ref, paired, lambda r, m=metric: r["validation"][m]),
            "lowest_held_out": _difference(fast, ref, paired, lambda r, m=metric: _lowest(r, m)),
            "blimp": _difference(fast, ref, paired, _blimp),
        }
        held_out = row["fast_minus_reference"]["held_out"]
        row["winner"] = None
        if held_out and held_out["excludes_zero"]:
            row["winner"] = "fast" if held_out["mean"] < 0 else "reference"
        rows.append(row)
    return rows


def _same_cpu(a: dict, b: dict) -> bool:
    """Whether two runs trained on the same kind of machine (CPU model and core count): only
    such runs' budgets bought the same compute."""
    return all(a["machine"].get(k) == b["machine"].get(k) for k in ("cpu", "cpus"))


def _lowest(run: dict, key: str) -> float | None:
    """`key` of the run's lowest validation (None: a run kept without it, its log gone)."""
    lowest = run.get("lowest_validation")
    return lowest[key] if lowest else None


def _blimp(run: dict) -> float | None:
    """The run's BLiMP score (None: not scored, `--blimp-pairs 0`)."""
    return run["blimp"]["overall"] if run["blimp"] else None


def _summary(values: list[float | None]) -> dict | None:
    """Mean and spread of the values there are (None in `values`: a run without that figure)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    s = summarize_seeds(values)
    return {"n": s.n, "mean": s.mean, "std": s.std}


def _difference(a: dict, b: dict, seeds: list[int], score) -> dict | None:
    """a - b over `seeds`, leaving out a seed where either run has no `score` (None)."""
    seeds = [s for s in seeds if score(a[s]) is not None and score(b[s]) is not None]
    if not seeds:
        return None
    return paired_difference(
        {s: score(a[s]) for s in seeds}, {s: score(b[s]) for s in seeds}
    ).to_dict()


def verdict(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per family: how many cells each recipe won, and how many showed no difference."""
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        tally = counts.setdefault(row["family"], {"fast": 0, "reference": 0, "no difference": 0})
        tally[row["winner"] or "no difference"] += 1
    return counts


def _spread(s: dict | None, digits: int) -> str:
    if s is None:
        return "—"
    return f"{s['mean']:.{digits}f}" + (f" ± {s['std']:.{digits}f}" if s["n"] > 1 else "")


def _interval(d: dict | None, digits: int) -> str:
    return "—" if d is None else PairedDifference.from_dict(d).text(digits)


def table(rows: list[dict]) -> str:
    """Each cell's held-out figure at the run's last step (what `ckpt=<run>` loads), BLiMP,
    and the winner."""
    lines = []
    for row in rows:
        ref, fast, diff = row["reference"], row["fast"], row["fast_minus_reference"]
        paired = diff["held_out"]["n"] if diff["held_out"] else 0
        lines.append(
            [
                f"{row['family']} · {row['corpus']} · {row['budget']}",
                str(paired),
                row["metric"],
                _spread(ref["held_out"], 3),
                _spread(fast["held_out"], 3),
                _interval(diff["held_out"], 3),
                f"{_spread(ref['steps'], 0)} / {_spread(fast['steps'], 0)}",
                f"{_spread(ref['blimp'], 1)} / {_spread(fast['blimp'], 1)}",
                _interval(diff["blimp"], 1),
                row["winner"] or "no difference shown",
            ]
        )
    headers = [
        "family · corpus · budget",
        "paired seeds",
        "held-out figure",
        "reference",
        "fast",
        "fast - reference [95%]",
        "steps (ref / fast)",
        "BLiMP (ref / fast)",
        "BLiMP fast - ref [95%]",
        "winner (held-out)",
    ]
    return markdown_table(headers, lines, left=3)


def lowest_table(rows: list[dict]) -> str:
    """Each cell's lowest held-out figure during the run (the run's kept best checkpoint) and
    the step it came at: a recipe that ends above its lowest has memorized its corpus."""
    lines = [
        [
            f"{row['family']} · {row['corpus']} · {row['budget']}",
            row["metric"],
            _spread(row["reference"]["lowest_held_out"], 3),
            _spread(row["fast"]["lowest_held_out"], 3),
            _interval(row["fast_minus_reference"]["lowest_held_out"], 3),
            f"{_spread(row['reference']['lowest_at_step'], 0)} / "
            f"{_spread(row['fast']['lowest_at_step'], 0)}",
        ]
        for row in rows
    ]
    headers = [
        "family · corpus · budget",
        "held-out figure",
        "reference, lowest",
        "fast, lowest",
        "fast - reference [95%]",
        "at step (ref / fast)",
    ]
    return markdown_table(headers, lines, left=2)


def run(args: argparse.Namespace) -> dict:
    if "shakespeare" in args.corpora:
        require_data(TINY_SHAKESPEARE, "tiny Shakespeare")
    if args.blimp_pairs:
        require_data(BLIMP, "BLiMP")
    cells_dir = args.work_dir / "cells"
    if args.resume_from:
        added = resume_from(args.resume_from, cells_dir, args.overrides)
        print(
            f"recipe study: {added} runs kept from {', '.join(map(str, args.resume_from))} "
            f"(the others were kept here already)",
            flush=True,
        )
    kept = load_cells(cells_dir)
    other = sorted({tuple(made_with(r)) for r in kept} - {tuple(args.overrides)})
    if other:
        raise BenchError(
            f"{cells_dir} holds runs made with other --set overrides ({list(other[0])}); give "
            f"them again, or start another study with --work-dir"
        )
    where = machine()
    done = {Cell(**r["cell"]).name for r in kept}
    todo = [c for c in plan(args) if c.name not in done]
    print(f"recipe study: {len(todo)} runs to make, {len(done)} kept in {cells_dir}", flush=True)
    for cell in todo:
        run_cell(cell, args, where)
    runs = load_cells(cells_dir)
    rows = summarize(runs)
    report = {
        "machine": where,
        "args": _plain(vars(args)),
        "rows": rows,
        "verdict": verdict(rows),
        "runs": runs,
    }
    text = (
        f"{table(rows)}\n\nlowest during the run:\n{lowest_table(rows)}"
        f"\n\neach seed:\n{seeds_table(runs)}"
        f"\n\nwins per family (at the last step): {json.dumps(report['verdict'])}"
    )
    return finish(report, text, args.out)


def seeds_table(runs: list[dict]) -> str:
    """Each seed's two runs side by side: held-out figure at the last step and at the lowest
    (its step), steps made, BLiMP."""
    pairs: dict[tuple, dict[str, dict]] = {}
    for run in runs:
        c = run["cell"]
        pairs.setdefault((c["family"], c["corpus"], c["budget"], c["seed"]), {})[c["recipe"]] = run

    def both(by_recipe: dict[str, dict], figure) -> str:
        """`figure` of the reference and the fast run ("—": no such run or no such figure)."""
        texts = [figure(by_recipe[r]) if r in by_recipe else None for r in RECIPES]
        return " / ".join(text or "—" for text in texts)

    lines = []
    for (family, corpus, budget, seed), by_recipe in sorted(pairs.items()):
        metric = HELD_OUT[family]

        def last(run: dict, m: str = metric) -> str:
            return f"{run['validation'][m]:.3f}"

        def lowest(run: dict, m: str = metric) -> str | None:
            value = _lowest(run, m)
            return None if value is None else f"{value:.3f} @ {_lowest(run, 'step'):.0f}"

        def blimp(run: dict) -> str | None:
            return None if _blimp(run) is None else f"{_blimp(run):.1f}"

        lines.append(
            [
                f"{family} · {corpus} · {budget}",
                str(seed),
                both(by_recipe, last),
                both(by_recipe, lowest),
                both(by_recipe, lambda run: f"{run['validation']['step']:,.0f}"),
                both(by_recipe, blimp),
            ]
        )
    headers = [
        "family · corpus · budget",
        "seed",
        "held-out, last (ref / fast)",
        "lowest @ step (ref / fast)",
        "steps (ref / fast)",
        "BLiMP (ref / fast)",
    ]
    return markdown_table(headers, lines, left=1)


def _plain(values: dict) -> dict:
    """The arguments as JSON has them: paths (alone or in a list) as strings."""

    def plain(v):
        return (
            [plain(x) for x in v] if isinstance(v, list) else str(v) if isinstance(v, Path) else v
        )

    return {k: plain(v) for k, v in values.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(EXPERIMENTS), default=["bert", "gpt"])
    parser.add_argument("--corpora", nargs="+", choices=sorted(CORPORA), default=sorted(CORPORA))
    parser.add_argument(
        "--budgets", nargs="+", default=["2m", "10m", "20m"], help="trainer.budget of each run"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument(
        "--blimp-pairs", type=int, default=20, help="BLiMP pairs per phenomenon; 0: no BLiMP"
    )
    parser.add_argument("--work-dir", type=Path, default=REPO / "outputs" / "bench" / "recipes")
    parser.add_argument(
        "--out", type=Path, default=REPO / "outputs" / "bench" / "recipes.json", help="the report"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--resume-from",
        type=Path,
        nargs="+",
        default=[],
        metavar="REPORT",
        help="reports of earlier calls (their JSON): their runs are kept and not made again",
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    command_line(main)
