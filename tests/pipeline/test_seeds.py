"""The summary over seeds that the sweep summary and the report share (pipeline/seeds.py)."""

from __future__ import annotations

import pytest

from pipeline.seeds import SeedSummary, summarize_seeds


def test_summary_of_three_seeds():
    # mean 0.6; squared deviations 0.0004 + 0.0064 + 0.0036 = 0.0104, over n - 1 = 2: 0.0052
    summary = summarize_seeds([0.62, 0.52, 0.66])
    assert summary.n == 3
    assert summary.mean == pytest.approx(0.6)
    assert summary.std == pytest.approx(0.0052**0.5)
    assert (summary.median, summary.min, summary.max) == (0.62, 0.52, 0.66)
    assert summary.mean_std(4) == "0.6000 ± 0.0721"
    assert summary.mean_std(3) == "0.600 ± 0.072"


def test_median_of_an_even_number_of_seeds_is_the_middle_pair_mean():
    summary = summarize_seeds(iter([4.0, 1.0, 3.0, 2.0]))
    assert (summary.n, summary.mean, summary.median, summary.min, summary.max) == (
        4,
        2.5,
        2.5,
        1.0,
        4.0,
    )


def test_one_seed_has_no_spread():
    assert summarize_seeds([0.7]) == SeedSummary(
        n=1, mean=0.7, std=0.0, median=0.7, min=0.7, max=0.7
    )
    assert summarize_seeds([0.7]).mean_std(4) == "0.7000"  # no "± 0.0000" for a single seed


def test_no_seeds_is_an_error():
    with pytest.raises(ValueError, match="no scores"):
        summarize_seeds([])
