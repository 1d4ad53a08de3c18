"""A test fleet: real daemons in their own network namespaces, one real Prometheus.

    monitor ns:  br0 10.77.0.1/24 ── Prometheus (127.0.0.1:9090 inside the ns)
                  │ m0   │ m1   │ m2   │ m3         (veth peers, enslaved to br0)
    node ns i:   NIC 10.77.0.(10+i)/24 ── tunerd --metrics-listen 10.77.0.(10+i):9464

Every node replays the same 2x H100 topology (one node class); the NVML recording
(tests/fixtures/nvml) gives each its driver version. Prometheus' HTTP API is only
reachable inside the monitor namespace, so clients (tunerctl, promtool, queries) run
there through ``ip netns exec``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import FIXTURES, REPO, CliResult, wait_for
from tests.host_helpers import NsDaemonProc, make_daemon, sh

TOPOLOGY = FIXTURES / "topologies" / "this-machine-2gpus.json"
NVML_550 = FIXTURES / "nvml" / "h100x2-telemetry.json"
NVML_535 = FIXTURES / "nvml" / "h100x2-driver535.json"
PROM_PORT = 9090
METRICS_PORT = 9464

QUERY_SCRIPT = r"""
import json, sys, urllib.parse, urllib.request
PORT = int(sys.argv[1])
out = []
for q in json.load(sys.stdin):
    data = urllib.parse.urlencode({"query": q}).encode()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/api/v1/query", data, timeout=10) as r:
            out.append(json.load(r))
    except urllib.error.HTTPError as e:
        out.append(json.load(e))
print(json.dumps(out))
"""


@dataclass
class Node:
    name: str
    ns: str
    nic: str
    address: str
    daemon: NsDaemonProc

    @property
    def instance(self) -> str:
        return f"{self.address}:{METRICS_PORT}"


@dataclass
class Fleet:
    mon_ns: str
    tmp: Path
    nodes: list[Node] = field(default_factory=list)
    prom: subprocess.Popen[bytes] | None = None
    namespaces: list[str] = field(default_factory=list)

    def in_monitor(self, *argv: str, input: str | None = None,
                   timeout: float = 60) -> CliResult:
        p = subprocess.run(["ip", "netns", "exec", self.mon_ns, *argv], capture_output=True,
                           text=True, input=input, timeout=timeout, cwd=REPO)
        return CliResult(p.returncode, p.stdout, p.stderr)

    def tunerctl(self, *args: str) -> CliResult:
        return self.in_monitor(sys.executable, "-m", "tunerd.cli.main", *args)

    def query(self, *exprs: str) -> list[dict[str, Any]]:
        """Prometheus' answer (status, data) to each instant query."""
        r = self.in_monitor(sys.executable, "-c", QUERY_SCRIPT, str(PROM_PORT),
                            input=json.dumps(exprs))
        assert r.rc == 0, r
        answers: list[dict[str, Any]] = json.loads(r.out)
        return answers

    def series(self, expr: str) -> list[dict[str, Any]]:
        a = self.query(expr)[0]
        assert a["status"] == "success", a
        result: list[dict[str, Any]] = a["data"]["result"]
        return result

    def prom_log(self) -> str:
        p = self.tmp / "prometheus.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def stop(self) -> None:
        if self.prom is not None:
            self.prom.terminate()
            try:
                self.prom.wait(20)
            except subprocess.TimeoutExpired:
                self.prom.kill()
                self.prom.wait()
        for n in self.nodes:
            n.daemon.cleanup()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def fleet_policy(ib_hca: str) -> str:
    # prefix syntax: matches "fab0" on some nodes and "ens1f0" on others
    return ("[policy]\nname = \"fleet-test\"\n[nccl]\nNCCL_SOCKET_IFNAME = \"fab,ens\"\n"
            f"NCCL_IB_HCA = \"{ib_hca}\"\n")


