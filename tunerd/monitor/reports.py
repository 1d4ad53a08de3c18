"""What training processes report about themselves (``tunerd.torch.StepReporter``).

A report arrives over the control socket (command ``report``; the daemon checks
that the peer owns the process) and is kept here per process until that process
sends no report for ``STALE_AFTER`` seconds (so also that long after it exits;
the start time in each report keeps an earlier process's report off a reused
pid). Each sampling cycle attaches the latest report to the job's sample: step
time, samples/s, CUDA memory (or RSS on CPU), DataLoader workers. Nothing is
read from files a user could write: a report is a bounded JSON message,
validated here and only here (:func:`parse_report`); a :class:`Report` is never
changed after that, only replaced by the next one.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from tunerd.base.errors import UsageError

__all__ = ["Report", "ReportStore", "parse_report"]

STALE_AFTER = 120.0  # seconds without a report before a process's last one is dropped
MAX_WORKERS = 1024
MAX_PROCESSES = 4096  # reports kept at most (one per process)


@dataclass(frozen=True)
class Report:
    pid: int
    start_time: int | None  # stat ticks of the process that sent it
    time: float  # when it was received (wall clock)
    steps: int | None = None
    step_time_s: float | None = None
    samples_per_s: float | None = None
    device: str | None = None
    memory: dict[str, int] | None = None
    workers: tuple[int, ...] = ()
    num_workers: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    job: str | None = None  # the training job across nodes (tunerd.torch: job_id())

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "step_time_s": self.step_time_s,
                "samples_per_s": self.samples_per_s, "device": self.device,
                "memory": dict(self.memory or {}), "workers": list(self.workers),
                "num_workers": self.num_workers, "rank": self.rank,
                "local_rank": self.local_rank, "local_world_size": self.local_world_size,
                "job": self.job, "time": self.time}


def _num(args: dict[str, Any], key: str, kind: type, lo: float = 0.0,
         hi: float = float(1 << 62)) -> Any:
    v = args.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"report: {key!r} must be a number, got {v!r}")
    if not math.isfinite(float(v)) or not lo <= v <= hi:
        raise UsageError(f"report: {key!r} out of range: {v!r}")
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise UsageError(f"report: {key!r} must be an integer, got {v!r}")
        return int(v)
    return float(v)


_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/+=-]{0,63}")


def _job_id(v: Any) -> str | None:
    """A job id becomes a Prometheus label: short, and only characters that need no
    escaping anywhere (exposition, PromQL, dashboards, terminals)."""
    if v is None:
        return None
    if not isinstance(v, str) or not _JOB_ID.fullmatch(v):
        raise UsageError(f"report: 'job' must be 1-64 characters of A-Z a-z 0-9 _ . : @ / + = -"
                         f" starting with a letter or digit, got {str(v)[:80]!r}")
    return v


def parse_report(args: dict[str, Any], *, pid: int, start_time: int | None) -> Report:
    """Validate the ``report`` command's arguments (names, types, ranges)."""
    mem = args.get("memory")
    memory: dict[str, int] | None = None
    if mem is not None:
        if not isinstance(mem, dict) or len(mem) > 8:
            raise UsageError("report: 'memory' must be an object of byte counts")
        memory = {}
        for k in ("allocated", "reserved", "max_allocated", "rss"):
            if k in mem:
                memory[k] = _num(mem, k, int)
    device = args.get("device")
    if device is not None and device not in ("cuda", "cpu"):
        raise UsageError(f"report: 'device' must be 'cuda' or 'cpu', got {device!r}")
    workers_raw = args.get("workers") or []
    if not isinstance(workers_raw, list) or len(workers_raw) > MAX_WORKERS or not all(
            isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in workers_raw):
        raise UsageError("report: 'workers' must be a list of process ids")
    return Report(pid=pid, start_time=start_time, time=time.time(),
                  steps=_num(args, "steps", int), step_time_s=_num(args, "step_time_s", float),
                  samples_per_s=_num(args, "samples_per_s", float), device=device,
                  memory=memory, workers=tuple(workers_raw),
                  num_workers=_num(args, "num_workers", int, hi=MAX_WORKERS),
                  rank=_num(args, "rank", int, hi=1 << 30),
                  local_rank=_num(args, "local_rank", int, hi=1 << 20),
                  local_world_size=_num(args, "local_world_size", int, hi=1 << 20),
                  job=_job_id(args.get("job")))


class ReportStore:
    def __init__(self) -> None:
        self._by_pid: dict[int, Report] = {}

    def put(self, report: Report) -> None:
        if report.pid not in self._by_pid and len(self._by_pid) >= MAX_PROCESSES:
            self.expire()
            if len(self._by_pid) >= MAX_PROCESSES:  # drop the oldest
                oldest = min(self._by_pid.values(), key=lambda r: r.time)
                del self._by_pid[oldest.pid]
        self._by_pid[report.pid] = report

    def drop(self, gone: dict[int, Report]) -> None:
        """Forget the reports of processes that ended (unless a newer one came since)."""
        for pid, rep in gone.items():
            if self._by_pid.get(pid) is rep:
                del self._by_pid[pid]

    def expire(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for pid in [p for p, r in self._by_pid.items() if now - r.time > STALE_AFTER]:
            del self._by_pid[pid]

    def snapshot(self) -> dict[int, Report]:
        """pid -> the latest report, for one sampling cycle (reports are replaced, never
        changed, so the sampler's thread may read them while new ones arrive)."""
        self.expire()
        return dict(self._by_pid)
