"""The isolation figure: a training job alone, next to a CPU hog, and isolated by tunerd.

Three configurations of the built-in workload (tunerd.bench.workload, the guide's
example; ``--workers`` DataLoader workers, 0 by default so the job is one process
on one CPU), measured the same way in one run, interleaved (A B C, B C A, C A B ...)
after one warm-up round:

- alone: pinned to the CPU the exclusive lease gets (asked from the daemon first, so
  both run on the same CPU), nothing else started;
- unbound + hog: a 2-process CPU hog (``--hog-procs``) runs, the job is not bound;
- tunerd + hog: the same hog, the job started with
  ``tunerctl run --ncpus 1 --exclusive --exclusive-scope pid:HOG`` (one CPU, and the
  hog's processes moved off it for the lease's lifetime).

The hog runs only during the runs of the two hog configurations. Reported: median
samples/s of each, and each one's ratio to alone with its 95% interval
(tunerd.bench.stats). Target: tunerd + hog >= 0.95 of alone. Needs root (a daemon).

    python bench/isolation.py [--runs 5] [--steps 48] [--workers 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import nullcontext
from typing import Any

from _leases_common import Daemon, write_json

from tunerd.bench import builtin_command, tunerd_on_path
from tunerd.bench.runner import CpuHog, run_once
from tunerd.bench.stats import compare

CONFIGS = ("alone", "unbound + hog", "tunerd + hog")


def the_lease_cpu(d: Daemon) -> str:
    """The CPU a one-CPU exclusive lease gets here (alloc, then release)."""
    from tunerd.wire.client import Client

    with Client(str(d.socket)) as c:
        lease = c.call("alloc", gpus=0, ncpus=1, exclusive=True)
        c.call("release", lease=lease["id"])
    return str(lease["cpus"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs per configuration")
    ap.add_argument("--steps", type=int, default=48, help="batches per run")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    ap.add_argument("--hog-procs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("needs at least 2 CPUs", file=sys.stderr)
        return 2
    cmd = builtin_command(sys.executable)
    values: dict[str, list[float]] = {c: [] for c in CONFIGS}
    problems: list[str] = []
    with Daemon('[policy]\nname = "isolation"\n') as d, tunerd_on_path() as path_env:
        lease_cpu = the_lease_cpu(d)
        env = {**path_env, "TUNERD_BENCH_STEPS": str(args.steps),
               "TUNERD_NUM_WORKERS": str(args.workers), "TUNERD_SOCKET": str(d.socket)}
        for rnd in range(1 + args.runs):
            for k in range(len(CONFIGS)):
                config = CONFIGS[(rnd + k) % len(CONFIGS)]
                warm = rnd == 0
                hog_cm = CpuHog(args.hog_procs) if "hog" in config else nullcontext()
                with hog_cm as hog:  # the hog runs only during this run
                    if config == "alone":
                        argv = ["taskset", "-c", lease_cpu, *cmd]
                    elif config == "unbound + hog":
                        argv = list(cmd)
                    else:
                        assert hog is not None
                        argv = [sys.executable, "-m", "tunerd.cli.main", "--socket",
                                str(d.socket), "run", "--ncpus", "1", "--exclusive",
                                "--exclusive-scope", f"pid:{hog.pid}", "--", *cmd]
                    r = run_once(argv, env, 600, config, rnd, warm)
                used = (r.workload or {}).get("cpus")
                tag = " (warm-up)" if warm else ""
                if not r.ok:
                    problems.append(f"{config}: {r.error}: {r.stderr_tail[-400:]}")
                    print(f"{config}{tag}: failed, {r.error}", file=sys.stderr)
                    continue
                print(f"{config}{tag}: {r.value:.1f} samples/s on CPUs {used}",
                      file=sys.stderr)
                if not warm and r.value is not None:
                    values[config].append(r.value)
    out: dict[str, Any] = {"workload": "tunerd.bench.workload", "steps": args.steps,
                           "workers": args.workers, "hog_procs": args.hog_procs,
                           "cpus_on_machine": len(cpus), "samples_per_s": values,
                           "median": {c: statistics.median(v) if v else None
                                      for c, v in values.items()},
                           "problems": problems}
    for config in CONFIGS[1:]:
        c = compare(values["alone"], values[config], "samples_per_second", True, "alone",
                    config)
        out[f"{config} / alone"] = {"ratio": c.ratio, "ci95": c.ci, "verdict": c.verdict}
    ratio = out["tunerd + hog / alone"]["ratio"]
    out["target_bound_ge_0.95_of_alone"] = None if ratio is None else ratio >= 0.95
    print(json.dumps(out, indent=2))
    write_json(args.json, out)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
