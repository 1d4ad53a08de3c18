"""Shared by the bench scripts: a real tunerd in a temp dir, stopped whatever happens;
the CPU a process used, read from outside; latency summaries; the bundled torch rule
narrowed to one benchmark's processes."""

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

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat (fields 14 and 15). The kernel adds
    the time of every thread that exited to these, so threads that came and went between
    two reads (a scrape's thread) are counted; the resolution is one clock tick."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rfind(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def task_ns(pid: int) -> int:
    """CPU nanoseconds of the threads of ``pid`` alive now (the first field of each
    /proc/PID/task/TID/schedstat): finer than :func:`cpu_seconds`, but the time of a
    thread that exited before the read is not in the sum."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values) if values else float("nan"),
            "p95": pct(values, 95), "p99": pct(values, 99), "max": max(values, default=0.0)}


def _toml(v: Any) -> str:
    """A TOML value: JSON's strings, arrays, numbers and booleans are TOML's too."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def bundled_torch_rule(token: str, name: str = "bench") -> str:
    """A policy holding the torch-training [[job]] rule of policies/00-base.toml, whole, and
    nothing else of 00-base.toml (its host settings are not a benchmark's to change),
    narrowed to processes whose environment has ``TUNERD_BENCH_TOKEN=token``: on a
    shared machine the bundled rule alone would bind other people's training jobs."""
    data = tomllib.loads((REPO / "policies" / "00-base.toml").read_text())
    [rule] = [r for r in data.get("job", []) if r["name"] == "torch-training"]
    rule["match"]["env"] = {**rule["match"].get("env", {}), "TUNERD_BENCH_TOKEN": token}
    lines = ["[policy]", f"name = {_toml(name)}", "", "[[job]]"]
    lines += [f"{k} = {_toml(v)}" for k, v in rule.items()]
    return "\n".join(lines) + "\n"


class Daemon:
    """tunerd with a policy (and optionally a topology snapshot), in a temporary dir.

    Use it as ``with Daemon(...) as d:`` or call :meth:`stop` in a ``finally``: it is
    a root process. A daemon that does not come up is stopped before the error is
    raised. ``metrics`` is --metrics-listen (``127.0.0.1:0``: a free port, see
    :meth:`metrics_url`).
    """

    def __init__(self, policy: str, topology: Path | None = None,
                 state_dir: Path | None = None, root: Path | None = None,
                 metrics: str = "off", config: str | None = None) -> None:
        # root: where the runtime and state dirs go (e.g. /dev/shm for tmpfs)
        self.tmp = Path(tempfile.mkdtemp(prefix="tunerd-bench-", dir=root))
        self.tmp.chmod(0o755)
        self.state_dir = state_dir or self.tmp / "state"
        (self.tmp / "pol").mkdir()
        (self.tmp / "pol" / "00-bench.toml").write_text(policy)
        self.socket = self.tmp / "run" / "tunerd.sock"
        argv = [sys.executable, "-m", "tunerd.daemon.main", "--policy-dir",
                str(self.tmp / "pol"), "--runtime-dir", str(self.tmp / "run"), "--state-dir",
                str(self.state_dir), "--metrics-listen", metrics, "--log-level", "warning",
                # scoped: binds only what this bench started, takes no node lock (two
                # daemons of one bench run side by side)
                "--scope-pid", str(os.getpid())]
        if topology is not None:
            argv += ["--topology", str(topology)]
        if config is not None:  # tunerd.toml text
            (self.tmp / "tunerd.toml").write_text(config)
            argv += ["--config", str(self.tmp / "tunerd.toml")]
        self.log = open(self.tmp / "log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        from tunerd.wire.client import Client

        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tunerd did not start:\n" + (self.tmp / "log").read_text())
            time.sleep(0.05)
        from tunerd.base.errors import DaemonUnreachable

        while True:  # the socket file is there a moment before the daemon listens
            try:
                Client(str(self.socket)).call("status")
                break
            except DaemonUnreachable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        time.sleep(0.5)  # services started

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict[str, Any]:
        from tunerd.wire.client import Client

        with Client(str(self.socket)) as c:
            out: dict[str, Any] = c.call("status")
            return out

    def bind(self, pid: int, cpus: str) -> None:
        """``tunerctl bind PID --cpus CPUS``, through the client library."""
        from tunerd.wire.client import Client

        with Client(str(self.socket)) as c:
            c.call("bind", pid=pid, cpus=cpus)

    def metrics_url(self, timeout: float = 10.0) -> str:
        """http://HOST:PORT/metrics where the daemon listens: status' services.monitor
        has the port it bound (metrics_port; 127.0.0.1:0 asks for any free one) and
        metrics_address, that port with its host."""
        deadline = time.monotonic() + timeout
        while True:
            monitor = self.status()["services"]["monitor"]
            if monitor.get("metrics_port"):
                return f"http://{monitor['metrics_address']}/metrics"
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon's metrics endpoint is not up: "
                                   f"{monitor.get('metrics_error')}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, SIGKILL if it is still there after 15 s; then remove its dirs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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
