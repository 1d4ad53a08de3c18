#!/usr/bin/env python3
"""Monitor overhead: tunerd's CPU per 1 s sampling cycle on a crowded host, vs baselines.

Setup (all started here, all ended by PID afterwards): 2,000 extra sleeping
processes, 10 bound jobs (python, 4 threads, 32 MiB each, `tunerctl bind
--cpus --mems`), a real tunerd with metrics on a loopback port.

Measured in the same run:
  * tunerd per cycle: the sampler thread's own CPU per cycle (thread_time, from
    `tunerctl status`: median/p95 over the window) and the whole daemon's CPU
    (/proc/PID/stat utime+stime) divided by the cycles in the window;
  * baseline A: a naive psutil sweep of every process per cycle (what a
    "monitor everything" agent does), median/p95 CPU per sweep;
  * baseline B: prometheus-node-exporter's CPU per scrape (if installed), and
    tunerd's own CPU per /metrics scrape;
  * memory: daemon RSS while the history ring fills to capacity and beyond
    (sample_interval 0.01 s, history_seconds 36 s = the 3,600 rows an hour holds
    at 1 s), against the ring's computed bound.

Usage: python bench/monitor_overhead.py [--window 30] [--procs 2000] [--jobs 10]
       [--json FILE]
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CLK = os.sysconf("SC_CLK_TCK")
JOB = ("import threading, time\nbuf = bytearray(32 << 20)\n"
       "for i in range(0, len(buf), 4096): buf[i] = 1\n"
       "for _ in range(3): threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
       "print('ready', flush=True)\ntime.sleep(3600)\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text()
    rest = f[f.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / CLK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(len(s) * q))]


class Daemon:
    def __init__(self, tmp: Path, interval: float, history: float, metrics: str) -> None:
        self.tmp = tmp
        (tmp / "p").mkdir(parents=True, exist_ok=True)
        (tmp / "p/00.toml").write_text('[policy]\nname = "bench"\n')
        cfg = tmp / "tunerd.toml"
        cfg.write_text(f"sample_interval = {interval}\nhistory_seconds = {history}\n")
        self.sock = tmp / "run/tunerd.sock"
        self.log = open(tmp / "tunerd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PY, "-m", "tunerd.daemon.main", "--config", str(cfg), "--policy-dir",
             str(tmp / "p"), "--runtime-dir", str(tmp / "run"), "--state-dir",
             str(tmp / "state"), "--metrics-listen", metrics, "--log-level", "warning",
             "--scope-pid", str(os.getpid())],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.sock.exists() and self.ctl("status").returncode == 0:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError((tmp / "tunerd.log").read_text())

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PY, "-m", "tunerd.cli.main", "--socket", str(self.sock), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    def monitor(self) -> dict[str, Any]:
        out = self.ctl("--json", "status")
        return dict(json.loads(out.stdout)["services"]["monitor"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def spawn_sleepers(n: int) -> list[subprocess.Popen[bytes]]:
    sleep = shutil.which("sleep") or "/bin/sleep"
    return [subprocess.Popen([sleep, "3600"]) for _ in range(n)]


def spawn_jobs(n: int) -> list[subprocess.Popen[str]]:
    jobs = []
    for _ in range(n):
        p = subprocess.Popen([PY, "-c", JOB], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        jobs.append(p)
    return jobs


def psutil_sweep_baseline(n: int) -> list[float]:
    """CPU seconds per naive sweep: every process's cpu, memory, threads, io, fds."""
    import psutil

    out = []
    attrs = ["cpu_times", "memory_info", "num_threads", "io_counters", "num_fds", "name",
             "cmdline", "status", "num_ctx_switches"]
    for _ in range(n):
        t0 = time.thread_time()
        rows = [p.info for p in psutil.process_iter(attrs)]
        out.append(time.thread_time() - t0)
        assert rows
        time.sleep(0.2)
    return out


