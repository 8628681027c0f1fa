"""Smoke test of bench/bench_finetune.py on RTE with BERT tiny: the report's schema, the tokens
each way reads and the comparison of scores, not the speed."""

from __future__ import annotations

import json

import pytest

from bench import bench_finetune
from bench.common import BenchError


def test_quick_run_times_both_ways_on_the_same_batches_and_compares_scores(shared_data, tmp_path):
    out = tmp_path / "finetune.json"
    args = ["--quick", "--size", "tiny", "--vocab-size", "500", "--threads", "1"]
    report = bench_finetune.main([*args, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    [row] = report["results"]
    assert row["task"] == "rte" and row["steps"] == 3
    for way in ("sides", "whole"):
        assert len(row["seconds_per_step"][way]) == 1 and row["median_s"][way] > 0
    # counted as the backbone reads them: all 64 rows at the batch's width (RTE's longest
    # premise fills 128 tokens), or each side at its own width, the short hypotheses' less
    assert row["tokens_per_step"]["whole"] == 64 * 128
    assert row["tokens_per_step"]["sides"] < 0.8 * row["tokens_per_step"]["whole"]
    assert row["speedup"] == pytest.approx(row["median_s"]["whole"] / row["median_s"]["sides"])
    assert row["dev_pairs_compared"] == 64 and row["max_score_difference"] < 1e-4
    [speed] = report["figures"]
    assert speed["ratio"] == pytest.approx(row["speedup"])


def test_the_reference_way_is_undone_after_its_block():
    ours = bench_finetune.models.heads.encode_pair_sides
    with bench_finetune.reading("whole"):
        assert bench_finetune.models.heads.encode_pair_sides is bench_finetune.whole_batch
    assert bench_finetune.models.heads.encode_pair_sides is ours


def test_a_task_of_one_text_is_refused_with_the_fix(shared_data, tmp_path):
    with pytest.raises(BenchError, match="one text column.*--task rte"):
        bench_finetune.main(["--quick", "--task", "sst2", "--out", str(tmp_path / "f.json")])
