"""Smoke test of bench/bench_data.py on the embedded corpus with tiny models, and its rows of
JSON Lines shards built by `make prepare` in processes of their own."""

from __future__ import annotations

import gzip
import json
import resource

import pytest

from bench import bench_data
from bench.common import BenchError
from datamodules.corpora.corpus import EmbeddedCorpus


def write_shards(folder, documents, count):
    """`documents` as `count` gzipped JSON Lines shards, one record per document."""
    folder.mkdir()
    for i in range(count):
        with gzip.open(folder / f"train-{i}.jsonl.gz", "wt") as shard:
            for document in documents[i::count]:
                shard.write(json.dumps({"text": document}) + "\n")
    return str(folder / "train-*.jsonl.gz")


def test_tiny_run_reports_store_loader_and_model_rates(tmp_path):
    documents = list(EmbeddedCorpus().documents())
    shards = write_shards(tmp_path / "shards", documents, 2)
    # --parallel-mb 0.1: the 1- and 2-process builds run on the corpus written once to files
    # (0.4 MB), not repeated to the default 100 MB, which took minutes and is checked no
    # further here than its rows being there.
    report = bench_data.main(
        [
            "--corpus", "embedded", "--size", "tiny", "--reps", "1", "--batches", "3",
            "--model-steps", "1", "--vocab-size", "500", "--device", "cpu",
            "--parallel-mb", "0.1", "--out", str(tmp_path / "data.json"), "--shards", shards,
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
        # the shards: one build per process count, each the whole text in its own process
        built = row["shards"]
        assert built["documents"] == len(documents) and built["files"] == 2
        assert built["text_mb"] == pytest.approx(sum(len(d.encode()) for d in documents) / 1e6)
        # the second build ran 2 tokenizing processes (its log says so), not one
        assert [b["processes"] for b in built["builds"]] == [1, 2]
        # a fresh process's peak: above an interpreter's, below this test process's own
        own_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        assert all(50 < b["peak_rss_mb"] < own_mb for b in built["builds"]), own_mb
        assert [r["workers"] for r in built["streaming"]] == [0, 2]
        on_shards = figures[f"{name} streaming loader on the shards batches/s vs model steps/s"]
        assert on_shards["ratio"] == pytest.approx(built["streaming_vs_model_steps"])
    assert "| bert |" in bench_data.table(report)
    assert "make prepare, 1 process" in bench_data.table(report)


def test_a_missing_corpus_file_is_one_clear_error(tmp_path):
    with pytest.raises(BenchError, match="no such file"):
        bench_data.load_corpus(str(tmp_path / "missing.txt"))


def test_shards_that_match_nothing_are_one_clear_error(tmp_path):
    with pytest.raises(BenchError, match="--shards .*none"):
        bench_data.read_shards(str(tmp_path / "nothing-*.jsonl.gz"))
