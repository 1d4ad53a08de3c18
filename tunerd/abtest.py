"""A/B benchmark of a training command: as it is (A) versus placed by tunerd (B).

The tuning guides say: change one thing, measure, keep it only if it helps. This runs
the same command alternately in both arms (A B B A A B ... so slow drift of a shared
machine hits both), discards warm-up runs, and reports medians with a bootstrap
confidence interval of the ratio, so a "speed-up" inside the noise is called noise.

A command may report its own figure of merit by printing a line
``TUNERD_METRIC <name> <value> [higher|lower]`` (e.g. samples/s); otherwise wall time
(lower is better) is used.
"""

from __future__ import annotations

import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

METRIC_RE = re.compile(r"^TUNERD_METRIC\s+(\S+)\s+([-+0-9.eE]+)(?:\s+(higher|lower))?\s*$", re.M)


@dataclass
class Arm:
    name: str
    argv: list[str]
    values: list[float] = field(default_factory=list)
    failures: int = 0


@dataclass
class Outcome:
    metric: str
    higher_is_better: bool
    a: Arm
    b: Arm
    ratio: float  # median(B) / median(A)
    ci: tuple[float, float]
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        def arm(x: Arm) -> dict[str, Any]:
            return {"argv": x.argv, "values": x.values, "failures": x.failures,
                    "median": _median(x.values), "min": min(x.values, default=None),
                    "max": max(x.values, default=None)}

        return {"metric": self.metric, "higher_is_better": self.higher_is_better,
                "a": arm(self.a), "b": arm(self.b), "ratio_b_over_a": self.ratio,
                "ratio_ci95": list(self.ci), "verdict": self.verdict}


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_once(argv: list[str], timeout: float) -> tuple[str, float, bool] | None:
    """Run argv; return (metric, value, higher_is_better) or None if it failed."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-2000:])
        return None
    found = METRIC_RE.findall(p.stdout)
    if found:
        name, value, direction = found[-1]
        return name, float(value), direction != "lower"
    return "wall_seconds", wall, False


def bootstrap_ratio_ci(a: Sequence[float], b: Sequence[float], n: int = 2000,
                       seed: int = 1) -> tuple[float, float]:
    """95% bootstrap interval of median(b)/median(a) (seeded: same data, same answer)."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        ma = statistics.median(rng.choices(a, k=len(a)))
        mb = statistics.median(rng.choices(b, k=len(b)))
        if ma:
            ratios.append(mb / ma)
    ratios.sort()
    if not ratios:
        return (float("nan"), float("nan"))
    return ratios[int(0.025 * (len(ratios) - 1))], ratios[int(0.975 * (len(ratios) - 1))]


def compare(a: Arm, b: Arm, metric: str, higher: bool) -> Outcome:
    ma, mb = _median(a.values), _median(b.values)
    if not ma or mb is None:
        return Outcome(metric, higher, a, b, float("nan"), (float("nan"), float("nan")),
                       "not enough successful runs to compare")
    ratio = mb / ma
    lo, hi = bootstrap_ratio_ci(a.values, b.values)
    better = (lo > 1.0) if higher else (hi < 1.0)
    worse = (hi < 1.0) if higher else (lo > 1.0)
    gain = (ratio - 1.0) if higher else (1.0 - ratio)
    if better:
        verdict = f"B (tunerd placement) is better by {gain * 100:.1f}%"
    elif worse:
        verdict = f"B (tunerd placement) is worse by {-gain * 100:.1f}%"
    else:
        verdict = "no difference beyond the noise (the 95% interval of the ratio contains 1)"
    return Outcome(metric, higher, a, b, ratio, (lo, hi), verdict)


def run_ab(cmd: list[str], tuned_prefix: list[str], runs: int, warmup: int = 1,
           timeout: float = 3600.0, progress: Any = None) -> Outcome:
    a = Arm("A (as is)", list(cmd))
    b = Arm("B (tunerd)", [*tuned_prefix, *cmd])
    metric, higher = "wall_seconds", False
    # ABBA blocks: each arm goes first equally often
    order: list[Arm] = []
    for i in range(warmup + runs):
        order += [a, b] if i % 2 == 0 else [b, a]
    for i, arm in enumerate(order):
        res = run_once(arm.argv, timeout)
        if progress:
            progress(f"{arm.name} run {i // 2 + 1}: "
                     + (f"{res[0]}={res[1]:.4g}" if res else "failed"))
        if i < 2 * warmup:
            continue
        if res is None:
            arm.failures += 1
            continue
        metric, value, higher = res
        arm.values.append(value)
    return compare(a, b, metric, higher)


def format_outcome(o: Outcome) -> str:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    better = "higher" if o.higher_is_better else "lower"
    lines = [f"metric: {o.metric} ({better} is better)",
             f"{'arm':<12} {'median':>10} {'min':>10} {'max':>10} {'runs':>5} {'failed':>6}"]
    for arm in (o.a, o.b):
        lines.append(f"{arm.name:<12} {fmt(_median(arm.values)):>10} "
                     f"{fmt(min(arm.values, default=None)):>10} "
                     f"{fmt(max(arm.values, default=None)):>10} "
                     f"{len(arm.values):>5} {arm.failures:>6}")
    lines.append(f"ratio B/A: {o.ratio:.3f} (95% CI {o.ci[0]:.3f}-{o.ci[1]:.3f})")
    lines.append(f"verdict: {o.verdict}")
    lines.append("B runs: " + shlex.join(o.b.argv))
    return "\n".join(lines)
