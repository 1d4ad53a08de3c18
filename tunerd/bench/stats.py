"""Comparing two arms: medians, the ratio B/A and its 95% bootstrap interval.

A winner is named only when the interval excludes 1; anything else is "no difference
beyond the noise". Where no ratio can be computed the comparison says why instead
of printing "nan". With 3 runs per arm the percentile interval is about
[min B / max A, max B / min A], so a winner needs every B run to beat every A run:
few runs can only show large effects.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Comparison", "bootstrap_ratio_ci", "compare"]

BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Comparison:
    metric: str
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


def bootstrap_ratio_ci(a: Sequence[float], b: Sequence[float], n: int = BOOTSTRAP_SAMPLES,
                       seed: int = 1) -> tuple[float, float] | None:
    """95% percentile bootstrap interval of median(b)/median(a), seeded (same data, same
    answer); None when a resampled median of ``a`` is 0."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        ma = statistics.median(rng.choices(a, k=len(a)))
        mb = statistics.median(rng.choices(b, k=len(b)))
        if ma == 0:
            return None
        ratios.append(mb / ma)
    ratios.sort()
    return ratios[int(0.025 * (len(ratios) - 1))], ratios[int(0.975 * (len(ratios) - 1))]


def compare(a: Sequence[float], b: Sequence[float], metric: str, higher: bool,
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
    ci = bootstrap_ratio_ci(a, b)
    if ci is None:
        return no_verdict(f"some runs of {name_a} measured {metric} = 0, so B/A has no "
                          "interval", ratio)
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
