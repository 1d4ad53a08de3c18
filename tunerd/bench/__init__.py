"""A/B benchmarks of training: ``tunerctl bench`` and the search of ``tunerctl tune``.

The guides say: change one thing, measure, keep it only if it helps. ``run_bench``
runs one command in two arms (placement and training settings, see ``arms``),
interleaved (``runner``), and compares them with a bootstrap interval (``stats``);
``report`` prints the result as a table, JSON or a PNG. ``workload`` is the built-in
training loop, the guide's example.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.adapters import isolated
from tunerd.bench.arms import ArmSpec, Interpreter, PlacementRequest, tunerctl_prefix
from tunerd.bench.runner import CpuHog, Progress, RunResult, interleave, run_once
from tunerd.bench.stats import Comparison, compare

__all__ = ["BenchConfig", "BenchResult", "builtin_command", "run_bench", "tunerd_on_path"]

# which helper record shows that a setting reached the command
SETTING_RECORD = {"num_workers": "dataloader", "pin_memory": "dataloader",
                  "persistent_workers": "dataloader", "prefetch_factor": "dataloader",
                  "amp": "amp", "compile": "compile"}


@dataclass
class BenchConfig:
    command: list[str]
    workload: str  # what the command is, in words
    arms: tuple[ArmSpec, ArmSpec]
    placement: PlacementRequest = field(default_factory=PlacementRequest)
    interpreter: Interpreter | None = None  # the built-in workload's Python
    runs: int = 5
    warmup: int = 1
    timeout: float = 600.0
    noisy: int = 0  # CPU hog processes during both arms (0: none)
    socket_path: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to every run


@dataclass
class BenchResult:
    config: BenchConfig
    runs: list[RunResult]
    comparison: Comparison
    elapsed_s: float
    hog_pid: int | None = None
    notes: list[str] = field(default_factory=list)

    def measured(self, arm: str) -> list[RunResult]:
        return [r for r in self.runs if r.arm == arm and not r.warmup]

    def failed(self) -> list[RunResult]:
        return [r for r in self.runs if r.error is not None]

    def exit_code(self) -> int:
        """0: every run measured and B/A has a value, with or without a verdict (too few
        runs for an interval still give 0); 1: a run failed or there is no ratio."""
        return 1 if self.failed() or self.comparison.ratio is None else 0

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "workload": c.workload, "command": c.command,
            "python": c.interpreter.to_dict() if c.interpreter else None,
            "arms": {"A": c.arms[0].to_dict(), "B": c.arms[1].to_dict()},
            "placement_request": c.placement.describe(),
            "runs_per_arm": c.runs, "warmup_per_arm": c.warmup,
            "noisy": {"procs": c.noisy, "pid": self.hog_pid} if c.noisy else None,
            "comparison": self.comparison.to_dict(),
            "runs": [r.to_dict() for r in self.runs],
            "failed": len(self.failed()),
            "notes": self.notes, "elapsed_s": round(self.elapsed_s, 3),
        }


def builtin_command(python: str, path_env: Mapping[str, str] | None = None) -> list[str]:
    """The built-in workload in ``python``, isolated (``-I``, tunerd.adapters.isolated): nothing is
    imported from the directory it runs in; ``path_env`` (tunerd_on_path's) says where
    this tunerd is for an interpreter that lacks it."""
    dirs = [d for d in (path_env or {}).get("PYTHONPATH", "").split(os.pathsep) if d]
    return isolated.python_argv(python, "-c", isolated.bootstrap(dirs, "tunerd.bench.workload"))


@contextlib.contextmanager
def tunerd_on_path() -> Iterator[dict[str, str]]:
    """Environment that makes this tunerd importable by another Python: a temporary
    directory holding only a link to this ``tunerd`` package (not this Python's whole
    site-packages, whose other packages may not fit that interpreter)."""
    import tunerd

    with tempfile.TemporaryDirectory(prefix="tunerd-path-") as tmp:
        (Path(tmp) / "tunerd").symlink_to(Path(tunerd.__file__).resolve().parent)
        # only this directory: the caller's own PYTHONPATH is not handed on (isolation)
        yield {"PYTHONPATH": tmp}


def _choose_metric(runs: list[RunResult]) -> tuple[str | None, bool]:
    """The first measured run's metric (None: no run measured anything); later runs that
    measured another are failures."""
    first = next((r for r in runs if r.ok and not r.warmup), None)
    if first is None:
        return None, True
    assert first.metric is not None
    for r in runs:
        if r.ok and r.metric != first.metric:
            r.error = f"measured {r.metric}, while the first run measured {first.metric}"
    return first.metric, first.higher


def _settings_notes(cfg: BenchConfig, runs: list[RunResult]) -> list[str]:
    """Say when an arm's setting never reached the command (it does not use the helpers),
    or reached it with another value."""
    notes = []
    for label, spec in zip(("A", "B"), cfg.arms, strict=True):
        ok = [r for r in runs if r.arm == label and r.error is None]
        if not ok:
            continue
        for key, value in spec.settings.items():
            kind = SETTING_RECORD[key]
            seen = [r.helper(kind) for r in ok]
            if not all(seen):
                notes.append(f"arm {label} sets {key}={value}, but the command did not call "
                             f"tunerd.torch's {kind} helper in every run, so the setting "
                             "did not reach it")
                continue
            used = {str(s.get(key)) for s in seen if s is not None and key in s}
            if used and used != {str(value)}:
                notes.append(f"arm {label} sets {key}={value}, but the runs used "
                             f"{', '.join(sorted(used))}")
    return notes


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Run both arms interleaved and compare them."""
    t0 = time.monotonic()
    runs: list[RunResult] = []
    # the hog runs during every run and is ended whatever happens
    with CpuHog(cfg.noisy) if cfg.noisy else contextlib.nullcontext() as hog:
        hog_pid = hog.pid if hog else None
        prefix = {label: tunerctl_prefix(spec, cfg.placement, cfg.socket_path, hog_pid)
                  for label, spec in zip(("A", "B"), cfg.arms, strict=True)}
        spec_of = dict(zip(("A", "B"), cfg.arms, strict=True))
        schedule = interleave(cfg.runs, cfg.warmup)
        # the helpers in the command talk to the same daemon as the placement does
        base_env = {**cfg.env, **({"TUNERD_SOCKET": cfg.socket_path} if cfg.socket_path else {})}
        if hog_pid is not None:
            base_env["TUNERD_BENCH_HOG"] = str(hog_pid)  # the noisy neighbour, for scripts
        for i, (label, warm) in enumerate(schedule):
            if progress:
                progress(i, len(schedule), None, f"{label} ({spec_of[label].describe()})")
            r = run_once([*prefix[label], *cfg.command], {**base_env, **spec_of[label].env()},
                         cfg.timeout, label, i, warm)
            runs.append(r)
            if progress:
                progress(i + 1, len(schedule), r, "")
    metric, higher = _choose_metric(runs)
    values = {label: [r.value for r in runs if r.arm == label and not r.warmup and r.ok
                      and r.value is not None] for label in ("A", "B")}
    comparison = compare(values["A"], values["B"], metric, higher,
                         cfg.arms[0].describe(), cfg.arms[1].describe())
    return BenchResult(cfg, runs, comparison, time.monotonic() - t0, hog_pid,
                       _settings_notes(cfg, runs))
