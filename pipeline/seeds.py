"""One summary of a score over seeds, shared by the sweep summary (pipeline/sweep.py: median and
spread) and the report (pipeline/report: mean ± standard deviation)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SeedSummary:
    """A score over the seeds of one setting.

    Attributes:
        n: how many seeds.
        mean: their arithmetic mean.
        std: their sample standard deviation; 0.0 for one seed, which has no spread to estimate.
        median: their median.
        min: the lowest score.
        max: the highest score.
    """

    n: int
    mean: float
    std: float
    median: float
    min: float
    max: float

    def mean_std(self, digits: int) -> str:
        """The mean ± the standard deviation as the report shows them, e.g. "0.9100 ± 0.0141"
        for 4 `digits`; the mean alone for one seed."""
        spread = f" ± {self.std:.{digits}f}" if self.n > 1 else ""
        return f"{self.mean:.{digits}f}{spread}"


def summarize_seeds(values: Iterable[float]) -> SeedSummary:
    """The summary of one score per seed.

    Raises:
        ValueError: no values.
    """
    values = list(values)
    if not values:
        raise ValueError("no scores to summarize over seeds")
    return SeedSummary(
        n=len(values),
        mean=statistics.fmean(values),
        std=statistics.stdev(values) if len(values) > 1 else 0.0,
        median=statistics.median(values),
        min=min(values),
        max=max(values),
    )
