#!/usr/bin/env python3
"""Daemon CPU per new bind and per idle second, with 20 and with 620 bound processes.

Issue 15's cost target: with 620 bound processes the whole daemon spends <= 2.5 ms of
CPU per new bind and <= 10 ms/s idle, as it does with 20. Measured from outside:
utime + stime of /proc/PID/stat (all threads, clock-tick resolution) and, finer, the
schedstat nanoseconds of the threads alive at both reads.

One run holds both sizes, each on its own fresh daemon (RUNTIME_DIR on /dev/shm,
tmpfs as /run is; --disk puts it on the disk): N ``sleep`` processes are bound with
``tunerctl bind PID --cpus C`` through the client library, then

  * per bind: the daemon's CPU over ``--binds`` further new binds, divided by them;
  * idle: the daemon's CPU per second over ``--window`` seconds with nothing asked;
  * spaced (``--spaced GAP``): ``--binds`` more new binds, one every GAP seconds, so that
    each bind's deferred save (0.5 s after it) falls inside its own gap: the daemon's CPU
    per bind with everything it writes for it (the idle CPU of the gap taken off), and
    the state.json writes per bind (each write is a new file renamed over it: a new
    inode, polled every 2 ms through the gap).

Baseline in the same run: the same with 20 bindings. Prints medians over
``--rounds`` rounds and the ratios 620/20. Root only (the daemon binds the jobs).

    sudo python bench/many_bindings.py [--n 620] [--base 20] [--binds 50]
                                       [--window 20] [--rounds 3] [--spaced 0.8]
                                       [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _leases_common import Daemon, cpu_seconds, task_ns, write_json

POLICY = '[policy]\nname = "bench"\n'


def cpu_ms(pid: int) -> tuple[float, float]:
    return cpu_seconds(pid) * 1e3, task_ns(pid) / 1e6


def inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return 0


def spaced_binds(c: Any, d: Daemon, procs: list[subprocess.Popen[bytes]], gap: float,
                 idle_ms_per_s: float) -> dict[str, float]:
    """One bind every ``gap`` seconds: daemon CPU per bind over its gap (less the idle
    CPU of the gap) and the state.json writes each one made (new inodes seen)."""
    cpus = sorted(os.sched_getaffinity(0))
    state = d.tmp / "run" / "state.json"
    writes = 0
    t_start = time.monotonic()
    s0, l0 = cpu_ms(d.pid)
    for i, p in enumerate(procs):
        seen = inode(state)
        t0 = time.monotonic()
        c.call("bind", pid=p.pid, cpus=str(cpus[i % len(cpus)]))
        while time.monotonic() - t0 < gap:
            now = inode(state)
            if now != seen:
                writes += 1
                seen = now
            time.sleep(0.002)
    s1, l1 = cpu_ms(d.pid)
    span = time.monotonic() - t_start
    n = len(procs)
    return {"spaced_bind_ms": (s1 - s0 - idle_ms_per_s * span) / n,
            "spaced_bind_live_ms": (l1 - l0 - idle_ms_per_s * span) / n,
            "writes_per_bind": writes / n}


def one_size(n: int, binds: int, window: float, root: Path | None,
             gap: float = 0.0) -> dict[str, float]:
    cpus = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen[bytes]] = []
    d = Daemon(POLICY, root=root)
    try:
        from tunerd.wire.client import Client

        for _ in range(n + binds * (2 if gap else 1)):
            procs.append(subprocess.Popen(["sleep", "3600"]))
        with Client(str(d.socket)) as c:
            for i, p in enumerate(procs[:n]):
                c.call("bind", pid=p.pid, cpus=str(cpus[i % len(cpus)]))
            time.sleep(2)  # deferred saves and the pid watch settled
            s0, l0 = cpu_ms(d.pid)
            for i, p in enumerate(procs[n:n + binds]):
                c.call("bind", pid=p.pid, cpus=str(cpus[i % len(cpus)]))
            s1, l1 = cpu_ms(d.pid)
        time.sleep(2)
        size = os.path.getsize(d.tmp / "run" / "state.json") if (
            d.tmp / "run" / "state.json").exists() else 0
        runtime_bytes = sum(f.stat().st_size for f in (d.tmp / "run").iterdir()
                            if f.is_file() and f.name.startswith("state"))
        i0, k0 = cpu_ms(d.pid)
        t0 = time.monotonic()
        time.sleep(window)
        i1, k1 = cpu_ms(d.pid)
        span = time.monotonic() - t0
        out = {"bind_ms": (s1 - s0) / binds, "bind_live_ms": (l1 - l0) / binds,
               "idle_ms_per_s": (i1 - i0) / span, "idle_live_ms_per_s": (k1 - k0) / span,
               "state_json_bytes": size, "runtime_state_bytes": runtime_bytes}
        if gap:
            with Client(str(d.socket)) as c:
                out.update(spaced_binds(c, d, procs[n + binds:], gap,
                                        out["idle_live_ms_per_s"]))
        return out
    finally:
        d.stop()
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=620)
    ap.add_argument("--base", type=int, default=20)
    ap.add_argument("--binds", type=int, default=50)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk", action="store_true", help="runtime dir on the disk, not tmpfs")
    ap.add_argument("--spaced", type=float, default=0.0, metavar="GAP",
                    help="also --binds binds GAP s apart (> 0.5: each with its deferred save)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the daemon binds the jobs")
    root = None if a.disk else Path("/dev/shm")
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        row = {"base": one_size(a.base, a.binds, a.window, root, a.spaced),
               "many": one_size(a.n, a.binds, a.window, root, a.spaced)}
        rows.append(row)
        print(f"round {r + 1}: " + "; ".join(
            f"{k} ({a.base if k == 'base' else a.n} bound): "
            f"{v['bind_ms']:.2f} ms/bind ({v['bind_live_ms']:.2f}), "
            f"idle {v['idle_ms_per_s']:.2f} ms/s ({v['idle_live_ms_per_s']:.2f})"
            for k, v in row.items()), flush=True)
    med = {k: {f: statistics.median(r[k][f] for r in rows) for f in rows[0][k]}
           for k in ("base", "many")}
    print(f"\nmedian of {a.rounds} rounds; runtime dir on {'disk' if a.disk else 'tmpfs'}; "
          f"{a.binds} new binds, idle window {a.window:g} s; all threads "
          "(/proc/PID/stat) and, in parentheses, live threads (schedstat):")
    for k, n in (("base", a.base), ("many", a.n)):
        m = med[k]
        print(f"  {n:4d} bound: {m['bind_ms']:.2f} ms CPU per new bind "
              f"({m['bind_live_ms']:.2f}), idle {m['idle_ms_per_s']:.2f} ms/s "
              f"({m['idle_live_ms_per_s']:.2f}), runtime state "
              f"{m['runtime_state_bytes'] / 1024:.0f} KiB")
        if a.spaced:
            print(f"        spaced {a.spaced:g} s apart: {m['spaced_bind_live_ms']:.2f} ms CPU per "
                  f"bind with its deferred save (idle taken off; all threads "
                  f"{m['spaced_bind_ms']:.2f}), {m['writes_per_bind']:.2f} state.json writes "
                  "per bind")
    b, m = med["base"], med["many"]
    print(f"  ratio {a.n}/{a.base}: per bind {m['bind_live_ms'] / b['bind_live_ms']:.2f}x, "
          f"idle {m['idle_live_ms_per_s'] / max(b['idle_live_ms_per_s'], 1e-9):.2f}x "
          f"(targets: <= 2.5 ms per bind, <= 10 ms/s idle)")
    write_json(a.json, {"n": a.n, "base": a.base, "binds": a.binds, "window_s": a.window,
                        "tmpfs": not a.disk, "rounds": rows, "median": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