def scrape_cpu(pid: int, url: str, n: int, gap: float = 0.1) -> tuple[float, int]:
    """CPU seconds ``pid`` spends per scrape of ``url``: n scrapes ``gap`` s apart, minus
    its own background CPU over as long a quiet period (utime+stime count 10 ms ticks,
    hence many scrapes)."""
    size = 0
    idle0 = cpu_seconds(pid)
    time.sleep(gap * n)
    idle = cpu_seconds(pid) - idle0
    c0 = cpu_seconds(pid)
    for _ in range(n):
        with urllib.request.urlopen(url, timeout=10) as r:
            size = len(r.read())
        time.sleep(gap)
    return max(0.0, (cpu_seconds(pid) - c0 - idle) / n), size


def node_exporter_baseline(n: int) -> dict[str, Any] | None:
    exe = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if exe is None:
        return None
    port = free_port()
    p = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        for _ in range(100):
            try:
                urllib.request.urlopen(url, timeout=5).read()
                break
            except OSError:
                time.sleep(0.1)
        per, size = scrape_cpu(p.pid, url, n)
        return {"cpu_seconds_per_scrape": per, "bytes": size}
    finally:
        p.terminate()
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=30.0, help="seconds of 1 s cycles")
    ap.add_argument("--procs", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--fill-seconds", type=float, default=54.0,
                    help="memory phase: run 1.5x the 36 s ring at 0.01 s")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res: dict[str, Any] = {"procs": a.procs, "jobs": a.jobs, "cpus": os.cpu_count()}
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-bench-"))
    sleepers: list[subprocess.Popen[Any]] = []
    jobs: list[subprocess.Popen[str]] = []
    daemons: list[Daemon] = []
    try:
        sleepers = spawn_sleepers(a.procs)
        jobs = spawn_jobs(a.jobs)
        res["host_processes"] = sum(1 for d in os.listdir("/proc") if d.isdigit())
        port = free_port()
        d = Daemon(tmp / "d1", 1.0, 3600, f"127.0.0.1:{port}")
        daemons.append(d)
        for j in jobs:
            r = d.ctl("bind", str(j.pid), "--cpus", "0-1", "--mems", "0")
            if r.returncode != 0:
                raise RuntimeError(f"bind {j.pid}: {r.stderr}")
        time.sleep(3)
        # window A, nobody asks the daemon anything: whole-process CPU per cycle
        m0, c0 = d.monitor(), cpu_seconds(d.proc.pid)
        time.sleep(a.window)
        c1, m1 = cpu_seconds(d.proc.pid), d.monitor()
        cycles = m1["samples_total"] - m0["samples_total"]
        # window B: the sampler thread's own CPU of each cycle (read once per cycle)
        per_cycle: dict[int, float] = {}
        t_end = time.monotonic() + a.window
        while time.monotonic() < t_end:
            m = d.monitor()
            per_cycle[m["samples_total"]] = m["last_sample_cpu_seconds"]
            time.sleep(0.5)
        vals = list(per_cycle.values())
        res["tunerd"] = {
            "cycles": cycles, "cycles_timed": len(vals),
            "jobs_sampled": len(json.loads(d.ctl("--json", "top").stdout)["sample"]["jobs"]),
            "sampler_cpu_ms_median": statistics.median(vals) * 1e3,
            "sampler_cpu_ms_p95": pct(vals, 0.95) * 1e3,
            "sampler_cpu_ms_max": max(vals) * 1e3,
            "sampler_cpu_ms_mean": (m1["sample_cpu_seconds_total"]
                                    - m0["sample_cpu_seconds_total"]) / cycles * 1e3,
            "daemon_cpu_ms_per_cycle": (c1 - c0) / cycles * 1e3,
            "history_bytes": m1["history_bytes"], "history_bound_bytes":
                m1["history_bound_bytes"], "rss_bytes": rss_bytes(d.proc.pid),
        }
        per, size = scrape_cpu(d.proc.pid, f"http://127.0.0.1:{port}/metrics", 100)
        res["tunerd"]["cpu_ms_per_scrape"] = per * 1e3
        res["tunerd"]["scrape_bytes"] = size
        sweep = psutil_sweep_baseline(10)
        res["psutil_sweep"] = {"cpu_ms_median": statistics.median(sweep) * 1e3,
                               "cpu_ms_p95": pct(sweep, 0.95) * 1e3}
        ne = node_exporter_baseline(100)
        res["node_exporter"] = None if ne is None else {
            "cpu_ms_per_scrape": ne["cpu_seconds_per_scrape"] * 1e3, "bytes": ne["bytes"]}
        for j in jobs:
            d.ctl("unbind", str(j.pid))
        d.stop()
        daemons.remove(d)

        # memory: fill the 3,600-row ring (36 s at 0.01 s) and run on past it
        f = Daemon(tmp / "d2", 0.01, 36, "off")
        daemons.append(f)
        for j in jobs:
            f.ctl("bind", str(j.pid), "--cpus", "0-1", "--mems", "0")
        series = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.fill_seconds:
            time.sleep(a.fill_seconds / 6)
            m = f.monitor()
            series.append({"seconds": round(time.monotonic() - t0, 1),
                           "samples": m["samples_total"], "rss_bytes": rss_bytes(f.proc.pid),
                           "history_bytes": m["history_bytes"]})
        res["memory"] = {"capacity_rows": m["history_capacity"],
                         "history_bound_bytes": m["history_bound_bytes"], "series": series}
        for j in jobs:
            f.ctl("unbind", str(j.pid))
    finally:
        for dd in daemons:
            dd.stop()
        procs: list[subprocess.Popen[Any]] = [*jobs, *sleepers]
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    report(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


def report(r: dict[str, Any]) -> None:
    t, s = r["tunerd"], r["psutil_sweep"]
    print(f"host: {r['cpus']} CPUs, {r['host_processes']} processes "
          f"({r['procs']} extra sleepers), {t['jobs_sampled']} bound jobs sampled")
    print(f"tunerd sampler CPU per 1 s cycle : median {t['sampler_cpu_ms_median']:.2f} ms, "
          f"p95 {t['sampler_cpu_ms_p95']:.2f} ms, max {t['sampler_cpu_ms_max']:.2f} ms "
          f"({t['cycles_timed']} cycles); mean {t['sampler_cpu_ms_mean']:.2f} ms")
    print(f"tunerd whole daemon CPU per cycle: {t['daemon_cpu_ms_per_cycle']:.2f} ms "
          f"(/proc/PID/stat over {t['cycles']} cycles; includes loop, GC, wakeups)")
    print(f"naive psutil sweep per cycle     : median {s['cpu_ms_median']:.1f} ms, "
          f"p95 {s['cpu_ms_p95']:.1f} ms  -> "
          f"{s['cpu_ms_median'] / max(t['sampler_cpu_ms_median'], 1e-6):.0f}x tunerd")
    print(f"tunerd CPU per /metrics scrape   : {t['cpu_ms_per_scrape']:.2f} ms "
          f"({t['scrape_bytes']} bytes)")
    ne = r.get("node_exporter")
    if ne:
        print(f"node-exporter CPU per scrape     : {ne['cpu_ms_per_scrape']:.2f} ms "
              f"({ne['bytes']} bytes)")
    else:
        print("node-exporter: not installed (apt-get install prometheus-node-exporter)")
    m = r["memory"]
    print(f"memory: ring {m['capacity_rows']} rows, bound {m['history_bound_bytes'] / 2**20:.1f} "
          "MiB of rows (64 job rings)")
    for row in m["series"]:
        print(f"  t={row['seconds']:5.1f}s samples={row['samples']:5d} "
              f"rss={row['rss_bytes'] / 2**20:6.1f} MiB "
              f"history={row['history_bytes'] / 2**10:.0f} KiB")


if __name__ == "__main__":
    sys.exit(main())
