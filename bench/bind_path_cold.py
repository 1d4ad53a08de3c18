"""Why exec -> bound takes ~1 ms here when the starts are 50 ms apart: the daemon's own
rule match + intake + placement, run in this process on one running rank-like process,
timed back to back (warm) and each after a 50 ms sleep (cold), with the bare system
calls the path makes as the floor, in the same run.

The path is tunerd's: ``RuleSet.match`` (command line, environment, uid), then
``Intake.describe(quick=True)`` (stat, allocation, rank, GPUs, tree), ``request`` and
``Placer.place`` (memoised), as the exec watcher's thread runs them before it sets the
CPUs. No daemon and no exec: what differs between the two columns is only whether the
CPU's caches still hold the path. A third series sleeps 50 ms and then busy-spins 2 ms
before the timed run (a CPU kept busy, the path's caches still cold), a fourth runs
the path once before the timed run (caches warm). A third row, ``minimal_path``, makes
about the same system calls with the least Python around them (one straight-line
function): the floor a leaner intake could reach on this machine.

    python bench/bind_path_cold.py [--n 150] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import select
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _leases_common import snapshot_with_gpus_here, write_json
from _ledger import attached_ledger

from tunerd.jobs.intake import Intake, request
from tunerd.jobs.placer import HostCapacity, Placer
from tunerd.policy import load_policy_dir
from tunerd.policy.model import NodeFacts
from tunerd.topology import load_topology
from tunerd.watch.rules import RuleSet

GAP = 0.05  # seconds between cold runs, as bench/autobind.py's "50 ms apart"


def _read(path: str, n: int = 4096) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.read(fd, n)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-coldpath-"))
    exe = tmp / f"bench_train_{os.getpid()}"
    shutil.copy("/bin/sleep", exe)
    snap, _, _ = snapshot_with_gpus_here(tmp / "snap.json")
    topo = load_topology(snap)
    (tmp / "pol").mkdir()
    (tmp / "pol" / "00-bench.toml").write_text(
        '[policy]\nname = "bench"\n\n[[job]]\nname = "bench"\n'
        f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n')
    rules = RuleSet.from_policy(load_policy_dir(tmp / "pol", NodeFacts.from_topology(topo))
                                .model.jobs)
    rule = rules.rules[0]
    placer = Placer(topo, HostCapacity.read(), frozenset)
    intake = Intake(topo, placer.host.cpus, bound=lambda pid: None, lease=placer.lease_of,
                    ledger=attached_ledger())
    p = subprocess.Popen([str(exe), "600"], env={**os.environ, "LOCAL_RANK": "0"})
    pid, me = p.pid, os.getpid()
    time.sleep(0.2)

    def tunerd_path() -> None:
        m = rules.match(pid)
        assert m is not None
        ctx = intake.describe(pid, env=m.env, argv=m.cmdline.split(" "), uid=m.uid,
                              quick=True)
        placer.place(request(ctx, gpus=0, gpu_ids=ctx.gpus or None, mode=rule.placement,
                             exclusive=False, workers=0, group="bench",
                             ignore_busy_gpus=bool(ctx.gpus), what="bench"))

    def syscalls() -> None:  # what the path reads, and nothing else
        base = f"/proc/{pid}/"
        for name in ("cmdline", "environ", "status", "stat", "cgroup"):
            _read(base + name, 65536)
        _read(f"/proc/{me}/stat")
        os.sched_getaffinity(pid)
        os.sched_getaffinity(me)

    want = re.compile(rb".*" + re.escape(exe.name.encode()) + rb".*", re.S)

    def minimal() -> None:
        # the least Python around about the same system calls: one straight-line function
        # (a regex and bytes.find for the match, stat and cgroup read, both masks, a pidfd
        # poll, a dictionary lookup for the placement), the floor a leaner intake could reach
        base = f"/proc/{pid}/"
        fd = os.open(base + "cmdline", os.O_RDONLY | os.O_CLOEXEC)
        cmd = os.read(fd, 4097)
        os.close(fd)
        if not want.match(cmd):
            raise AssertionError(cmd)
        fd = os.open(base + "environ", os.O_RDONLY | os.O_CLOEXEC)
        env = os.read(fd, 65536)
        os.close(fd)
        i = env.find(b"\0LOCAL_RANK=")
        rank = int(env[i + 12:env.find(b"\0", i + 1)]) if i >= 0 else -1
        pidfd = os.pidfd_open(pid)
        fd = os.open(base + "stat", os.O_RDONLY | os.O_CLOEXEC)
        st = os.read(fd, 4096)
        os.close(fd)
        fields = st[st.rfind(b")") + 2:].split()
        ppid, _threads, _start = int(fields[1]), int(fields[17]), int(fields[19])
        fd = os.open(base + "cgroup", os.O_RDONLY | os.O_CLOEXEC)
        cg = os.read(fd, 8192)
        os.close(fd)
        same = os.sched_getaffinity(pid) == os.sched_getaffinity(ppid)
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        gone = poll.poll(0)
        os.close(pidfd)
        if gone or not same:
            raise AssertionError("gone, or set its own mask")
        placements.get((cg, rank))

    placements: dict[tuple[bytes, int], frozenset[int]] = {}

    def spin() -> None:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass

    def series(fn: Callable[[], None], gap: float,
               before: Callable[[], None] | None = None) -> float:
        v = []
        for _ in range(a.n):
            if gap:
                time.sleep(gap)
            if before is not None:
                before()
            t = time.perf_counter_ns()
            fn()
            v.append(time.perf_counter_ns() - t)
        return statistics.median(v) / 1000

    res: dict[str, Any] = {"n": a.n}
    try:
        for _ in range(50):
            tunerd_path()
        for name, fn in (("tunerd_path", tunerd_path), ("syscalls_only", syscalls),
                         ("minimal_path", minimal)):
            res[name] = {"warm_us": series(fn, 0), "cold_us": series(fn, GAP),
                         "cold_after_spin_us": series(fn, GAP, spin),
                         "cold_after_one_run_us": series(fn, GAP, fn)}
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"rule match + intake + placement on one running process, median of {a.n} runs (us):")
    print(f"  {'':16s} {'back to back':>13s} {'50 ms apart':>12s} {'.. + 2 ms spin':>15s} "
          f"{'.. + one run':>13s}")
    for name in ("tunerd_path", "syscalls_only", "minimal_path"):
        r = res[name]
        print(f"  {name:16s} {r['warm_us']:13.0f} {r['cold_us']:12.0f} "
              f"{r['cold_after_spin_us']:15.0f} {r['cold_after_one_run_us']:13.0f}")
    t = res["tunerd_path"]
    print(f"  cold / warm: {t['cold_us'] / t['warm_us']:.1f}x (tunerd's path), "
          f"{res['syscalls_only']['cold_us'] / res['syscalls_only']['warm_us']:.1f}x "
          "(its system calls alone)")
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
