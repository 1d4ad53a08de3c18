#!/usr/bin/env python3
"""SIGTERM to exit: tunerd with 10 bound jobs and the metrics endpoint on (issue 12: <= 0.5 s).

Each round starts a real daemon with metrics on a free loopback port (127.0.0.1:0; the
port it got is read from its status), binds 10 sleeping processes, waits for a few
sampling cycles and a /metrics scrape, sends SIGTERM and times until the process has
exited (waitpid), from outside. Baseline in
the same run: an idle asyncio loop that stops on SIGTERM (the interpreter's own
teardown, the floor any Python daemon pays).

Usage: sudo python bench/shutdown.py [--rounds 10] [--jobs 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _leases_common import Daemon

PY = sys.executable
IDLE = ("import asyncio, signal\nasync def main():\n    stop = asyncio.Event()\n"
        "    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)\n"
        "    print('ready', flush=True)\n    await stop.wait()\nasyncio.run(main())\n")


def one_round(jobs: int) -> float:
    kids: list[subprocess.Popen[bytes]] = []
    d: Daemon | None = None
    try:
        d = Daemon('[policy]\nname = "bench"\n', metrics="127.0.0.1:0")
        kids = [subprocess.Popen(["sleep", "600"]) for _ in range(jobs)]
        cpus = sorted(os.sched_getaffinity(0))
        for i, k in enumerate(kids):
            d.bind(k.pid, str(cpus[i % len(cpus)]))
        time.sleep(2.5)
        with urllib.request.urlopen(d.metrics_url(), timeout=5) as resp:
            resp.read()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(30)
        return time.monotonic() - t0
    finally:
        if d is not None:
            d.stop()  # SIGKILL if it did not exit; removes its dirs
        for k in kids:
            k.kill()
            k.wait()


def baseline() -> float:
    p = subprocess.Popen([PY, "-c", IDLE], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    time.sleep(0.2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    tunerd: list[float] = []
    base: list[float] = []
    for i in range(a.rounds):
        tunerd.append(one_round(a.jobs))
        base.append(baseline())
        print(f"round {i + 1}: tunerd {tunerd[-1] * 1000:.0f} ms, idle asyncio loop "
              f"{base[-1] * 1000:.0f} ms", flush=True)
    med_t, med_b = statistics.median(tunerd), statistics.median(base)
    print(f"\nSIGTERM -> exited, {a.rounds} rounds, {a.jobs} jobs bound, metrics on:")
    print(f"  tunerd: median {med_t * 1000:.0f} ms, max {max(tunerd) * 1000:.0f} ms "
          "(target <= 500 ms)")
    print(f"  idle asyncio loop (floor): median {med_b * 1000:.0f} ms")
    print(f"  ratio tunerd / floor: {med_t / med_b:.1f}x")
    if a.json:
        a.json.write_text(json.dumps({"tunerd_s": tunerd, "baseline_s": base}, indent=2))
    return 0 if max(tunerd) <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
