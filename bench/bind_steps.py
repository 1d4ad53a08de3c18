"""In-process cost of the exec watcher's bind steps (intake, place, set) on a real
process, timed with perf_counter_ns over many iterations: the steps ``_bind_now``
takes, without the watcher's wake-up. A baseline of the same run: one
sched_getaffinity of that process.

    .venv/bin/python bench/bind_steps.py --n 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _ledger import attached_ledger

from tunerd.jobs.actuate import Binder
from tunerd.jobs.binding import Plan, Target
from tunerd.jobs.intake import Intake, request
from tunerd.jobs.placer import HostCapacity, Placer
from tunerd.topology import load_topology


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    env = {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    child = subprocess.Popen(["sleep", "600"], env=env)
    try:
        topo = load_topology(None)
        placer = Placer(topo, HostCapacity.read(), frozenset)
        intake = Intake(topo, placer.host.cpus, bound=lambda pid: None,
                        lease=placer.lease_of, ledger=attached_ledger())
        binder = Binder()
        cpus = sorted(placer.host.cpus)
        masks = [frozenset(cpus[:1]), frozenset(cpus)]
        envd = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        argv = ["sleep", "600"]
        steps: dict[str, list[int]] = {"baseline": [], "intake": [], "place": [], "set": []}
        pidfd = os.pidfd_open(child.pid)
        for i in range(a.n):
            t0 = time.perf_counter_ns()
            os.sched_getaffinity(child.pid)
            t1 = time.perf_counter_ns()
            ctx = intake.describe(child.pid, env=envd, argv=argv, uid=os.getuid(), quick=True)
            t2 = time.perf_counter_ns()
            placed = placer.place(request(ctx, gpus=0, gpu_ids=None, mode="gpu-local",
                                          exclusive=False, workers=0, group="b/x",
                                          ignore_busy_gpus=False, what="rule b"))
            t3 = time.perf_counter_ns()
            target = Target(pid=child.pid, start_time=ctx.start_time, pidfd=pidfd,
                            uid=os.getuid(), euid=-1)
            if getattr(ctx, "threads", 0) == 1:  # as autobind's _place_now does
                orig = binder.read_originals(target, ctx.allocation.mask)
            else:
                orig = binder.read_originals(target)
            binder.apply(Plan(target=target, originals=orig, cpus=masks[i % 2], mems=None,
                              nofile=None))
            t4 = time.perf_counter_ns()
            _ = placed.explanation, placed.notes  # built in the end all the same
            for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                steps[k].append(v)
        med = {k: statistics.median(v) / 1000 for k, v in steps.items()}
        total = med["intake"] + med["place"] + med["set"]
        print(f"n={a.n} median us: " + " ".join(f"{k}={v:.1f}" for k, v in med.items())
              + f" intake+place+set={total:.1f} ({total / med['baseline']:.1f}x baseline)")
    finally:
        child.kill()
        child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
