"""Comparing two arms: medians, the ratio B/A and a 95% interval for it.

A winner is named only when the interval excludes 1; anything else is "no difference
beyond the noise". Where no ratio or interval can be computed the comparison says why
instead of printing "nan".

The interval is the distribution-free one that goes with the Mann-Whitney test
(Hodges-Lehmann): of the ratios b_j / a_i of every pair of runs, sorted, the k-th
smallest and the k-th largest, k from the exact distribution of the Mann-Whitney U
statistic. Its 95% holds for any distribution of run times as long as the arms differ
by a factor, and it is honest about small samples where a bootstrap is not: with 3
runs per arm no split of the runs is rare enough for 95% (the rarest, every B above
every A, happens 1 time in 20 by chance; two-sided 1 in 10), so bench says that 3
runs are too few instead of naming a winner. With 4 runs per arm a winner needs every
B run to beat every A run; with 5 or more it tolerates some overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

__all__ = ["Comparison", "compare", "min_runs_for_interval", "ratio_interval"]

CONFIDENCE = 0.95
EXACT_MAX_PAIRS = 400  # more pairs (over 20 runs per arm): normal approximation of U


@dataclass(frozen=True)
class Comparison:
    metric: str | None  # None: no run measured anything
    higher_is_better: bool
    median_a: float | None
    median_b: float | None
    ratio: float | None  # median(B) / median(A)
    ci: tuple[float, float] | None  # 95% interval of the ratio
    winner: str | None  # "A", "B", or None
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci"] = list(self.ci) if self.ci else None
        return d


@cache
def _u_counts(n: int, m: int) -> tuple[int, ...]:
    """How many of the C(n+m, n) orderings of two samples give U = 0, 1, ..., n*m."""
    if n == 0 or m == 0:
        return (1,)
    # the largest value is either from the first sample (adds m to U) or from the second
    a = _u_counts(n - 1, m)
    b = _u_counts(n, m - 1)
    out = [0] * (n * m + 1)
    for u, c in enumerate(a):
        out[u + m] += c
    for u, c in enumerate(b):
        out[u] += c
    return tuple(out)


def _rank(n: int, m: int, alpha: float) -> int | None:
    """The largest c with P(U <= c) <= alpha/2: the interval is the (c+1)-th smallest and
    largest pairwise ratio. None when even U = 0 is too likely (too few runs)."""
    if n * m <= EXACT_MAX_PAIRS:
        counts = _u_counts(n, m)
        total = math.comb(n + m, n)
        acc, c = 0, None
        for u, k in enumerate(counts):
            acc += k
            if acc / total > alpha / 2:
                break
            c = u
        return c
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    c = math.floor(n * m / 2 - z * math.sqrt(n * m * (n + m + 1) / 12)) - 1
    return c if c >= 0 else None


def min_runs_for_interval(alpha: float = 1 - CONFIDENCE) -> int:
    """The fewest runs per arm (both arms equal) that can give an interval."""
    n = 2
    while _rank(n, n, alpha) is None:
        n += 1
    return n


def ratio_interval(a: Sequence[float], b: Sequence[float],
                   confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The interval of B/A described in the module doc; None when there are too few runs
    for it, or a value is not positive (a ratio needs positive values)."""
    if not a or not b or min(a) <= 0 or min(b) <= 0:
        return None
    c = _rank(len(a), len(b), 1 - confidence)
    if c is None:
        return None
    ratios = sorted(y / x for x in a for y in b)
    return ratios[c], ratios[len(ratios) - 1 - c]


def compare(a: Sequence[float], b: Sequence[float], metric: str | None, higher: bool,
            name_a: str = "A", name_b: str = "B") -> Comparison:
    """Compare arm B to arm A on ``metric`` (``higher``: higher values are better)."""
    ma = statistics.median(a) if a else None
    mb = statistics.median(b) if b else None

    def no_verdict(reason: str, ratio: float | None = None) -> Comparison:
        return Comparison(metric, higher, ma, mb, ratio, None, None, f"no verdict: {reason}")

    for name, vals in ((name_a, a), (name_b, b)):
        if len(vals) < 2:
            ok = f"{len(vals)} successful run" + ("" if len(vals) == 1 else "s")
            return no_verdict(f"{name} has {ok}; an interval needs at least 2 per arm",
                              None if not ma or mb is None else mb / ma)
    assert ma is not None and mb is not None
    if ma == 0:
        return no_verdict(f"the median {metric} of {name_a} is 0, so B/A has no value")
    ratio = mb / ma
    if min(a) <= 0 or min(b) <= 0:
        return no_verdict(f"some runs measured {metric} <= 0, and a ratio interval needs "
                          "positive values", ratio)
    ci = ratio_interval(a, b)
    if ci is None:
        return no_verdict(f"{len(a)} and {len(b)} runs are too few for a 95% interval (at "
                          f"least {min_runs_for_interval()} per arm)", ratio)
    lo, hi = ci
    span = f"95% interval of B/A {lo:.3f}-{hi:.3f}"
    change = abs(ratio - 1.0) * 100
    direction = "higher" if ratio > 1 else "lower"
    if lo > 1.0 or hi < 1.0:
        b_wins = (lo > 1.0) == higher
        winner = "B" if b_wins else "A"
        wname = name_b if b_wins else name_a
        verdict = (f"{winner} ({wname}) is better: B's {metric} is {change:.1f}% {direction} "
                   f"({span}, excludes 1)")
    else:
        winner = None
        verdict = f"no difference beyond the noise ({span} contains 1)"
    return Comparison(metric, higher, ma, mb, ratio, (lo, hi), winner, verdict)
