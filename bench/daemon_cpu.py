#!/usr/bin/env python3
"""Whole-daemon CPU per second, measured from outside: every thread's schedstat.

Issue 9's budget: <= 3 ms of CPU per second for the whole tunerd process with 10
bound jobs, 2,000 other processes and the metrics endpoint on. CPU is read from
/proc/PID/task/*/schedstat (nanoseconds on the CPU, per thread: the event loop,
the sampler, the metrics HTTP thread and any other), before and after a window,
so nothing the daemon does is left out and nothing depends on its own counters.

In the same run, for comparison:
  * baseline: the same daemon with no job, metrics off, nothing else running;
  * loaded: 10 bound jobs (python, 4 threads, 32 MiB), 2,000 sleeping processes,
    metrics on a loopback port scraped every 15 s (a Prometheus default);
  * reference: an idle asyncio loop with a 1 s timer, the floor any daemon pays.

Usage: sudo python bench/daemon_cpu.py [--window 30] [--procs 2000] [--jobs 10]
       [--scrape 15] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
JOB = ("import threading, time\nbuf = bytearray(32 << 20)\n"
       "for i in range(0, len(buf), 4096): buf[i] = 1\n"
       "for _ in range(3): threading.Thread(target=time.sleep, args=(3600,), daemon=True)"
       ".start()\nprint('ready', flush=True)\ntime.sleep(3600)\n")
IDLE_LOOP = ("import asyncio\nasync def main():\n    while True:\n        await asyncio.sleep(1)\n"
             "asyncio.run(main())\n")


def task_ns(pid: int) -> int:
    """CPU nanoseconds of every live thread of ``pid`` (field 1 of each task's schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def window(pid: int, seconds: float, scrape: str | None, every: float) -> float:
    """ms of CPU per second the process used over ``seconds`` (threads born meanwhile
    counted from 0; the rare thread that ended meanwhile is missed)."""
    a = task_ns(pid)
    t0 = time.monotonic()
    next_scrape = t0
    while True:
        now = time.monotonic()
        if now - t0 >= seconds:
            break
        if scrape and now >= next_scrape:
            with urllib.request.urlopen(scrape, timeout=5) as r:
                r.read()
            next_scrape += every
        time.sleep(min(0.2, max(0.0, t0 + seconds - now)))
    return (task_ns(pid) - a) / 1e6 / (time.monotonic() - t0)


class Daemon:
    def __init__(self, tmp: Path, metrics: str) -> None:
        (tmp / "pol").mkdir(parents=True, exist_ok=True)
        (tmp / "pol" / "00.toml").write_text('[policy]\nname = "bench"\n')
        self.sock = tmp / "run" / "tunerd.sock"
        self.proc = subprocess.Popen(
            [PY, "-m", "tunerd.daemon.main", "--policy-dir", str(tmp / "pol"),
             "--runtime-dir", str(tmp / "run"), "--state-dir", str(tmp / "state"),
             "--metrics-listen", metrics, "--log-level", "warning"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(400):
            if self.ctl("status").returncode in (0, 1):
                return
            time.sleep(0.05)
        raise SystemExit("tunerd did not start")

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PY, "-m", "tunerd.cli.main", "--socket", str(self.sock), *args],
                              cwd=REPO, capture_output=True, text=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--procs", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--scrape", type=float, default=15.0, help="seconds between scrapes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the daemon binds the jobs")
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-bench-cpu-"))
    started: list[subprocess.Popen[Any]] = []
    result: dict[str, Any] = {"window_s": a.window, "procs": a.procs, "jobs": a.jobs,
                              "scrape_s": a.scrape, "rounds": []}
    try:
        ref = subprocess.Popen([PY, "-c", IDLE_LOOP])
        started.append(ref)
        base = Daemon(tmp / "base", "off")
        time.sleep(3)
        port = free_port()
        loaded = Daemon(tmp / "loaded", f"127.0.0.1:{port}")
        # 2,000 other processes and 10 jobs, bound by the loaded daemon only
        for _ in range(a.procs):
            started.append(subprocess.Popen(["sleep", "3600"]))
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(a.jobs):
            p = subprocess.Popen([PY, "-c", JOB], stdout=subprocess.PIPE, text=True)
            started.append(p)
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
            r = loaded.ctl("bind", str(p.pid), "--cpus", str(cpus[i % len(cpus)]))
            if r.returncode != 0:
                raise SystemExit(f"bind failed: {r.stderr}")
        time.sleep(12)  # a slow cycle (numa_maps, threads) for every job has run
        url = f"http://127.0.0.1:{port}/metrics"
        for n in range(a.rounds):
            row = {"loaded_ms_per_s": window(loaded.proc.pid, a.window, url, a.scrape),
                   "baseline_ms_per_s": window(base.proc.pid, a.window / 3, None, 0),
                   "reference_ms_per_s": window(ref.pid, a.window / 3, None, 0)}
            result["rounds"].append(row)
            print(f"round {n + 1}: loaded {row['loaded_ms_per_s']:.2f} ms/s, "
                  f"idle daemon {row['baseline_ms_per_s']:.2f} ms/s, "
                  f"idle asyncio loop {row['reference_ms_per_s']:.2f} ms/s", flush=True)
        med = {k: statistics.median(r[k] for r in result["rounds"])
               for k in result["rounds"][0]}
        result["median"] = med
        print(f"\nwhole-daemon CPU, median of {a.rounds} rounds:")
        print(f"  {a.jobs} jobs + {a.procs} processes + metrics scraped every {a.scrape:g} s: "
              f"{med['loaded_ms_per_s']:.2f} ms/s (budget 3)")
        print(f"  idle daemon (no job, metrics off): {med['baseline_ms_per_s']:.2f} ms/s")
        print(f"  idle asyncio loop (floor):         {med['reference_ms_per_s']:.2f} ms/s")
        print(f"  loaded / idle daemon: {med['loaded_ms_per_s'] / med['baseline_ms_per_s']:.2f}x")
        base.stop()
        loaded.stop()
    finally:
        for p in started:
            p.kill()
        for p in started:
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
