"""A benchmark's result for people (a table), for scripts (JSON) and as a PNG."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tunerd.bench import BenchResult
from tunerd.bench.runner import RunResult

__all__ = ["format_human", "format_json", "plot_missing", "write_png"]


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.4g}"


def _run_name(r: RunResult, per_arm: dict[str, int]) -> str:
    return f"{r.arm} run {per_arm[r.arm]}" + (" (warm-up)" if r.warmup else "")


def format_human(res: BenchResult) -> str:
    c = res.config
    cmp = res.comparison
    better = "higher" if cmp.higher_is_better else "lower"
    lines = [f"workload: {c.workload}"]
    if c.interpreter is not None:
        lines.append(f"python:   {c.interpreter.describe()}")
    lines.append(f"command:  {' '.join(c.command)}")
    if any(s.placement != "unbound" for s in c.arms):
        lines.append(f"placement: tunerctl run with {c.placement.describe()}")
    if c.noisy:
        lines.append(f"noisy:    {c.noisy}-process CPU hog (pid {res.hog_pid}) during both arms")
    what = f"{cmp.metric} ({better} is better)" if cmp.metric is not None else \
        "none, no run measured anything"
    lines.append(f"metric:   {what}; {c.runs} run(s) per arm after {c.warmup} warm-up, "
                 "interleaved A B B A")
    rows = [("arm", "settings", "median", "min", "max", "runs", "failed")]
    for label, spec in zip(("A", "B"), c.arms, strict=True):
        vals = [r.value for r in res.measured(label) if r.ok and r.value is not None]
        n_failed = sum(1 for r in res.runs if r.arm == label and r.error)
        rows.append((label, spec.describe(), _num(statistics.median(vals) if vals else None),
                     _num(min(vals, default=None)), _num(max(vals, default=None)),
                     str(len(vals)), str(n_failed)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if cmp.ratio is not None and cmp.ci is not None:
        lines.append(f"ratio B/A: {cmp.ratio:.3f} (95% interval {cmp.ci[0]:.3f}-{cmp.ci[1]:.3f})")
    elif cmp.ratio is not None:
        lines.append(f"ratio B/A: {cmp.ratio:.3f} (no interval)")
    lines.append(f"verdict: {cmp.verdict}")
    for note in res.notes:
        lines.append(f"note: {note}")
    failed = res.failed()
    if failed:
        lines.append("")
        lines.append(f"failed runs ({len(failed)}):")
        count: dict[str, int] = {"A": 0, "B": 0}
        for r in res.runs:
            count[r.arm] += 1
            if r.error is None:
                continue
            lines.append(f"  {_run_name(r, count)}: {r.error}")
            if r.stderr_tail:
                lines.append("    stderr (last lines):")
                lines += ["      " + ln for ln in r.stderr_tail.splitlines()]
    lines.append(f"elapsed: {res.elapsed_s:.1f} s")
    return "\n".join(lines)


def format_json(res: BenchResult) -> str:
    return json.dumps(res.to_dict(), indent=2, default=str)


def plot_missing() -> str | None:
    """Why --png cannot work here (None when it can)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return ("--png needs matplotlib, which this Python does not have; install the plot "
                "extra: pip install 'tunerd[plot]' (or pip install matplotlib)")
    return None


def write_png(res: BenchResult, path: Path) -> None:
    """Throughput (the metric) of every run, in the order run, one series per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmp = res.comparison
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, spec, marker, colour in (("A", res.config.arms[0], "o", "tab:blue"),
                                        ("B", res.config.arms[1], "s", "tab:orange")):
        ok = [r for r in res.runs if r.arm == label and r.ok and r.value is not None]
        ax.plot([r.index + 1 for r in ok if not r.warmup],
                [float(r.value or 0.0) for r in ok if not r.warmup],
                marker=marker, linestyle="none", color=colour,
                label=f"{label}: {spec.describe()}")
        warm = [r for r in ok if r.warmup]
        if warm:
            ax.plot([r.index + 1 for r in warm], [float(r.value or 0.0) for r in warm],
                    marker=marker,
                    linestyle="none", color=colour, alpha=0.3)
        median = cmp.median_a if label == "A" else cmp.median_b
        if median is not None:
            ax.axhline(median, color=colour, linestyle="--", linewidth=1)
        bad = [r for r in res.runs if r.arm == label and r.error]
        for r in bad:
            ax.axvline(r.index + 1, color=colour, linestyle=":", linewidth=1)
    ax.set_xlabel("run, in the order run (faded: warm-up; dotted line: failed run)")
    better = "higher" if cmp.higher_is_better else "lower"
    ax.set_ylabel(f"{cmp.metric} ({better} is better)" if cmp.metric is not None
                  else "no run measured anything")
    ax.set_title(cmp.verdict if len(cmp.verdict) < 90 else cmp.verdict[:87] + "...",
                 fontsize=9)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
