"""Smoke test of bench/bench_data.py on the embedded corpus with tiny models."""

from __future__ import annotations

import pytest

from bench import bench_data
from bench.common import BenchError


def test_tiny_run_reports_store_loader_and_model_rates(tmp_path):
    # --parallel-mb 0.1: the 1- and 2-process builds run on the corpus written once to files
    # (0.4 MB), not repeated to the default 100 MB, which took minutes and is checked no
    # further here than its rows being there.
    report = bench_data.main(
        [
            "--corpus", "embedded", "--size", "tiny", "--reps", "1", "--batches", "3",
            "--model-steps", "1", "--vocab-size", "500", "--device", "cpu",
            "--parallel-mb", "0.1", "--out", str(tmp_path / "data.json"),
        ]
    )  # fmt: skip
    assert set(report["results"]) == {"bert", "gpt"}
    figures = {f["name"]: f for f in report["figures"]}
    for name, row in report["results"].items():
        rates = row["store"]["mb_per_s"]
        assert all(rates[k] > 0 for k in ("encode_batch", "encode_batch_fast", "store"))
        assert rates["files_1_process"] > 0 and rates["files_2_processes"] > 0
        assert row["store"]["tokens"] > 0 and row["store"]["documents"] > 0
        assert [r["workers"] for r in row["loader"]] == [0, 2]
        assert row["mini_model"]["steps_per_s"] > 0
        store = figures[f"{name} token store vs encode_batch"]
        assert store["ratio"] == pytest.approx(rates["store"] / rates["encode_batch"])
        assert store["met"] == (store["ratio"] >= 0.70)
        loader = figures[f"{name} loader batches/s vs model steps/s"]
        assert loader["ratio"] == pytest.approx(row["loader_vs_model_steps"])
        assert loader["met"] == (loader["ratio"] >= 20)
    assert "| bert |" in bench_data.table(report)


def test_a_missing_corpus_file_is_one_clear_error(tmp_path):
    with pytest.raises(BenchError, match="no such file"):
        bench_data.load_corpus(str(tmp_path / "missing.txt"))
