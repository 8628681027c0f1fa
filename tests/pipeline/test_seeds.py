"""The summary over seeds that the sweep summary and the report share (pipeline/suites/seeds.py)."""

from __future__ import annotations

import json

import pytest

from pipeline.suites.seeds import (
    PairedDifference,
    SeedSummary,
    paired_difference,
    summarize_seeds,
    t_quantile,
)


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


@pytest.mark.parametrize(
    ("df", "quantile"),  # two-sided 95% critical values of Student's t, from any t table
    [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)],
)
def test_t_quantile_matches_the_table(df, quantile):
    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-3)


def test_t_quantile_tends_to_the_normal_one():
    assert t_quantile(0.975, 100_000) == pytest.approx(1.95996, abs=1e-3)
    assert t_quantile(0.95, 100_000) == pytest.approx(1.64485, abs=1e-3)


def test_paired_difference_pairs_by_seed():
    # per-seed differences 0.10, 0.05, 0.06 (seed 4 has no partner and is left out):
    # mean 0.07, sample sd 0.0264575, half width 4.303 * sd / sqrt(3)
    diff = paired_difference({1: 0.80, 2: 0.70, 3: 0.76, 4: 0.99}, {3: 0.70, 1: 0.70, 2: 0.65})
    half = 4.3027 * 0.0264575 / 3**0.5
    assert diff.n == 3
    assert diff.mean == pytest.approx(0.07)
    assert (diff.low, diff.high) == (
        pytest.approx(0.07 - half, abs=1e-4),
        pytest.approx(0.07 + half, abs=1e-4),
    )
    assert diff.excludes_zero


def test_paired_difference_of_one_seed_has_no_interval():
    diff = paired_difference({1: 0.8}, {1: 0.6})
    assert (diff.n, diff.low, diff.high, diff.excludes_zero) == (1, None, None, False)
    assert diff.mean == pytest.approx(0.2)
    with pytest.raises(ValueError, match="no seed in common"):
        paired_difference({1: 0.8}, {2: 0.6})


def test_paired_difference_as_text_and_through_json():
    diff = paired_difference({1: 3.0, 2: 5.0, 3: 4.0}, {1: 1.0, 2: 1.0, 3: 1.0})
    # differences 2, 4, 3: mean 3, sd 1, half width 4.3027 / sqrt(3) = 2.484
    assert diff.text() == "+3.0 [+0.5, +5.5]"
    assert diff.text(2) == "+3.00 [+0.52, +5.48]"
    assert paired_difference({1: 0.5}, {1: 0.75}).text(3) == "-0.250"
    written = json.loads(json.dumps(diff.to_dict()))
    assert written["excludes_zero"] is True
    assert PairedDifference.from_dict(written) == diff
