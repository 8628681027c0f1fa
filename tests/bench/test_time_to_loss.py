"""The time-to-loss benchmark: its arithmetic, the wall clock it adds to our runs, the reference
loop (whose losses must be defined as ours), and an end-to-end smoke run at a trivial size."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from bench import bench_memory, bench_time_to_loss, reference_train
from bench.bench_time_to_loss import time_to_reach, validation_points
from bench.clock import WallClockLogger, read_clock
from bench.common import BenchError, plan_steps
from pipeline.training.loggers import numbered_from_one

TINY = ["data=embedded", "tokenizer.vocab_size=1000", "objective.batch_size=4"]


def points(*pairs):
    return [
        {"step": 10 * (i + 1), "time_s": t, "val_loss": loss} for i, (t, loss) in enumerate(pairs)
    ]


def test_time_to_reach_interpolates_between_validations():
    curve = points((1.0, 5.0), (2.0, 4.0), (3.0, 3.0))
    assert time_to_reach(curve, 3.5) == pytest.approx(2.5)
    assert time_to_reach(curve, 3.0) == pytest.approx(3.0)
    assert time_to_reach(curve, 6.0) == pytest.approx(1.0)  # the first validation already is
    assert time_to_reach(curve, 2.9) is None
    # the first crossing counts, not a later one after a bump
    assert time_to_reach(points((1.0, 5.0), (2.0, 4.0), (3.0, 4.5), (4.0, 3.0)), 4.2) == (
        pytest.approx(1.8)
    )


def test_summary_ratio_is_ours_time_to_reference_loss_over_reference_time():
    reference = {
        "max_steps": 30,
        "val_every": 10,
        "steps": 30,
        "points": points((5, 5.0), (10, 4.0)),
    }
    fast = {"steps": 30, "points": points((2, 4.5), (4, 4.0), (6, 3.8))}
    result = bench_time_to_loss.summarize("gpt", reference, fast)
    assert result["ours_time_to_reference_loss_s"] == pytest.approx(4.0)
    assert result["time_ratio"] == pytest.approx(0.4) and result["met"] is True
    assert (result["ours_final_loss"], result["reference_final_loss"]) == (3.8, 4.0)
    never = bench_time_to_loss.summarize(
        "gpt", reference, {"steps": 30, "points": points((2, 4.5))}
    )
    assert never["time_ratio"] is None and never["met"] is False
    slow = {"steps": 30, "points": points((7, 4.5), (8, 4.0))}
    assert bench_time_to_loss.summarize("gpt", reference, slow)["met"] is False  # 0.8 > 0.6
    report = {"results": {"gpt": result}}
    _, time_figure = bench_time_to_loss.figures(report)
    assert time_figure["ratio"] == pytest.approx(result["time_ratio"])
    assert time_figure["target"] == "<= 0.6" and time_figure["met"] is True


def test_the_best_recipe_and_bits_per_byte_are_summarized_against_the_reference():
    reference = {"steps": 30, "points": points((5, 5.0), (10, 4.0))}
    ours = {"steps": 30, "points": points((4, 4.5), (8, 4.0))}
    ours["points"][-1]["bits_per_byte"] = 2.0  # 0.5 bits per nat on these windows
    recipe = {
        "overrides": ["trainer.budget=10s"],
        "steps": 50,
        "points": points((2, 4.2), (3, 3.8)),
    }
    recipe["points"][-1]["bits_per_byte"] = 1.9
    result = bench_time_to_loss.summarize("gpt", reference, ours, {"recipe_at_target": recipe})
    assert result["reference_final_bits_per_byte"] == pytest.approx(2.0)  # 4.0 nats x 0.5
    at_target = result["recipe_at_target"]
    assert at_target["time_ratio"] == pytest.approx(0.25)  # 4.0 reached at 2.5 s of 10
    assert at_target["met"] is True and at_target["target"] == 0.4
    report = {"results": {"gpt": result}, "budget_s": 10, "device": "cpu", "dtype": "fp32"}
    report["val_batches"] = 2
    recipe_figure = bench_time_to_loss.figures(report)[-1]
    assert recipe_figure["target"] == "<= 0.4" and recipe_figure["met"] is True
    text = bench_time_to_loss.table(report)
    assert "gpt, best recipe paced to 0.40" in text
    assert "reference 2.0000, ours 2.0000, best recipe paced to 0.40" in text and "1.9000" in text
    slow = {"overrides": [], "steps": 5, "points": points((9, 4.5))}
    missed = bench_time_to_loss.summarize("gpt", reference, ours, {"recipe_at_target": slow})
    assert missed["recipe_at_target"]["met"] is False


def test_the_recipe_paced_to_the_target_is_summarized_and_tabled_beside_the_full_one():
    reference = {"steps": 30, "points": points((5, 5.0), (10, 4.0))}
    ours = {"steps": 30, "points": points((4, 4.5), (8, 4.0))}
    # paced to the whole 10 s: passes 4.0 at 5 s (0.5), ends far lower
    full = {"budget_s": 10, "overrides": [], "steps": 60, "points": points((4, 4.4), (6, 3.6))}
    # paced to 4 s: ends at 3.9, having passed 4.0 at 3.5 s (0.35)
    short = {"budget_s": 4, "overrides": [], "steps": 25, "points": points((2, 4.6), (4, 3.8))}
    result = bench_time_to_loss.summarize(
        "bert", reference, ours, {"recipe": full, "recipe_at_target": short}
    )
    assert result["recipe"]["time_ratio"] == pytest.approx(0.5)
    # the run paced to the whole budget is for information: no target, neither met nor missed
    assert result["recipe"]["target"] is None and result["recipe"]["met"] is None
    assert result["recipe_at_target"]["time_ratio"] == pytest.approx(0.35)
    assert result["recipe_at_target"]["met"] is True
    assert result["recipe_at_target"]["final_loss"] == 3.8
    report = {"results": {"bert": result}, "budget_s": 10, "device": "cpu", "dtype": "fp32"}
    report["val_batches"] = 2
    *_, full_figure, short_figure = bench_time_to_loss.figures(report)
    assert "paced to 0.40 of the reference's time" in short_figure["name"]
    assert (full_figure["target"], full_figure["met"]) == (None, None)
    assert (short_figure["target"], short_figure["met"]) == ("<= 0.4", True)
    text = bench_time_to_loss.table(report)
    assert "| bert, best recipe paced to the whole budget | 60 / 30 |" in text
    assert "| 0.5 |  |" in text  # its ratio, no target, no verdict
    assert "bert, best recipe paced to 0.40 of the reference's time" in text
    assert "0.35 (<= 0.40) | yes |" in text
    assert "recipe at target step" in text  # its curve beside the others
    # a run that stops above the reference's loss never reaches it
    above = short | {"points": points((2, 4.6), (4, 4.1))}
    missed = bench_time_to_loss.summarize(
        "bert", reference, ours, {"recipe": full, "recipe_at_target": above}
    )
    assert missed["recipe_at_target"]["time_ratio"] is None
    assert missed["recipe_at_target"]["met"] is False


def test_the_target_budget_is_the_share_of_the_reference_time():
    reference = {"points": points((100.0, 5.0), (525.1, 4.0))}
    assert bench_time_to_loss.target_budget_s(reference) == 210  # 0.4 x 525.1, floored
    assert bench_time_to_loss.target_budget_s({"points": points((1.2, 5.0))}) == 1
    with pytest.raises(BenchError, match="no validation"):
        bench_time_to_loss.target_budget_s({"points": []})


def test_plan_fits_training_and_validation_into_the_budget():
    # 0.9 x 100 s, less 5 validations of 2 batches at 0.5 s = 85 s of 1 s steps
    assert plan_steps(100, 1.0, 0.5, 5, 2, 0.9) == (85, 17)
    # 17 steps fit in 10 validation points: every 2 steps, so 16 steps and 8 validations
    assert plan_steps(18, 1.0, 0.1, 10, 1, 1.0) == (16, 2)
    assert plan_steps(1, 1.0, 0.5, 5, 2, 0.9) == (1, 1)  # at least one step


def test_step_timing_reads_a_runs_clock():
    # steps 1..4 logged at 10, 15, 17, 19 s (the first step is warm-up), validation done at 22 s
    rows = [
        {"step": step, "elapsed_s": at, "metrics": {"train/loss": 5.0}}
        for step, at in enumerate([10.0, 15.0, 17.0, 19.0], start=1)
    ]
    rows.append({"step": 4, "elapsed_s": 22.0, "metrics": {"val/loss": 4.0}})
    timing = bench_time_to_loss.step_timing(rows, val_batches=4)
    assert timing == {"step_s": pytest.approx(2.0), "val_batch_s": pytest.approx(0.75)}
    with pytest.raises(BenchError, match="too few steps"):
        bench_time_to_loss.step_timing(rows[:1], val_batches=4)


def test_max_time_is_lightnings_format():
    assert bench_time_to_loss.max_time(240) == "'00:00:04:00'"
    assert bench_time_to_loss.max_time(90061) == "'01:01:01:01'"


def test_wikitext_is_required_unless_the_data_is_overridden(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    bench_time_to_loss.add_run_arguments(parser)
    monkeypatch.setattr(bench_time_to_loss, "WIKITEXT2", tmp_path / "wikitext-2-tokenized")
    args = parser.parse_args([])
    with pytest.raises(BenchError, match=f"{tmp_path}.*shared/data"):
        bench_time_to_loss.data_overrides(args)
    assert bench_time_to_loss.data_overrides(parser.parse_args(["--set", "data=embedded"])) == []


def test_wall_clock_logger_in_a_real_fit_marks_validations_with_steps_done(tmp_path):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Logged(BoringModel):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", self.step(batch))

    path = tmp_path / "clock.jsonl"
    trainer = L.Trainer(
        max_steps=6,
        val_check_interval=3,
        limit_val_batches=1,
        logger=[numbered_from_one(WallClockLogger(str(path)))],  # as build_loggers adds it
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Logged())
    rows = read_clock(path)
    vals = validation_points(rows)
    assert [p["step"] for p in vals] == [3, 6]
    assert 0 < vals[0]["time_s"] < vals[1]["time_s"]
    times = [row["elapsed_s"] for row in rows]
    assert times == sorted(times)


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_reference_losses_are_defined_as_ours(tmp_path, family):
    from models import load_hf_bert, load_hf_gpt
    from pipeline.run.families import family_named

    run = reference_train.compose_run(
        [f"model={family}-tiny", f"recipe={family}-reference", *TINY, f"paths.cache_dir={tmp_path}"]
    )
    torch.manual_seed(0)
    hf = reference_train.build_model(family, run.model_config, torch.device("cpu")).eval()
    module = family_named(family).module_class(run.model_config, optimizer=None, scheduler=None)
    module.model = (load_hf_bert if family == "bert" else load_hf_gpt)(hf).eval()
    batches = [b for b, _ in zip(run.datamodule.val_dataloader(), range(2), strict=False)]
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for batch in batches:
            theirs = reference_train.losses(family, hf, batch)
            ours = module.losses(batch)
            for name, (mean, count) in theirs.items():
                assert count == ours[name][1]
                torch.testing.assert_close(mean, ours[name][0], rtol=1e-4, atol=1e-4)
                total = sums.setdefault(name, [0.0, 0])
                total[0] += float(mean) * count
                total[1] += count
    # validation weighs each batch by its predictions, as PretrainModule's val metrics do
    validated = reference_train.validate(family, hf, batches, contextlib.nullcontext)
    expected = {name: s / n for name, (s, n) in sums.items()}
    for name, value in expected.items():
        assert validated[name] == pytest.approx(value, rel=1e-5)
    assert validated["loss"] == pytest.approx(
        sum(expected.values()) if family == "bert" else expected["loss"]
    )


def test_reference_calibration_times_steps_after_a_warm_up_pass(tmp_path, monkeypatch):
    """The plan is priced from warm steps: one pass over the sample batches is left out, and
    the median of the timed steps (all reported) is the step time."""
    run = reference_train.compose_run(
        [
            "model=bert-tiny",
            "recipe=bert-reference",
            *TINY,
            "trainer.limit_val_batches=2",
            f"paths.cache_dir={tmp_path}",
        ]
    )
    seconds = iter([10.0, 9.0, 8.0, 7.0] + [1.0, 3.0, 2.0, 1.5] * 2)  # slow first steps
    real_step = reference_train.train_step

    def timed_step(*args):
        real_step(*args)
        clock.now += next(seconds)

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(reference_train, "train_step", timed_step)
    monkeypatch.setattr(reference_train.time, "perf_counter", clock)
    sample = len(list(zip(run.datamodule.val_dataloader(), range(4), strict=False)))
    assert sample == 4  # the test's timings assume four sample batches
    calibration = reference_train.calibrate(run, torch.device("cpu"), contextlib.nullcontext)
    assert calibration["warmup_step_times_s"] == [10.0, 9.0, 8.0, 7.0]
    assert calibration["step_times_s"] == [1.0, 3.0, 2.0, 1.5] * 2
    assert len(calibration["step_times_s"]) == reference_train.CALIBRATION_STEPS
    assert calibration["step_s"] == pytest.approx(1.75)  # the median of the warm steps


def test_the_reference_loop_refuses_a_recipe_it_would_not_follow(tmp_path):
    """The transformers loop trains with AdamW from a zero bias: given the fast recipe (Muon,
    the unigram bias) it would silently stop being the reference."""
    with pytest.raises(BenchError, match=r"give its family's reference recipe \(recipe=bert-ref"):
        reference_train.compose_run(["model=bert-tiny", *TINY, f"paths.cache_dir={tmp_path}"])


def test_reference_loop_trains_validates_and_reports(tmp_path):
    out = tmp_path / "ref.json"
    report = reference_train.main(
        [
            "--out", str(out), "--budget-s", "600", "--max-steps", "3", "--val-every", "2",
            "--", "model=bert-tiny", "recipe=bert-reference", *TINY, "trainer.limit_val_batches=2",
            f"paths.cache_dir={tmp_path}/cache",
        ]
    )  # fmt: skip
    assert out.is_file() and report["family"] == "bert" and report["model"] == "BertForPreTraining"
    assert (report["steps"], report["stopped_by"], report["val_batches"]) == (3, "max_steps", 2)
    assert [p["step"] for p in report["points"]] == [2, 3]
    for p in report["points"]:
        assert p["time_s"] > 0
        assert p["val_loss"] == pytest.approx(p["terms"]["mlm_loss"] + p["terms"]["nsp_loss"])
    assert report["points"][0]["time_s"] < report["points"][1]["time_s"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_end_to_end_at_a_trivial_size(tmp_path, family):
    report = bench_time_to_loss.main(
        [
            "--models", family, "--budget-s", "6", "--val-points", "2", "--val-batches", "2",
            "--set", f"model={family}-tiny", *(a for o in TINY for a in ("--set", o)),
            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "ttl.json"),
        ]
    )  # fmt: skip
    result = report["results"][family]
    for side in ("reference", "ours"):
        plan = result[side]
        assert plan["max_steps"] % plan["val_every"] == 0
        assert plan["max_steps"] // plan["val_every"] <= 2  # --val-points
        steps = [p["step"] for p in result[side]["points"]]
        assert steps and steps == sorted(steps) and steps[-1] == result[side]["steps"]
        assert all(p["val_loss"] > 0 and p["time_s"] > 0 for p in result[side]["points"])
    assert result["reference_final_loss"] == result["reference"]["points"][-1]["val_loss"]
    if result["time_ratio"] is not None:
        assert result["time_ratio"] == pytest.approx(
            result["ours_time_to_reference_loss_s"] / result["reference_time_s"]
        )
    assert result["met"] == (result["time_ratio"] is not None and result["time_ratio"] <= 0.6)
    for process in ("prepare", "reference", "ours", "recipe", "recipe_at_target"):
        assert result["processes"][process]["peak_rss_mb"] > 50
    at_target = result["recipe_at_target"]
    assert at_target["budget_s"] == bench_time_to_loss.target_budget_s(result["reference"])
    assert f"trainer.budget={at_target['budget_s']}s" in at_target["overrides"]
    assert at_target["points"] and at_target["steps"] == at_target["points"][-1]["step"]
    assert not list((tmp_path / "work").glob("*/runs/*/*/checkpoints"))
    memory = bench_memory.figures(report)
    assert [f["name"] for f in memory] == [
        f"{family} training peak RSS",
        f"{family} data preparation peak RSS",
    ]
    assert f"| {family} |" in bench_memory.table(report)
    assert f"{family} validation curves" in bench_time_to_loss.table(report)
