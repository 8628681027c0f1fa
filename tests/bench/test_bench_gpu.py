"""Smoke test of bench/bench_gpu.py on the CPU at the tiny size: the report's schema and its
arithmetic (MFU against the measured peak), not the speed; and where its targets apply."""

from __future__ import annotations

import json

import pytest

from bench import bench_gpu
from bench.common import figure


def run_tiny(tmp_path, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    shrunk = ["--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "1"]
    small = ["--matmul-n", "256", "--bert-batch", "4", "--gpt-batch", "2"]
    report = bench_gpu.main([*shrunk, *small, "--out", str(out), *extra])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    return report


def test_tiny_cpu_run_reports_throughput_and_mfu_of_both_models(tmp_path):
    report = run_tiny(tmp_path, "--no-compile", "--profile", str(tmp_path / "profile"))
    assert not report["compile"]
    peak = report["peak"]["flops_per_s"]
    assert peak == max(report["peak"]["trials_flops_per_s"]) > 0
    assert [(r["model"], r["batch"], r["seq_len"]) for r in report["results"]] == [
        ("bert-tiny", 4, 32),
        ("gpt-tiny", 2, 32),
    ]
    for row in report["results"]:
        for impl in ("ours", "hf"):
            r = row[impl]
            assert len(r["steps_s"]) == 2 and r["peak_step_mb"] is None  # no CUDA memory on CPU
            assert r["tokens_per_s"] == pytest.approx(row["batch"] * 32 / r["median_step_s"])
            assert r["sequences_per_s"] == pytest.approx(row["batch"] / r["median_step_s"])
            assert r["mfu"] == pytest.approx(row["flops_per_token"] * r["tokens_per_s"] / peak)
            assert r["mfu_datasheet"] is None  # no datasheet peak for a CPU
            table = (tmp_path / "profile" / f"{row['model']}_{impl}.txt").read_text()
            assert "Self CPU" in table
    assert all(f["target"] is None for f in report["figures"])  # CPU: no target applies
    assert "| gpt-tiny | ours | 2 x 32 |" in bench_gpu.table(report)


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_gpu.main(["--device", "cpu", "--models", "bert,t5", "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_compiled_ours_runs(tmp_path):
    report = run_tiny(tmp_path)
    assert report["compile"] and report["results"][1]["ours"]["tokens_per_s"] > 0


def test_targets_apply_to_ours_on_cuda_at_the_base_size():
    def row(model, mfu, seq_per_s):
        impl = {"mfu": mfu, "sequences_per_s": seq_per_s}
        return {"model": model, "ours": impl, "hf": {"mfu": mfu / 2, "sequences_per_s": 100.0}}

    report = {
        "device": "cuda:0",
        "size": "base",
        "results": [row("bert-base", 0.30, 3100.0), row("gpt-124m", 0.44, 40.0)],
    }
    figures = {f["name"]: f for f in bench_gpu.figures(report)}
    assert figures["bert-base sequences/s"]["met"] is True
    assert figures["bert-base sequences/s"]["target"] == "ours >= 3000"
    assert figures["gpt-124m MFU"]["met"] is False  # 44% < 45%, though 2x transformers
    assert figures["gpt-124m MFU"]["ratio"] == pytest.approx(2.0)
    assert (
        figures["bert-base MFU"]["met"] is None and figures["gpt-124m sequences/s"]["met"] is None
    )
    report["size"] = "mini"
    assert all(f["met"] is None for f in bench_gpu.figures(report))


def test_figure_targets_on_ours_or_on_the_ratio():
    assert figure("b", "x", 0.5, 0.25, "u", at_least=0.45, target_on="ours")["met"] is True
    assert figure("b", "x", 0.5, 0.25, "u", at_least=2.5)["met"] is False  # ratio 2.0
    with pytest.raises(ValueError, match="target_on"):
        figure("b", "x", 1.0, 1.0, "u", target_on="reference")
