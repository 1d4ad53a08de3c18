#!/usr/bin/env python3
"""SIGTERM to exit: tunerd with 10 bound jobs and the metrics endpoint on (issue 12: <= 0.5 s).

Each round starts a real daemon with metrics on a free loopback port, binds 10
sleeping processes, waits for a few sampling cycles and a /metrics scrape, sends
SIGTERM and times until the process has exited (waitpid), from outside. Baseline in
the same run: an idle asyncio loop that stops on SIGTERM (the interpreter's own
teardown, the floor any Python daemon pays).

Usage: sudo python bench/shutdown.py [--rounds 10] [--jobs 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
IDLE = ("import asyncio, signal\nasync def main():\n    stop = asyncio.Event()\n"
        "    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)\n"
        "    print('ready', flush=True)\n    await stop.wait()\nasyncio.run(main())\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ctl(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "tunerd.cli.main", "--socket", str(sock), *args],
                          cwd=REPO, capture_output=True, text=True)


def one_round(tmp: Path, jobs: int) -> float:
    (tmp / "pol").mkdir(parents=True)
    (tmp / "pol" / "00.toml").write_text('[policy]\nname = "bench"\n')
    sock = tmp / "run" / "tunerd.sock"
    port = free_port()
    d = subprocess.Popen([PY, "-m", "tunerd.daemon.main", "--policy-dir", str(tmp / "pol"),
                          "--runtime-dir", str(tmp / "run"), "--state-dir", str(tmp / "state"),
                          "--metrics-listen", f"127.0.0.1:{port}", "--log-level", "warning"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids = [subprocess.Popen(["sleep", "600"]) for _ in range(jobs)]
    try:
        for _ in range(400):
            if ctl(sock, "status").returncode in (0, 1):
                break
            time.sleep(0.05)
        cpus = sorted(os.sched_getaffinity(0))
        for i, k in enumerate(kids):
            r = ctl(sock, "bind", str(k.pid), "--cpus", str(cpus[i % len(cpus)]))
            if r.returncode != 0:
                raise SystemExit(f"bind failed: {r.stderr}")
        time.sleep(2.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            resp.read()
        t0 = time.monotonic()
        d.send_signal(signal.SIGTERM)
        d.wait(30)
        return time.monotonic() - t0
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
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
    root = Path(tempfile.mkdtemp(prefix="tunerd-bench-stop-"))
    root.chmod(0o755)
    try:
        for i in range(a.rounds):
            tunerd.append(one_round(root / str(i), a.jobs))
            base.append(baseline())
            print(f"round {i + 1}: tunerd {tunerd[-1] * 1000:.0f} ms, idle asyncio loop "
                  f"{base[-1] * 1000:.0f} ms", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
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
