"""Smoke test of bench/bench_blimp.py on two phenomena: the report's schema and the comparison
of answers, not the speed."""

from __future__ import annotations

import json

import pytest

from bench import bench_blimp
from bench.common import BenchError


def test_quick_run_times_both_scorers_and_compares_their_answers(shared_data, tmp_path):
    out = tmp_path / "blimp.json"
    args = ["--quick", "--sizes", "tiny", "--vocab-size", "500"]
    phenomena = ["--phenomena", "anaphor_gender_agreement,wh_island"]
    # HEAD's scorer stands in for the old one: any clone has it, a shallow one too
    report = bench_blimp.main([*args, *phenomena, "--against", "HEAD", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    [row] = report["results"]
    assert row["model"] == "bert-tiny" and row["sentences"] == 8
    for side in ("ours", "reference"):
        assert len(row[side]["wall_s"]) == 1 and row[side]["sentences_per_s"] > 0
    assert row["speedup"] == pytest.approx(row["reference"]["median_s"] / row["ours"]["median_s"])
    assert row["answers_differing"] == 0 and row["max_score_difference"] < 1e-4
    speed, answers = report["figures"]
    assert speed["ratio"] == pytest.approx(row["speedup"]) and speed["target"] == ">= 3"
    assert answers["ours"] == 0 and answers["met"] is True


def test_a_revision_without_the_scorer_is_named_with_the_fix():
    with pytest.raises(BenchError, match="at git revision no-such-rev .*--against REV"):
        bench_blimp.reference_scorer("no-such-rev")