def start_fleet(specs: list[dict[str, Any]], prefix: str) -> Fleet:
    """``specs``: per node nic, mtu, ib_hca, nvml, group (and python, the job_python
    whose torch is probed: /usr/bin/python3, without torch, by default; pcie_x8: a
    sysfs tree where the replayed GPU 0's link runs at x8 of x16). Starts
    everything; waits until Prometheus has scraped every node's tunerd_node_info."""
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-fleet-"))
    tmp.chmod(0o755)
    fleet = Fleet(mon_ns=f"{prefix}-mon", tmp=tmp)
    try:
        sh("ip", "netns", "add", fleet.mon_ns)
        fleet.namespaces.append(fleet.mon_ns)
        mon = ["ip", "-n", fleet.mon_ns]
        sh(*mon, "link", "set", "lo", "up")
        sh(*mon, "link", "add", "br0", "type", "bridge")
        sh(*mon, "link", "set", "br0", "mtu", "9000")
        sh(*mon, "addr", "add", "10.77.0.1/24", "dev", "br0")
        sh(*mon, "link", "set", "br0", "up")
        for i, spec in enumerate(specs):
            ns = f"{prefix}-n{i}"
            sh("ip", "netns", "add", ns)
            fleet.namespaces.append(ns)
            nic, peer, addr = spec["nic"], f"m{i}", f"10.77.0.{10 + i}"
            sh("ip", "-n", fleet.mon_ns, "link", "add", peer, "mtu", "9000", "type", "veth",
               "peer", "name", nic, "netns", ns)
            sh(*mon, "link", "set", peer, "master", "br0")
            sh(*mon, "link", "set", peer, "up")
            node = ["ip", "-n", ns]
            sh(*node, "link", "set", "lo", "up")
            sh(*node, "link", "set", nic, "mtu", str(spec["mtu"]))
            sh(*node, "addr", "add", f"{addr}/24", "dev", nic)
            sh(*node, "link", "set", nic, "up")
            extra: dict[str, Any] = {}
            if spec.get("pcie_x8"):  # GPU 0's link trained to 8 of its 16 lanes
                sys_root = tmp / f"n{i}-sys"
                dev = sys_root / "bus/pci/devices/0000:01:00.0"
                dev.mkdir(parents=True)
                for name, value in (("current_link_width", "8"), ("max_link_width", "16"),
                                    ("current_link_speed", "16.0 GT/s PCIe"),
                                    ("max_link_speed", "16.0 GT/s PCIe")):
                    (dev / name).write_text(value + "\n")
                extra["sys_root"] = sys_root
            d = make_daemon(tmp / f"n{i}", fleet_policy(spec["ib_hca"]), ns=ns, **extra,
                            sample_interval=0.5, job_python=Path(spec.get("python",
                                                                         "/usr/bin/python3")),
                            debug_nvml_replay=spec["nvml"],
                            apply_host_settings=True)  # its nccl.conf: a temp etc_root
            d.extra_args += ["--topology", str(TOPOLOGY),
                             "--metrics-listen", f"{addr}:{METRICS_PORT}"]
            fleet.nodes.append(Node(f"n{i}", ns, nic, addr, d))
        t0 = time.monotonic()
        for n in fleet.nodes:
            n.daemon.start(wait=False)
        targets = "".join(
            f"      - targets: ['{n.instance}']\n        labels: {{group: '{s['group']}'}}\n"
            for n, s in zip(fleet.nodes, specs, strict=True))
        # the shipped fleet rules, with their 5m windows shortened to fit a test
        rules = (REPO / "contrib/prometheus/tunerd-fleet.yml").read_text()
        (tmp / "tunerd-fleet.yml").write_text(rules.replace("[5m]", "[5s]"))
        (tmp / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: [{tmp / 'tunerd-fleet.yml'}]\n"
            "scrape_configs:\n  - job_name: tunerd\n    static_configs:\n" + targets)
        log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - owned by the process
        prom = shutil.which("prometheus")
        assert prom is not None
        fleet.prom = subprocess.Popen(
            ["ip", "netns", "exec", fleet.mon_ns, prom,
             f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{PROM_PORT}"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        for n in fleet.nodes:
            n.daemon.wait_ready(60)
        print(f"\n{len(specs)} daemons ready in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()

        def all_scraped() -> bool:
            try:
                got = fleet.series("count(tunerd_node_info)")
            except (AssertionError, ValueError):
                return False
            return bool(got) and int(got[0]["value"][1]) == len(specs)

        wait_for(all_scraped, 90, "Prometheus to scrape every node's tunerd_node_info",
                 interval=0.5, detail=lambda: fleet.prom_log() + "\n".join(
                     n.daemon.log()[-1500:] for n in fleet.nodes))
        print(f"fleet up {time.monotonic() - t0:.1f} s after Prometheus started")
    except BaseException:
        fleet.stop()
        raise
    return fleet
