#!/usr/bin/env python3
"""`tunerctl fleet check` against a Prometheus holding 1,000 nodes' series (issue 18: <= 5 s).

Writes the fleet series of N nodes (tunerd_node_info, tunerd_policy_info, tunerd_nic_mtu,
tunerd_nccl_setting_info, 8 ranks' step time/throughput/bound, the straggler-cause
series) as OpenMetrics, samples every 30 s over the last 10 minutes, backfills them with
`promtool tsdb create-blocks-from openmetrics`, starts a real Prometheus on that data
(loopback, no scraping) and times `tunerctl fleet check` as a whole process, from
outside, several rounds; the median is the figure. Injected: a few nodes per class with
another MTU, driver, NCCL setting or policy, and a few straggling nodes, so the check
does all its work (the findings are counted against what was injected).

Baseline in the same run: `tunerctl --version` (the interpreter and CLI start-up every
tunerctl command pays).

Usage: python bench/fleet_check.py [--nodes 1000] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
CLASSES = ["base,h100-training/NVIDIA H100 80GB HBM3", "base,a100/NVIDIA A100-SXM4-80GB",
           "base,l40s/NVIDIA L40S", "base,gh200/NVIDIA GH200 480GB"]
RANKS = 8
JOBS_NODES = 8  # nodes per multi-node job
STEP, SAMPLES = 30, 21  # seconds between samples, samples per series (10 minutes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_openmetrics(path: Path, nodes: int, now: float) -> dict[str, int]:
    """The fleet's series; returns what was injected (the findings the check must make)."""
    times = [now - STEP * (SAMPLES - 1 - i) for i in range(SAMPLES)]
    odd = {"nccl_mtu": set(range(7, nodes, 97)), "driver_version": set(range(11, nodes, 101)),
           "nccl:NCCL_IB_HCA": set(range(13, nodes, 103)),
           "policy_hash": set(range(17, nodes, 107))}
    slow = set(range(3 * JOBS_NODES + 2, nodes, 10 * JOBS_NODES))  # one node in some jobs
    fams: dict[str, list[tuple[str, float]]] = {k: [] for k in (
        "tunerd_up", "tunerd_node_info", "tunerd_policy_info", "tunerd_nic_mtu",
        "tunerd_nccl_setting_info", "tunerd_rank_step_seconds",
        "tunerd_rank_samples_per_second", "tunerd_rank_bound",
        "tunerd_pressure_avg10_ratio", "tunerd_job_tree_cpu_saturation_ratio",
        "tunerd_gpu_throttle_reason_active")}
    for n in range(nodes):
        inst = f'instance="node{n:04d}:9464",job="tunerd"'
        klass = CLASSES[n % len(CLASSES)]
        driver = "535.161.08" if n in odd["driver_version"] else "550.54.15"
        fams["tunerd_up"].append((f"{{{inst}}}", 1))
        fams["tunerd_node_info"].append((
            f'{{{inst},class="{klass}",driver="{driver}",cuda="12.4",nccl="2.21.5",'
            f'torch="2.5.1+cu124",kernel="6.8.0-45-generic",version="0.2.0"}}', 1))
        h = "0ld0ld0ld0ld0ld0" if n in odd["policy_hash"] else f"{n % len(CLASSES):016x}"
        fams["tunerd_policy_info"].append((f'{{{inst},hash="{h}"}}', 1))
        mtu = 1500 if n in odd["nccl_mtu"] else 9000
        nic = "ens1f0" if n % 2 else "ib0"  # names differ; MTU and subnet must not
        fams["tunerd_nic_mtu"].append((f'{{{inst},nic="{nic}",subnet="10.{n % 4}.0.0/16",'
                                       'nccl="1"}', mtu))
        fams["tunerd_nic_mtu"].append((f'{{{inst},nic="eno1",subnet="192.168.0.0/16",'
                                       'nccl="0"}', 1500))
        hca = "mlx5_0" if n in odd["nccl:NCCL_IB_HCA"] else "mlx5"
        for key, value in (("NCCL_SOCKET_IFNAME", "ib,ens"), ("NCCL_IB_HCA", hca),
                           ("NCCL_IB_GID_INDEX", "3"), ("NCCL_NET_GDR_LEVEL", "PHB")):
            fams["tunerd_nccl_setting_info"].append((f'{{{inst},key="{key}",value="{value}"}}',
                                                     1))
        job = f"job-{n // JOBS_NODES}"
        step = 0.65 if n in slow else 0.5
        for r in range(RANKS):
            rank = f'{{{inst},exported_job="{job}",rank="{(n % JOBS_NODES) * RANKS + r}"}}'
            fams["tunerd_rank_step_seconds"].append((rank, step))
            fams["tunerd_rank_samples_per_second"].append((rank, 64 / step))
            fams["tunerd_rank_bound"].append((rank, 0 if n in slow and r == 0 else 1))
        for res in ("cpu", "io", "memory"):
            fams["tunerd_pressure_avg10_ratio"].append(
                (f'{{{inst},resource="{res}",kind="some"}}', 0.3 if n in slow else 0.01))
        fams["tunerd_job_tree_cpu_saturation_ratio"].append(
            (f'{{{inst},job_name="train",pid="{1000 + n}"}}', 0.5))
        for g in range(8):
            fams["tunerd_gpu_throttle_reason_active"].append(
                (f'{{{inst},gpu="{g}",uuid="GPU-{n:04d}-{g}",reason="hw_slowdown"}}', 0))
    series = 0
    with path.open("w") as f:
        for name, rows in fams.items():
            f.write(f"# TYPE {name} gauge\n")
            for labels, value in rows:
                series += 1
                f.writelines(f"{name}{labels} {value} {t:.3f}\n" for t in times)
        f.write("# EOF\n")
    expected = {k: len(v) for k, v in odd.items()}
    expected["straggler"] = len(slow)
    expected["series"] = series
    return expected


