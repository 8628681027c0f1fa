"""One summary of a score over seeds, shared by the sweep summary (pipeline/suites/sweep.py: median and
spread) and the report (pipeline/report: mean ± standard deviation)."""

from __future__ import annotations

import dataclasses
import math
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


@dataclass(frozen=True)
class PairedDifference:
    """The mean difference of two settings run with the same seeds, and its confidence
    interval (Student's t over the per-seed differences).

    Attributes:
        n: how many seeds both settings have.
        mean: the mean of (a - b) over those seeds.
        low: the lower end of the interval; None with fewer than two seeds.
        high: the upper end; None with fewer than two seeds.
        level: the interval's confidence level.
    """

    n: int
    mean: float
    low: float | None
    high: float | None
    level: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of zero (False without an interval)."""
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def text(self, digits: int = 1) -> str:
        """`+1.9 [-1.8, +5.5]`: the mean and its interval (the mean alone without one)."""
        if self.low is None or self.high is None:
            return f"{self.mean:+.{digits}f}"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"

    def to_dict(self) -> dict:
        """The fields, and whether the interval excludes zero (for a JSON report)."""
        return {**dataclasses.asdict(self), "excludes_zero": self.excludes_zero}

    @classmethod
    def from_dict(cls, fields: dict) -> PairedDifference:
        """The difference that `to_dict` wrote."""
        return cls(**{field.name: fields[field.name] for field in dataclasses.fields(cls)})


def paired_difference(
    a: dict[int, float], b: dict[int, float], level: float = 0.95
) -> PairedDifference:
    """a - b over the seeds both have (seed -> score), with a `level` t interval.

    Raises:
        ValueError: no seed in common.
    """
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no seed in common: a paired difference needs runs of the same seeds")
    diffs = [a[s] - b[s] for s in seeds]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return PairedDifference(1, mean, None, None, level)
    half = t_quantile(0.5 + level / 2, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return PairedDifference(len(diffs), mean, mean - half, mean + half, level)


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t distribution with `df` degrees of freedom (p > 0.5),
    by bisection on its distribution function (Simpson's rule on the density)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    def upper_half(x: float, steps: int = 2000) -> float:  # P(0 < T < x)
        h = x / steps
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
        return h / 3 * (density(0.0) + inner + density(x))

    low, high = 0.0, 1.0
    while 0.5 + upper_half(high) < p:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if 0.5 + upper_half(mid) < p else (low, mid)
    return (low + high) / 2
