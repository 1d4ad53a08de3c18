"""`tunerctl topology` against the real daemon (replaying a snapshot) and without one."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_ctl
from tests.topology_helpers import TOPOLOGIES
from tunerd.topology import load_topology


def test_daemon_replays_snapshot_for_the_cli(daemon_factory, tmp_path: Path) -> None:
    d = daemon_factory(args=["--topology", str(TOPOLOGIES / "dgx-h100.json")]).start()
    r = d.ctl("topology")
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == "dgx-h100 (replayed snapshot)"
    assert lines[1] == "2 sockets, 112 cores / 224 CPUs, 2 NUMA nodes, 8 x NVIDIA H100 80GB HBM3"
    gpu0 = next(line for line in lines if line.startswith("GPU0 "))
    assert gpu0.split() == ["GPU0", "X", *["NV18"] * 7, "0-55,112-167", "0"]
    assert any(line.startswith("NUMA node 1: CPUs 56-111,168-223 (112)") for line in lines)
    assert any(line.startswith("ibp24s0") for line in lines)
    assert max(len(line) for line in lines) <= 80

    r = d.ctl("--json", "topology")
    assert r.rc == 0
    got = r.json()
    want = json.loads((TOPOLOGIES / "dgx-h100.json").read_text())
    assert got["gpus"] == want["gpus"] and got["links"] == want["links"]
    assert got["replayed"] is True

    out = tmp_path / "node.json"
    r = d.ctl("topology", "--save", str(out))
    assert r.rc == 0 and f"to {out}" in r.err
    assert load_topology(out).to_json() == load_topology(TOPOLOGIES / "dgx-h100.json").to_json()


def test_without_daemon_reads_this_machine(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"
    out = tmp_path / "here.json"
    r = run_ctl("--socket", str(sock), "topology", "--save", str(out))
    assert r.rc == 0, r.err
    assert "not reachable" in r.err and "reading this machine's topology directly" in r.err
    assert r.out.splitlines()[0].endswith("[read locally]")
    topo = load_topology(out)
    import os
    assert topo.online_cpus() == frozenset(os.sched_getaffinity(0)) | topo.online_cpus()
    assert len(topo.cpus) == os.cpu_count()


def test_save_to_unwritable_place_fails_cleanly(tmp_path: Path) -> None:
    r = run_ctl("--socket", str(tmp_path / "none.sock"), "topology", "--local",
                "--save", str(tmp_path / "no/such/dir/x.json"))
    assert r.rc == 1
    assert "cannot write" in r.err and "no/such/dir/x.json" in r.err


def test_daemon_refuses_a_bad_snapshot(daemon_factory, tmp_path: Path) -> None:
    import subprocess

    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "tunerd.topology/1", "hostname": "x", "cpus": [{"id": "a"}]}')
    d = daemon_factory(args=["--topology", str(bad)])
    p = subprocess.run(d.argv(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert str(bad) in p.stderr and "$.cpus[0].id" in p.stderr
    assert "Traceback" not in p.stderr


def test_render_pcie_matrix_and_memory_nodes() -> None:
    from tunerd.topology.render import render

    text = render(json.loads((TOPOLOGIES / "pcie-8gpu.json").read_text()))
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith("GPU") and "Tesla" not in line}
    assert rows["GPU0"][1:9] == ["X", "PIX", "PXB", "PXB", "SYS", "SYS", "SYS", "SYS"]
    assert rows["GPU6"][1:9] == ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X", "PIX"]
    assert max(len(line) for line in text.splitlines()) <= 80

    gh = render(json.loads((TOPOLOGIES / "gh200.json").read_text()))
    assert "NUMA node 1: GPU0 memory" in gh
    assert "memory on NUMA node 1" in gh


def test_cli_path_stays_light() -> None:
    """tunerctl must start fast: rendering a daemon reply imports no NVML/psutil/rich."""
    import subprocess
    import sys

    from tests.helpers import REPO

    code = ("import sys, tunerd.cli.cmd_topology, tunerd.topology.render, tunerd.jobs.placement; "
            "print(sorted(m for m in ('pynvml', 'psutil', 'rich', 'pyudev') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
