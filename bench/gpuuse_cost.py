#!/usr/bin/env python3
"""What the GPU-use evidence costs the daemon: 100 GPU processes on the node.

Issue 33's budget: <= 0.5 ms of daemon CPU per second with 100 GPU processes on the node.
One daemon (the DGX H100 snapshot, the bundled torch-training rule with ``gpu_use`` on,
narrowed to this bench's token) whose replayed NVML lists, from its processes file
(``debug_gpu_processes``), 100 real processes this bench started, spread over the 8
GPUs; the monitor's sample carries them to the GPU-use service every second.

Two daemons run side by side on the same processes file, measured in the same windows:
``on`` (the rule's ``gpu_use`` on) and ``off`` (``gpu_use.enabled = false``: the
service is idle; the monitor still samples the 100 processes, as it did before GPU use
was evidence). The same run alternates two phases, ``--rounds`` times:

  * baseline: the processes file lists nothing (the 100 processes still run);
  * listed: it lists the 100 processes.

Each phase settles ``--settle`` s (the first looks at newly listed processes, at most
32 a tick) and is then measured over ``--window`` s from outside: each daemon's
/proc/PID/stat (utime + stime, all threads, 10 ms ticks) and the schedstat of its live
threads (ns). Printed, as medians over rounds: each daemon's baseline and listed
figures; the whole daemon's cost of the 100 processes (``on``: listed - baseline); the
GPU-use evidence's share (``on``'s cost - ``off``'s, same windows) and ``on``/``off``
with the 100 listed; and the service's own count of its gathering's CPU (``scan``).

``--kind left-alone`` (default): the processes match no rule (no token): each is looked
at when first listed and again every 30 s (RECHECK_S), the dearer steady state.
``--kind placed``: they carry the token and are placed (replay: held, not applied),
each its own job; a tick then reads nothing of them.

Root only. The figure in docs/benchmarks.md comes from:

    sudo python bench/gpuuse_cost.py --rounds 3 --window 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _leases_common import REPO, Daemon, bundled_torch_rule, cpu_seconds, task_ns, write_json

DGX = REPO / "tests/fixtures/topologies/dgx-h100.json"


def write_processes(path: Path, table: dict[int, list[int]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(g): pids for g, pids in table.items()}))
    tmp.replace(path)


def measure(pids: list[int], seconds: float) -> list[tuple[float, float]]:
    """ms of CPU per second of each pid over one window: (/proc/PID/stat, all threads;
    live threads' schedstat)."""
    before = [(cpu_seconds(p), task_ns(p)) for p in pids]
    t0 = time.monotonic()
    time.sleep(seconds)
    after = [(cpu_seconds(p), task_ns(p)) for p in pids]
    span = time.monotonic() - t0
    return [((s1 - s0) * 1e3 / span, (n1 - n0) / 1e6 / span)
            for (s0, n0), (s1, n1) in zip(before, after, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--kind", choices=("left-alone", "placed"), default="left-alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("root only", file=sys.stderr)
        return 2
    token = f"gpuuse{os.getpid()}"
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"tunerd-gpuuse-bench-{os.getpid()}"
    work.mkdir()
    procs_file = work / "gpu-processes.json"
    write_processes(procs_file, {})
    env = {**os.environ, **({"TUNERD_BENCH_TOKEN": token} if args.kind == "placed" else {})}
    sleepers = [subprocess.Popen(["sleep", "3600"], env=env) for _ in range(args.procs)]
    listed = {g: [p.pid for p in sleepers[g::8]] for g in range(8)}
    out: dict[str, Any] = {"procs": args.procs, "kind": args.kind, "window_s": args.window,
                           "rounds": []}
    cfg = f'debug_gpu_processes = "{procs_file}"\n'
    policy = bundled_torch_rule(token)
    off_policy = policy.replace("gpu_use = { enabled = true }", "gpu_use = { enabled = false }")
    assert off_policy != policy, policy
    try:
        with Daemon(policy, topology=DGX, config=cfg) as on, \
                Daemon(off_policy, topology=DGX, config=cfg) as off:
            time.sleep(2 * args.settle)  # warm-up: the start's own work is no baseline
            for r in range(args.rounds):
                row: dict[str, Any] = {}
                for phase, table in (("baseline", {}), ("listed", listed)):
                    write_processes(procs_file, table)
                    time.sleep(args.settle)
                    row[phase] = measure([on.pid, off.pid], args.window)
                gpuuse = on.status()["services"]["gpuuse"]
                row["service"] = {"placed": gpuuse["placed"], "scan": gpuuse["scan"],
                                  "left_alone": gpuuse["left_alone"],
                                  "off_ticks": off.status()["services"]["gpuuse"]["ticks"]}
                out["rounds"].append(row)
                (b_on, b_off), (l_on, l_off) = row["baseline"], row["listed"]
                print(f"round {r} (schedstat ms/s): on {b_on[1]:.3f} -> {l_on[1]:.3f}, "
                      f"off {b_off[1]:.3f} -> {l_off[1]:.3f} (baseline -> listed)",
                      flush=True)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    _report(out)
    write_json(args.json, out)
    return 0


def _report(out: dict[str, Any]) -> None:
    rows = out["rounds"]

    for i, what in ((0, "stat (all threads)"), (1, "schedstat (live threads)")):
        fig = _figures(rows, i)
        out[what] = fig
        print(f"{what}, medians over {len(rows)} rounds: on {fig['on_baseline']:.3f} -> "
              f"{fig['on_listed']:.3f} ms/s, off {fig['off_baseline']:.3f} -> "
              f"{fig['off_listed']:.3f} ms/s (baseline -> {out['procs']} listed); whole "
              f"daemon's cost of them {fig['cost_of_100_whole_daemon']:.3f} ms/s, the GPU-use "
              f"evidence's {fig['cost_of_gpu_use_evidence']:.3f} ms/s; on/off listed "
              f"{fig['ratio_on_off_listed']:.3f}")
    svc = rows[-1]["service"]
    print(f"the service's own gathering: {svc['scan']['cpu_ms_per_s']} ms/s over its life "
          f"({svc['scan']['cpu_ms']} ms); placed {svc['placed']}, left alone "
          f"{svc['left_alone']}; the off daemon's service ticked {svc['off_ticks']} times")


def _figures(rows: list[dict[str, Any]], i: int) -> dict[str, float]:
    """Medians over rounds of figure ``i`` (0: stat, 1: schedstat)."""

    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rows)

    return {
        "on_baseline": med(lambda r: r["baseline"][0][i]),
        "on_listed": med(lambda r: r["listed"][0][i]),
        "off_baseline": med(lambda r: r["baseline"][1][i]),
        "off_listed": med(lambda r: r["listed"][1][i]),
        "cost_of_100_whole_daemon": med(lambda r: r["listed"][0][i] - r["baseline"][0][i]),
        "cost_of_gpu_use_evidence": med(lambda r: (r["listed"][0][i] - r["baseline"][0][i])
                                        - (r["listed"][1][i] - r["baseline"][1][i])),
        "ratio_on_off_listed": med(lambda r: r["listed"][0][i] / r["listed"][1][i]
                                   if r["listed"][1][i] else float("nan")),
    }


if __name__ == "__main__":
    sys.exit(main())
