#!/usr/bin/env python3
"""What the GPU-use evidence costs the daemon: 100 GPU processes on the node.

Issue 33's budget: <= 0.5 ms of daemon CPU per second with 100 GPU processes on the node.
One daemon (the DGX H100 snapshot, the bundled torch-training rule with ``gpu_use`` on,
narrowed to this bench's token) whose replayed NVML lists, from its processes file
(``debug_gpu_processes``), 100 real processes this bench started, spread over the 8
GPUs; the monitor's sample carries them to the GPU-use service every second.

The same run alternates two phases on the same daemon, ``--rounds`` times:

  * baseline: the processes file lists nothing (the 100 processes still run);
  * listed: it lists the 100 processes.

Each phase settles ``--settle`` s (the first looks at newly listed processes, at most
32 a tick) and is then measured over ``--window`` s from outside: the daemon's
/proc/PID/stat (utime + stime, all threads, 10 ms ticks) and the schedstat of its live
threads (ns). Printed: the medians of each phase, the difference (the evidence's cost)
and the ratio; and the service's own count of its gathering's CPU (``scan``).

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


def measure(pid: int, seconds: float) -> tuple[float, float]:
    """ms of CPU per second: (/proc/PID/stat, all threads; live threads' schedstat)."""
    s0, n0, t0 = cpu_seconds(pid), task_ns(pid), time.monotonic()
    time.sleep(seconds)
    s1, n1 = cpu_seconds(pid), task_ns(pid)
    span = time.monotonic() - t0
    return (s1 - s0) * 1e3 / span, (n1 - n0) / 1e6 / span


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
    try:
        with Daemon(bundled_torch_rule(token), topology=DGX,
                    config=f'debug_gpu_processes = "{procs_file}"\n') as d:
            for r in range(args.rounds):
                row: dict[str, Any] = {}
                for phase, table in (("baseline", {}), ("listed", listed)):
                    write_processes(procs_file, table)
                    time.sleep(args.settle)
                    row[phase] = measure(d.pid, args.window)
                gpuuse = d.status()["services"]["gpuuse"]
                row["service"] = {"placed": gpuuse["placed"], "scan": gpuuse["scan"],
                                  "left_alone": gpuuse["left_alone"]}
                out["rounds"].append(row)
                print(f"round {r}: baseline {row['baseline'][0]:.2f} ms/s (threads "
                      f"{row['baseline'][1]:.3f}), listed {row['listed'][0]:.2f} ms/s "
                      f"(threads {row['listed'][1]:.3f})", flush=True)
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
        base = statistics.median(r["baseline"][i] for r in rows)
        listed = statistics.median(r["listed"][i] for r in rows)
        diffs = statistics.median(r["listed"][i] - r["baseline"][i] for r in rows)
        ratio = listed / base if base else float("nan")
        out[what] = {"baseline_median": base, "listed_median": listed,
                     "cost_median": diffs, "ratio": ratio}
        print(f"{what}: baseline {base:.3f} ms/s, {out['procs']} listed {listed:.3f} ms/s, "
              f"cost (median of per-round differences) {diffs:.3f} ms/s, ratio {ratio:.3f}")
    scan = rows[-1]["service"]["scan"]
    print(f"the service's own gathering: {scan['cpu_ms_per_s']} ms/s over its life "
          f"({scan['cpu_ms']} ms); placed {rows[-1]['service']['placed']}, left alone "
          f"{rows[-1]['service']['left_alone']}")


if __name__ == "__main__":
    sys.exit(main())
