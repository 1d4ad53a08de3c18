"""In-process cost of one JobSampler cycle over 10 real bound-like jobs.

    .venv/bin/python bench/job_sampler_cycle.py [--jobs 10] [--cycles 2000] [--against REV]

Starts N sleepers like bench/daemon_cpu.py's jobs (python, 4 threads, 32 MiB), then
times ``JobSampler.sample`` with perf_counter_ns over many cycles (the state of a
warm daemon: files open, slow reads every 10 cycles). Prints the median of 5 blocks
in us per cycle and per job, CPU time of the sampling thread (thread_time_ns: less
moved by other load on the machine than wall time). ``--against REV`` loads
tunerd/monitor/jobs.py of that git revision too and times both, interleaved, over the
same processes (a baseline measured in the same run).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tunerd.monitor.jobs import JobSampler

JOB = ("import threading, time\nbuf = bytearray(32 << 20)\n"
       "for _ in range(3): threading.Thread(target=time.sleep, args=(3600,), daemon=True)"
       ".start()\nprint('ready', flush=True)\ntime.sleep(3600)\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--against", default=None, help="git revision to compare with")
    args = ap.parse_args()
    samplers: dict[str, Any] = {"this tree": JobSampler(slow_every=10)}
    if args.against:
        src = subprocess.run(["git", "show", f"{args.against}:tunerd/monitor/jobs.py"],
                             check=True, capture_output=True, text=True).stdout
        path = Path(tempfile.mkdtemp()) / "old_jobs.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("old_jobs", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["old_jobs"] = mod
        spec.loader.exec_module(mod)
        samplers[args.against] = mod.JobSampler(slow_every=10)
    procs = [subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE)
             for _ in range(args.jobs)]
    try:
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()
        from tunerd.adapters.procfs import Process
        records = [{"pid": p.pid, "start_time": Process(p.pid).stat().start_time,
                    "name": "job", "cpus": "0-1", "mems": "", "gpus": [], "applied": True}
                   for p in procs]
        host = {"cpus": [{"cpu": 0, "busy_ratio": 0.5}, {"cpu": 1, "busy_ratio": 0.25}]}
        gpu: dict[str, Any] = {"gpus": [], "processes": []}
        for js in samplers.values():
            for _ in range(20):
                js.sample(records, gpu, host)
        blocks: dict[str, list[float]] = {name: [] for name in samplers}
        per = args.cycles // 5
        for _ in range(5):
            for name, js in samplers.items():
                t0 = time.thread_time_ns()
                for _ in range(per):
                    js.sample(records, gpu, host)
                blocks[name].append((time.thread_time_ns() - t0) / per / 1000)
        meds = {}
        for name, js in samplers.items():
            js.close()
            med = meds[name] = statistics.median(blocks[name])
            print(f"{name}: {args.jobs} jobs: {med:.1f} us/cycle "
                  f"({med / args.jobs:.1f} us/job); blocks "
                  f"{', '.join(f'{b:.0f}' for b in blocks[name])}")
        if args.against:
            print(f"ratio this/{args.against}: {meds['this tree'] / meds[args.against]:.2f}")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
