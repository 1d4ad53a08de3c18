"""Running the two arms of a benchmark, interleaved, and reading what each run measured.

Runs alternate in ABBA blocks (A B, B A, A B ...) so that slow drift of a shared
machine hits both arms and each arm goes first equally often; warm-up blocks come
first and are left out. What a run measured, first found wins:

1. the last ``TUNERD_METRIC <name> <value> [higher|lower]`` line of its stdout;
2. the samples/s that ``tunerd.torch.StepReporter`` wrote to ``$TUNERD_BENCH_OUT``
   (summed over the processes that wrote one: the ranks of a DDP job);
3. its wall time (lower is better).

A run that fails keeps its exit code and the tail of its stderr for the report.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tunerd.adapters import isolated
from tunerd.base.procpath import pid_path

__all__ = ["CpuHog", "RunResult", "interleave", "run_once"]

METRIC_RE = re.compile(r"^TUNERD_METRIC\s+(\S+)\s+([-+0-9.eE]+)(?:\s+(higher|lower))?\s*$",
                       re.M)
WORKLOAD_RE = re.compile(r"^TUNERD_WORKLOAD\s+(\{.*\})\s*$", re.M)
STDERR_TAIL_LINES = 12


@dataclass
class RunResult:
    arm: str  # "A" or "B"
    index: int  # position in the schedule
    warmup: bool
    argv: list[str]
    rc: int | None  # None: did not start or timed out
    wall_s: float
    metric: str | None = None
    value: float | None = None
    higher: bool = True
    error: str | None = None
    stderr_tail: str = ""
    workload: dict[str, Any] | None = None
    helpers: list[dict[str, Any]] = field(default_factory=list)  # $TUNERD_BENCH_OUT lines

    @property
    def ok(self) -> bool:
        return self.error is None and self.value is not None

    def helper(self, kind: str) -> dict[str, Any] | None:
        """The first record of ``kind`` ("dataloader", "amp", ...) a helper wrote."""
        return next((h for h in self.helpers if h.get("kind") == kind), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _read_helpers(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def _signal_name(signum: int) -> str:
    """SIGKILL, ...; real-time signals (SIGRTMIN+n) have no member in signal.Signals."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def run_once(argv: list[str], env: dict[str, str], timeout: float, arm: str = "A",
             index: int = 0, warmup: bool = False) -> RunResult:
    """Run ``argv`` with ``env`` added to this environment; never raises."""
    with tempfile.TemporaryDirectory(prefix="tunerd-bench-") as tmp:
        out_file = Path(tmp) / "helpers.jsonl"
        out_file.touch(mode=0o600)
        full_env = {**os.environ, **env, "TUNERD_BENCH_OUT": str(out_file)}
        t0 = time.perf_counter()
        res = RunResult(arm, index, warmup, list(argv), None, 0.0)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                               env=full_env, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            res.error = f"cannot start {argv[0]!r}: command not found"
            return res
        except OSError as err:
            res.error = f"cannot start {argv[0]!r}: {err.strerror or err}"
            return res
        except subprocess.TimeoutExpired as err:
            res.wall_s = time.perf_counter() - t0
            res.error = f"timed out after {timeout:g} s"
            stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) \
                else (err.stderr or "")
            res.stderr_tail = _tail(stderr)
            return res
        res.wall_s = time.perf_counter() - t0
        res.rc = p.returncode
        res.stderr_tail = _tail(p.stderr)
        res.helpers = _read_helpers(out_file)
    found = WORKLOAD_RE.findall(p.stdout)
    if found:
        try:
            res.workload = json.loads(found[-1])
        except ValueError:
            pass
    if p.returncode != 0:
        res.error = f"exit {p.returncode}" if p.returncode > 0 else \
            f"killed by {_signal_name(-p.returncode)}"
        return res
    metrics = METRIC_RE.findall(p.stdout)
    reporters = {h["pid"]: h for h in res.helpers
                 if h.get("kind") == "reporter" and h.get("samples_per_s")}
    if metrics:
        name, value, direction = metrics[-1]
        res.metric, res.value, res.higher = name, float(value), direction != "lower"
    elif reporters:
        res.metric = "samples_per_second"
        res.value = sum(float(h["samples_per_s"]) for h in reporters.values())
    else:
        res.metric, res.value, res.higher = "wall_seconds", res.wall_s, False
    return res


def interleave(runs: int, warmup: int) -> list[tuple[str, bool]]:
    """The schedule: (arm, is_warmup) in ABBA blocks, warm-up blocks first."""
    order: list[tuple[str, bool]] = []
    for i in range(warmup + runs):
        pair = ("A", "B") if i % 2 == 0 else ("B", "A")
        order += [(arm, i < warmup) for arm in pair]
    return order


# the hog: one process per CPU spinning; children die with their parent (PR_SET_PDEATHSIG)
_HOG = """
import ctypes, os, signal, sys
for _ in range(int(sys.argv[1]) - 1):
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        break
while True:
    pass
"""


def _live_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are not zombies."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(pid_path(d, "stat"), "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


class CpuHog:
    """A noisy neighbour: ``procs`` processes spinning on the CPU (one process tree, its
    own session, so one kill of its group ends it)."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> CpuHog:
        self.proc = subprocess.Popen(isolated.python_argv(sys.executable, "-c", _HOG,
                                                          str(self.procs)),
                                     start_new_session=True, stdin=subprocess.DEVNULL,
                                     cwd=isolated.CWD, env=isolated.scrubbed())
        # the first run must already face every hog process, not just the parent
        deadline = time.monotonic() + 10.0
        while len(_live_members(self.proc.pid)) < self.procs and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGKILL)  # the group we created, by its id
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        # the forked children are reaped by init, not by us: return once none is running
        deadline = time.monotonic() + 5.0
        while _live_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self) -> CpuHog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


Progress = Callable[[int, int, RunResult | None, str], None]
