"""Smoke test of bench/bench_models.py at the tiny size: the report's schema, not the speed."""

from __future__ import annotations

import json

import pytest

from bench import bench_models


def test_tiny_run_reports_both_models_in_both_dtypes(tmp_path):
    out = tmp_path / "models.json"
    report = bench_models.main(
        ["--size", "tiny", "--steps", "1", "--warmup", "0", "--device", "cpu", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["dtypes"] == ["fp32", "bf16"]
    assert [(r["model"], r["dtype"]) for r in report["results"]] == [
        ("bert-tiny", "fp32"),
        ("gpt-tiny", "fp32"),
        ("bert-tiny", "bf16"),
        ("gpt-tiny", "bf16"),
    ]
    for row, fig in zip(report["results"], report["figures"], strict=True):
        for impl in ("ours", "hf"):
            assert row[impl]["tokens_per_s"] > 0 and len(row[impl]["steps_s"]) == 1
        assert row["speedup"] == pytest.approx(
            row["hf"]["median_step_s"] / row["ours"]["median_step_s"]
        )
        assert fig["ratio"] == pytest.approx(
            row["ours"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        )
        assert fig["target"] is None  # the targets are for the mini sizes on a CPU
    assert "| bert-tiny | bf16 |" in bench_models.table(report)


def test_cpu_targets_apply_to_the_mini_sizes():
    def row(model, ours, hf):
        return {
            "model": model,
            "dtype": "fp32",
            "ours": {"tokens_per_s": ours},
            "hf": {"tokens_per_s": hf},
        }

    report = {
        "device": "cpu",
        "size": "mini",
        "results": [row("bert-mini", 210.0, 100.0), row("gpt-mini", 120.0, 100.0)],
    }
    bert, gpt = bench_models.figures(report)
    assert (bert["target"], bert["met"]) == (">= 2", True)
    assert (gpt["target"], gpt["met"]) == (">= 1.3", False)
    assert all(f["target"] is None for f in bench_models.figures({**report, "device": "cuda"}))


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_models.main(["--dtype", "fp16", "--out", str(tmp_path / "x.json")])