def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    return time.perf_counter() - t0, p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    for tool in ("promtool", "prometheus"):
        if shutil.which(tool) is None:
            print(f"{tool} not installed (apt-get install prometheus)", file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-fleet-bench-"))
    prom: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.perf_counter()
        now = time.time() - 15
        expected = write_openmetrics(tmp / "fleet.om", a.nodes, now)
        gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        data = tmp / "data"
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics",
                        str(tmp / "fleet.om"), str(data)], check=True, capture_output=True,
                       timeout=900)
        backfill = time.perf_counter() - t0
        (tmp / "fleet.om").unlink()
        port = free_port()
        (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 1m\n")
        log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - owned by the process
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={data}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or prom.poll() is not None:
                print((tmp / "prometheus.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.2)
        check = [PY, "-m", "tunerd.cli.main", "--json", "fleet", "check", "--prometheus", url,
                 "--window", "5m"]
        base = [PY, "-m", "tunerd.cli.main", "--version"]
        timed(check)  # warm-up: Prometheus' caches, the page cache
        checks, bases = [], []
        result = None
        for _ in range(a.rounds):
            t, p = timed(check)
            assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
            result = json.loads(p.stdout)
            checks.append(t)
            t, p = timed(base)
            bases.append(t)
        assert result is not None
        found: dict[str, int] = {}
        for f in result["findings"]:
            found[f["key"]] = found.get(f["key"], 0) + 1
        med, bmed = statistics.median(checks), statistics.median(bases)
        out = {"nodes": result["nodes"], "series": expected["series"],
               "samples_per_series": SAMPLES, "queries": result["queries"],
               "findings": found,
               "injected": {k: v for k, v in expected.items() if k != "series"},
               "check_median_s": round(med, 3), "check_runs_s": [round(x, 3) for x in checks],
               "baseline_version_median_s": round(bmed, 3), "ratio": round(med / bmed, 2),
               "generate_s": round(gen, 1), "backfill_s": round(backfill, 1),
               "target_s": 5.0, "loadavg": os.getloadavg()}
        print(json.dumps(out, indent=1))
        if a.json:
            a.json.write_text(json.dumps(out, indent=1) + "\n")
        ok = all(found.get(k, 0) == v for k, v in out["injected"].items())
        if not ok:
            print("findings differ from what was injected", file=sys.stderr)
        return 0 if ok and med <= 5.0 else 1
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(30)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
