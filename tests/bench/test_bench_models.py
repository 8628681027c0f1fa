"""Smoke test of bench/bench_models.py at the tiny size: the report's schema, not the speed."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from bench import bench_models
from models import flops_per_token


def test_tiny_run_reports_both_models_in_both_dtypes(tmp_path):
    out = tmp_path / "models.json"
    tiny = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--matmul-n", "128"]
    both = ["--dtype", "fp32,bf16"]  # bf16 even where it is emulated
    report = bench_models.main([*tiny, *both, "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["dtypes"] == ["fp32", "bf16"] and report["skipped"] == {}
    peaks = report["matmul_peaks"]
    assert {dtype: (p["n"], p["dtype"]) for dtype, p in peaks.items()} == {
        "fp32": (128, "float32"),
        "bf16": (128, "bfloat16"),
    }
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
        peak = peaks[row["dtype"]]["flops_per_s"]
        assert peak == max(peaks[row["dtype"]]["trials_flops_per_s"]) > 0
        for impl in ("ours", "hf"):
            assert row[impl]["mfu"] == pytest.approx(
                row["flops_per_token"] * row[impl]["tokens_per_s"] / peak
            )
        # The ceiling: the reference's step time over the step's useful FLOPs at the peak.
        floor_s = row["flops_per_token"] * row["tokens_per_step"] / peak
        assert row["speedup_ceiling"] == pytest.approx(row["hf"]["median_step_s"] / floor_s)
    assert "| bert-tiny | bf16 |" in bench_models.table(report)


def test_useful_flops_count_the_bert_mlm_head_on_the_masked_share_only():
    cpu = torch.device("cpu")
    bert = bench_models.bert_case("tiny", cpu, contextlib.nullcontext)
    gpt = bench_models.gpt_case("tiny", cpu, contextlib.nullcontext)
    assert bench_models.useful_flops_per_token(bert) == pytest.approx(
        flops_per_token(bert.config, bert.seq_len, predicted_fraction=0.15)
    )
    assert bench_models.useful_flops_per_token(bert) < flops_per_token(bert.config, bert.seq_len)
    assert bench_models.useful_flops_per_token(gpt) == flops_per_token(gpt.config, gpt.seq_len)


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


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        ([], "cpu", ["fp32"]),
        (["avx512_bf16"], "cpu", ["fp32", "bf16"]),
        ([], "cuda", ["fp32", "bf16"]),
    ],
)
def test_auto_skips_bf16_where_it_would_be_emulated_and_says_why(
    monkeypatch, flags, device, expected
):
    monkeypatch.setattr(bench_models, "native_bf16_flags", lambda: flags)
    dtypes, skipped = bench_models.chosen_dtypes("auto", device)
    assert dtypes == expected
    assert ("bf16" in skipped) == ("bf16" not in expected)
    assert "no native bf16" in skipped.get("bf16", "no native bf16")
    assert bench_models.chosen_dtypes("fp32,bf16", "cpu") == (["fp32", "bf16"], {})


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_models.main(["--dtype", "fp16", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow
def test_compile_is_timed_against_eager_with_the_compilation_apart(tmp_path):
    tiny = ["--size", "tiny", "--steps", "2", "--warmup", "1", "--matmul-n", "128"]
    args = [*tiny, "--models", "gpt", "--dtype", "fp32", "--compile", "--device", "cpu"]
    report = bench_models.main([*args, "--out", str(tmp_path / "models.json")])
    (row,) = report["results"]
    assert row["ours_compiled"]["median_step_s"] > 0
    assert row["compile"]["speedup"] == pytest.approx(
        row["ours"]["median_step_s"] / row["ours_compiled"]["median_step_s"]
    )
    assert row["compile"]["compile_s"] > 0  # compiling takes longer than a tiny eager step
    assert "torch.compile" in bench_models.table(report)
