"""The recipe study: its plan, the runs it composes, what it reads back from a run, its paired
arithmetic and verdict, that a second call skips the runs already kept, and that a study
continues on a fresh checkout from a report's runs."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import bench_recipes
from bench.bench_recipes import (
    Cell,
    load_cells,
    lowest_validation,
    plan,
    summarize,
    validations,
    verdict,
)
from bench.common import BenchError
from pipeline.pretrain.checks import _check_setting_keys
from tests.conftest import compose_pretrain


def arguments(tmp_path, **changes) -> argparse.Namespace:
    values = {
        "models": ["bert", "gpt"],
        "corpora": ["wikitext2"],
        "budgets": ["2m"],
        "seeds": [1, 2, 3],
        "blimp_pairs": 0,
        "work_dir": tmp_path / "study",
        "out": tmp_path / "recipes.json",
        "overrides": [],
        "resume_from": [],
    }
    return argparse.Namespace(**(values | changes))


def test_the_two_recipes_of_a_seed_run_back_to_back(tmp_path):
    cells = plan(arguments(tmp_path, budgets=["2m", "10m"]))
    assert len(cells) == 2 * 2 * 3 * 2 and len({c.name for c in cells}) == len(cells)
    for first, second in zip(cells[::2], cells[1::2], strict=True):
        assert (first.recipe, second.recipe) == ("reference", "fast")
        assert first._replace(recipe="fast") == second
    assert [c.budget for c in cells[:12]] == ["2m"] * 12  # a budget is finished before the next


@pytest.mark.parametrize("corpus", sorted(bench_recipes.CORPORA))
@pytest.mark.parametrize("family", sorted(bench_recipes.EXPERIMENTS))
def test_each_run_composes_into_its_family_recipe_and_corpus(family, corpus):
    fast = compose_pretrain(*Cell(family, corpus, "2m", "fast", 2).overrides())
    reference = compose_pretrain(*Cell(family, corpus, "2m", "reference", 2).overrides())
    for cfg in (fast, reference):
        _check_setting_keys(cfg)
        assert (cfg.trainer.budget, cfg.seed) == ("2m", 2)
        assert cfg.model._target_.endswith("BertConfig" if family == "bert" else "GPTConfig")
    assert fast.optim._target_.endswith("MuonWithAdamW")
    assert reference.optim._target_ == "torch.optim.AdamW"
    assert fast.data == reference.data
    if corpus == "shakespeare":
        assert list(fast.data.paths) == [str(bench_recipes.TINY_SHAKESPEARE)]


def test_last_validation_is_the_last_row_with_a_validation(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(
        "step,train/loss,val/loss,val/bits_per_byte\n"
        "10,5.0,4.5,2.0\n"
        "20,4.0,,\n"
        "30,3.5,4.0,1.8\n"
        "35,3.4,,\n"
    )
    assert validations(metrics)[-1] == {"step": 30.0, "val/loss": 4.0, "val/bits_per_byte": 1.8}
    metrics.write_text("step,train/loss,val/loss\n10,5.0,\n")
    with pytest.raises(BenchError, match="has no validation row"):
        validations(metrics)
    with pytest.raises(BenchError, match="no metrics at"):
        validations(tmp_path / "missing.csv")


def test_lowest_validation_is_the_row_with_the_lowest_held_out_figure(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(
        "step,train/loss,val/loss,val/bits_per_byte\n"
        "10,5.0,4.5,2.0\n"
        "20,4.0,4.1,1.7\n"
        "30,3.5,4.6,2.1\n"
    )
    assert lowest_validation(validations(metrics), "val/bits_per_byte") == {
        "step": 20.0,
        "val/loss": 4.1,
        "val/bits_per_byte": 1.7,
    }
    assert validations(metrics)[-1]["step"] == 30.0


def test_a_run_kept_without_its_lowest_validation_gets_it_from_its_log(tmp_path):
    cells = tmp_path / "cells"
    cells.mkdir()
    kept = result("fast", 1, 2.1, None)
    del kept["lowest_validation"]
    name = Cell(**kept["cell"]).name
    (cells / f"{name}.json").write_text(json.dumps(kept))
    assert load_cells(cells)[0]["lowest_validation"] is None  # the run's folder is gone
    log = tmp_path / "runs" / "gpt" / name / "logs" / "metrics.csv"
    log.parent.mkdir(parents=True)
    log.write_text("step,val/loss,val/bits_per_byte\n10,4.0,1.9\n20,4.4,2.1\n")
    assert load_cells(cells)[0]["lowest_validation"]["step"] == 10.0


def result(
    recipe: str,
    seed: int,
    held_out: float,
    blimp: float | None,
    cpu: str = "cpu A",
    lowest: float | None = None,
):
    """A kept run; `lowest`: its lowest held-out figure, at step 50 (default: the last one)."""
    last = {"step": 100.0 + seed, "val/bits_per_byte": held_out}
    return {
        "cell": Cell("gpt", "wikitext2", "2m", recipe, seed)._asdict(),
        "machine": {"cpu": cpu},
        "validation": last,
        "lowest_validation": last
        if lowest is None
        else {"step": 50.0, "val/bits_per_byte": lowest},
        "blimp": None if blimp is None else {"pairs": 20, "overall": blimp},
    }


def test_a_recipe_that_wins_at_its_lowest_can_lose_at_its_last_step():
    """Memorizing a small corpus: fast reaches the lower figure mid-run but ends above."""
    results = [
        result("reference", 1, 2.0, None, lowest=1.90),
        result("fast", 1, 2.8, None, lowest=1.80),
        result("reference", 2, 2.1, None, lowest=1.92),
        result("fast", 2, 2.7, None, lowest=1.81),
        result("reference", 3, 2.0, None, lowest=1.91),
        result("fast", 3, 2.9, None, lowest=1.83),
    ]
    (row,) = summarize(results)
    assert row["winner"] == "reference"  # decided at the last step
    lowest = row["fast_minus_reference"]["lowest_held_out"]
    assert lowest["mean"] == pytest.approx(-0.0967, abs=1e-3) and lowest["high"] < 0
    assert row["fast"]["lowest_at_step"]["mean"] == 50.0
    text = bench_recipes.lowest_table([row])
    assert "1.813 ± 0.015" in text and "50 ± 0 / 50 ± 0" in text


def test_paired_differences_over_seeds_and_the_winner():
    results = [
        result("reference", 1, 2.0, 50.0),
        result("fast", 1, 1.8, 52.0),
        result("reference", 2, 2.1, 51.0),
        result("fast", 2, 1.85, 51.0),
        result("reference", 3, 2.2, 49.0),
        result("fast", 3, 2.05, 53.0),
    ]
    (row,) = summarize(results)
    diff = row["fast_minus_reference"]["held_out"]
    assert diff["n"] == 3 and diff["mean"] == pytest.approx(-0.2)
    # the three differences -0.2, -0.25, -0.15: sd 0.05, t(0.975, 2) = 4.303
    assert diff["high"] == pytest.approx(-0.2 + 4.303 * 0.05 / 3**0.5, abs=1e-3)
    assert row["winner"] == "fast"  # lower bits per byte, the interval below zero
    assert row["fast_minus_reference"]["blimp"]["mean"] == pytest.approx(2.0)
    assert row["reference"]["held_out"]["mean"] == pytest.approx(2.1)
    assert row["fast"]["steps"]["mean"] == pytest.approx(102.0)
    assert verdict([row]) == {"gpt": {"fast": 1, "reference": 0, "no difference": 0}}
    assert "gpt · wikitext2 · 2m" in bench_recipes.table([row])


def test_no_winner_without_an_interval_clear_of_zero_and_no_pairs_across_cpus():
    results = [
        result("reference", 1, 2.0, None),
        result("fast", 1, 1.9, None),
        result("reference", 2, 2.0, None),
        result("fast", 2, 2.1, None),
        result("reference", 3, 2.0, None),
        result("fast", 3, 1.0, None, cpu="cpu B"),  # another machine: not paired
    ]
    (row,) = summarize(results)
    assert row["fast_minus_reference"]["held_out"]["n"] == 2
    assert row["winner"] is None and row["fast_minus_reference"]["blimp"] is None
    assert verdict([row])["gpt"]["no difference"] == 1
    assert "no difference shown" in bench_recipes.table([row])


def fake_runs(monkeypatch) -> list[str]:
    """Replace training by a run kept at once (fast 1.5, reference 2.0 + 0.1 x seed); returns
    the names of the runs made, in order."""
    made = []

    def fake_run(cell, args, where):
        made.append(cell.name)
        held_out = 1.5 if cell.recipe == "fast" else 2.0 + 0.1 * cell.seed
        kept = result(cell.recipe, cell.seed, held_out, None) | {"cell": cell._asdict()}
        (args.work_dir / "cells").mkdir(parents=True, exist_ok=True)
        (args.work_dir / "cells" / f"{cell.name}.json").write_text(json.dumps(kept))
        return kept

    monkeypatch.setattr(bench_recipes, "run_cell", fake_run)
    monkeypatch.setattr(bench_recipes, "machine", lambda: {"cpu": "cpu A"})
    return made


def test_a_second_call_skips_the_runs_kept_and_reports_them_all(tmp_path, monkeypatch):
    made = fake_runs(monkeypatch)
    args = arguments(tmp_path, models=["gpt"], seeds=[1, 2])
    bench_recipes.run(args)
    assert len(made) == 4
    report = bench_recipes.run(arguments(tmp_path, models=["gpt"], seeds=[1, 2, 3]))
    assert made[4:] == ["gpt-wikitext2-2m-reference-seed3", "gpt-wikitext2-2m-fast-seed3"]
    (row,) = report["rows"]
    assert row["fast_minus_reference"]["held_out"]["n"] == 3 and row["winner"] == "fast"
    assert json.loads(args.out.read_text())["verdict"] == {
        "gpt": {"fast": 1, "reference": 0, "no difference": 0}
    }


def test_runs_kept_with_other_overrides_are_not_mixed_into_a_study(tmp_path, monkeypatch):
    cells = tmp_path / "study" / "cells"
    cells.mkdir(parents=True)
    kept = result("fast", 1, 1.5, None) | {"set": ["objective.batch_size=8"]}
    (cells / "gpt-wikitext2-2m-fast-seed1.json").write_text(json.dumps(kept))
    monkeypatch.setattr(bench_recipes, "run_cell", lambda *a: pytest.fail("ran a cell"))
    with pytest.raises(
        BenchError, match=r"other --set overrides \(\['objective\.batch_size=8'\]\)"
    ):
        bench_recipes.run(arguments(tmp_path, models=["gpt"], seeds=[1]))


def test_a_study_continues_from_a_report_on_a_fresh_checkout(tmp_path, monkeypatch):
    made = fake_runs(monkeypatch)
    first = arguments(tmp_path / "session1", models=["gpt"], seeds=[1, 2])
    bench_recipes.run(first)
    report = json.loads(first.out.read_text())
    assert sorted(r["cell"]["seed"] for r in report["runs"]) == [1, 1, 2, 2]
    # a fresh checkout: another work dir, where the fast run of seed 1 was made again (1.4)
    fresh = arguments(tmp_path / "session2", models=["gpt"], seeds=[1, 2, 3])
    again = result("fast", 1, 1.4, None)
    (fresh.work_dir / "cells").mkdir(parents=True)
    (fresh.work_dir / "cells" / "gpt-wikitext2-2m-fast-seed1.json").write_text(json.dumps(again))
    fresh.resume_from = [first.out]
    made.clear()
    resumed = bench_recipes.run(fresh)
    assert made == ["gpt-wikitext2-2m-reference-seed3", "gpt-wikitext2-2m-fast-seed3"]
    (row,) = resumed["rows"]
    assert row["fast_minus_reference"]["held_out"]["n"] == 3
    fast_1 = [
        r
        for r in resumed["runs"]
        if r["cell"] == Cell("gpt", "wikitext2", "2m", "fast", 1)._asdict()
    ]
    assert [r["validation"]["val/bits_per_byte"] for r in fast_1] == [1.4]  # the kept run won
    seeds = bench_recipes.seeds_table(resumed["runs"])
    assert "| gpt · wikitext2 · 2m | 1 | 2.100 / 1.400 |" in seeds
    assert "| gpt · wikitext2 · 2m | 3 | 2.300 / 1.500 |" in seeds


def kept_run(recipe: str, seed: int, cpu: str = "cpu A", **changes) -> dict:
    """A run as a report keeps it (`result` with its overrides and its BLiMP entry)."""
    return result(recipe, seed, 2.0, None, cpu=cpu) | {"set": []} | changes


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "no report at"),
        ("{not json", r"is not valid JSON .*git checkout -- "),
        (json.dumps({"rows": [], "verdict": {}}), r"holds no runs.*make those runs again"),
        # a good run, then one made with other overrides: neither is kept
        (
            json.dumps({"runs": [kept_run("fast", 1), kept_run("reference", 1, set=["seed=9"])]}),
            r"run 1 was made with --set \['seed=9'\], this call gives \[\]",
        ),
        # a good run, then one without its held-out figure
        (
            json.dumps({"runs": [kept_run("fast", 1), kept_run("reference", 1, validation={})]}),
            r"run 1 is incomplete \(KeyError",
        ),
        (
            json.dumps(
                {
                    "runs": [
                        kept_run("fast", 1, cell={**Cell("gpt", "x", "../2m", "fast", 1)._asdict()})
                    ]
                }
            ),
            r"run 0 is not a run of this study",
        ),
    ],
)
def test_resuming_from_a_bad_report_keeps_nothing_from_it(tmp_path, text, says):
    report = tmp_path / "recipes.json"
    if text is not None:
        report.write_text(text)
    cells = tmp_path / "study" / "cells"
    with pytest.raises(BenchError, match=says):
        bench_recipes.resume_from([report], cells, [])
    assert not cells.exists()


def test_a_reported_run_whose_partner_was_made_here_on_another_cpu_is_made_again(tmp_path):
    cells = tmp_path / "study" / "cells"
    cells.mkdir(parents=True)
    here = kept_run("fast", 1, cpu="cpu B")
    (cells / "gpt-wikitext2-2m-fast-seed1.json").write_text(json.dumps(here))
    report = tmp_path / "recipes.json"
    reported = [kept_run(r, s) for s in (1, 2) for r in ("reference", "fast")]
    report.write_text(json.dumps({"runs": reported}))
    assert bench_recipes.resume_from([report], cells, []) == 2  # seed 2's pair only
    assert sorted(p.name for p in cells.iterdir()) == [
        "gpt-wikitext2-2m-fast-seed1.json",
        "gpt-wikitext2-2m-fast-seed2.json",
        "gpt-wikitext2-2m-reference-seed2.json",
    ]
    assert json.loads((cells / "gpt-wikitext2-2m-fast-seed1.json").read_text()) == here


def test_each_seed_shows_both_runs_last_and_lowest_figures():
    runs = [
        result("reference", 1, 2.0, 50.0),
        result("fast", 1, 2.8, 51.5, lowest=1.8),
        result("reference", 2, 2.1, None),  # its fast run not made yet
    ]
    text = bench_recipes.seeds_table(runs)
    assert (
        "| gpt · wikitext2 · 2m | 1 | 2.000 / 2.800 | 2.000 @ 101 / 1.800 @ 50 | 101 / 101 | 50.0 / 51.5 |"
        in text
    )
    assert "| gpt · wikitext2 · 2m | 2 | 2.100 / — | 2.100 @ 102 / — | 102 / — | — / — |" in text
