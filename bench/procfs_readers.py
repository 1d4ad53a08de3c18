#!/usr/bin/env python3
"""psutil against tunerd's own readers, side by side: CPU per call, medians and ratios.

Per job (10 live processes: python, 4 threads, 32 MiB touched, 20 open fds):

* ``every cycle``: what the job sampler reads each second -- psutil
  ``Process.oneshot()`` with cpu_times, num_threads, status, create_time,
  memory_info, io_counters, num_fds, rlimit(NOFILE) against tunerd.adapters.procfs
  ``Process``: stat (which has all of the first five), io_counters, num_fds, nofile;
* ``+ status``: the same plus what only /proc/PID/status has (uids, context
  switches), which the sampler reads every 10 s;
* ``JobSampler``: tunerd's whole per-job sample (the above plus its arithmetic),
  in an every-cycle and a slow (numa_maps, per-thread states) cycle.

Host (what tunerd.monitor.host reads each cycle): psutil cpu_times(percpu),
virtual_memory, disk_io_counters(perdisk), net_io_counters(pernic) alone against
HostSampler's CPU, memory (psutil + per NUMA node, which psutil does not give), disk
and NIC parts, which call them and add ratios, rates and the whole-disk filter.

Exec path: the command line of a process with a 1 MiB command line, psutil
``cmdline()`` (reads all of it) against ``read_cmdline_prefix`` (the 4 KiB the
rules match).

CPU is this thread's (time.thread_time_ns) per call; medians over ``--n`` calls, the
two readers interleaved call by call.

    python bench/procfs_readers.py [--n 300] [--json FILE]

Figures from a shared or loaded machine are not figures for the README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from tunerd.adapters.procfs import Process, read_cmdline_prefix  # noqa: E402
from tunerd.monitor.host import HostSampler  # noqa: E402
from tunerd.monitor.jobs import JobSampler  # noqa: E402
from tunerd.watch.rules import CMDLINE_MATCH_BYTES  # noqa: E402

JOB = ("import os, threading, time\nbuf = bytearray(32 << 20)\n"
       "for i in range(0, len(buf), 4096): buf[i] = 1\n"
       "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(20)]\n"
       "for _ in range(3): threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
       "print('ready', flush=True)\ntime.sleep(3600)\n")


@contextlib.contextmanager
def children(n: int, extra_args: list[str] | None = None) -> Iterator[list[int]]:
    procs = [subprocess.Popen([sys.executable, "-c", JOB, *(extra_args or [])],
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def cpu_us(fn: Callable[[], Any], n: int, per: int = 1) -> float:
    """Median thread CPU in microseconds of ``fn()``, divided by ``per``."""
    fn()  # warm up (imports, first-touch of /proc dentries)
    samples = []
    for _ in range(n):
        t = time.thread_time_ns()
        fn()
        samples.append((time.thread_time_ns() - t) / 1000 / per)
    return statistics.median(samples)


def psutil_cycle(procs: list[psutil.Process], status: bool) -> None:
    for p in procs:
        with p.oneshot():
            p.cpu_times()
            p.num_threads()
            p.status()
            p.create_time()
            p.memory_info()
            p.io_counters()
            p.num_fds()
            p.rlimit(resource.RLIMIT_NOFILE)
            if status:
                p.uids()
                p.num_ctx_switches()


def tunerd_cycle(pids: list[int], status: bool) -> None:
    for pid in pids:
        p = Process(pid)
        p.stat()
        p.io_counters()
        p.num_fds()
        p.nofile()
        if status:
            with p.oneshot():
                p.uids()
                p.ctx_switches()


def pair(name: str, ps: Callable[[], Any], hand: Callable[[], Any], n: int,
         per: int = 1) -> dict[str, Any]:
    """Both readers, interleaved call by call so that both see the same machine load."""
    ps(), hand()
    a_s: list[float] = []
    b_s: list[float] = []
    for _ in range(n):
        for fn, out in ((ps, a_s), (hand, b_s)):
            t = time.thread_time_ns()
            fn()
            out.append((time.thread_time_ns() - t) / 1000 / per)
    a, b = statistics.median(a_s), statistics.median(b_s)
    return {"name": name, "psutil_us": a, "tunerd_us": b, "ratio": a / b if b else float("inf")}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with children(a.jobs) as pids:
        procs = [psutil.Process(p) for p in pids]
        for status in (False, True):
            rows.append(pair("per job, every cycle" + (" + status" if status else ""),
                             lambda s=status: psutil_cycle(procs, s),
                             lambda s=status: tunerd_cycle(pids, s), a.n, len(pids)))
        recs = [{"pid": p, "start_time": Process(p).start_time(), "name": "bench",
                 "cpus": "0", "mems": "0", "gpus": []} for p in pids]
        fast = JobSampler(slow_every=1_000_000)
        slow = JobSampler(slow_every=1)
        fast.sample(recs, {}), slow.sample(recs, {})
        js_fast = cpu_us(lambda: fast.sample(recs, {}), a.n, len(pids))
        js_slow = cpu_us(lambda: slow.sample(recs, {}), max(10, a.n // 10), len(pids))
    host = HostSampler()
    host.sample()
    parts: dict[str, Callable[[], Any]] = {}
    for part in ("cpu", "memory", "disks", "net"):
        fn = getattr(host, f"_{part}")
        parts[part] = lambda fn=fn: fn({"unavailable": {}}, 1.0)
    rows += [
        pair("host: CPU part (tunerd: + busy ratios per CPU and node)",
             lambda: psutil.cpu_times(percpu=True), parts["cpu"], a.n),
        pair("host: memory (psutil: whole host; tunerd: per NUMA node)",
             psutil.virtual_memory, parts["memory"], a.n),
        pair("host: disks part (tunerd: + whole-disk filter, rates)",
             lambda: psutil.disk_io_counters(perdisk=True), parts["disks"], a.n),
        pair("host: NICs part (tunerd: + rates)",
             lambda: psutil.net_io_counters(pernic=True), parts["net"], a.n),
    ]
    with children(1, ["y" * 65_536] * 16) as [big]:
        rows.append(pair("exec path: 1 MiB command line", psutil.Process(big).cmdline,
                         lambda: read_cmdline_prefix(big, limit=CMDLINE_MATCH_BYTES),
                         max(20, a.n // 10)))

    print(f"psutil {psutil.__version__} vs tunerd.adapters.procfs; thread CPU per call, median of "
          f"{a.n} (per job: {a.jobs} live processes)")
    print(f"  {'':58s} {'psutil us':>10s} {'tunerd us':>10s} {'ratio':>6s}")
    print("  (ratio = psutil / tunerd: above 1, tunerd's reader is cheaper)")
    for r in rows:
        print(f"  {r['name']:58s} {r['psutil_us']:10.1f} {r['tunerd_us']:10.1f} "
              f"{r['ratio']:6.2f}")
    print(f"  JobSampler per job: {js_fast:.1f} us every cycle, {js_slow:.1f} us in a slow cycle")
    per_s = {"psutil": rows[0]["psutil_us"], "tunerd": rows[0]["tunerd_us"]}
    print(f"  at 1 Hz with 10 jobs the per-cycle reads cost {per_s['psutil'] * 10 / 1000:.2f} "
          f"ms/s with psutil, {per_s['tunerd'] * 10 / 1000:.2f} ms/s with tunerd.adapters.procfs "
          "(budget: 3 ms/s for the whole daemon)")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "jobsampler_fast_us": js_fast,
                                            "jobsampler_slow_us": js_slow}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
