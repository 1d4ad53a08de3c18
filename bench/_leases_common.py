"""Shared by bench/autobind.py and bench/exec_overhead.py: a real tunerd in a temp dir."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rfind(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values) if values else float("nan"),
            "p95": pct(values, 95), "p99": pct(values, 99), "max": max(values, default=0.0)}


class Daemon:
    """tunerd with a policy (and optionally a topology snapshot), stopped on exit."""

    def __init__(self, policy: str, topology: Path | None = None,
                 state_dir: Path | None = None, root: Path | None = None) -> None:
        # root: where the runtime and state dirs go (e.g. /dev/shm for tmpfs)
        self.tmp = Path(tempfile.mkdtemp(prefix="tunerd-bench-", dir=root))
        self.tmp.chmod(0o755)
        self.state_dir = state_dir or self.tmp / "state"
        (self.tmp / "pol").mkdir()
        (self.tmp / "pol" / "00-bench.toml").write_text(policy)
        self.socket = self.tmp / "run" / "tunerd.sock"
        argv = [sys.executable, "-m", "tunerd.daemon.main", "--policy-dir",
                str(self.tmp / "pol"), "--runtime-dir", str(self.tmp / "run"), "--state-dir",
                str(self.state_dir), "--metrics-listen", "off", "--log-level", "warning"]
        if topology is not None:
            argv += ["--topology", str(topology)]
        self.log = open(self.tmp / "log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.tmp / "log").read_text())
            time.sleep(0.05)
        from tunerd.client import Client

        Client(str(self.socket)).call("status")
        time.sleep(0.5)  # services started

    def status(self) -> dict[str, Any]:
        from tunerd.client import Client

        with Client(str(self.socket)) as c:
            out: dict[str, Any] = c.call("status")
            return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(15)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def snapshot_with_gpus_here(path: Path) -> tuple[Path, int, int]:
    """This machine's topology + two recorded GPUs local to its first and last CPU."""
    from tunerd.topology import load_topology

    j = load_topology().to_json()
    cpus = sorted(c["id"] for c in j["cpus"])
    lo, hi = cpus[0], cpus[-1]
    node = next(c["numa_node"] for c in j["cpus"] if c["id"] == lo)
    fx = REPO / "tests" / "fixtures" / "topologies" / "dgx-h100.json"
    tmpl = json.loads(fx.read_text())["gpus"][0]
    j["gpus"] = [{**tmpl, "index": i, "uuid": f"GPU-bench-{i}",
                  "pci_bus_id": f"0000:{i + 1:02x}:00.0", "numa_node": node,
                  "local_cpus": str(c)} for i, c in enumerate((lo, hi))]
    j["links"] = [{"a": 0, "b": 1, "kind": "NVLINK", "nvlinks": 18, "pcie": "NODE"}]
    path.write_text(json.dumps(j))
    return path, lo, hi


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2))
