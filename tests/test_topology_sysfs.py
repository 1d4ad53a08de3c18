"""The sysfs reader: exact values on a recorded tree, and agreement with lscpu here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.topology_helpers import make_sysfs
from tunerd.adapters import nvml
from tunerd.topology import read_system
from tunerd.topology.sysfs import (
    normalize_bus_id,
    pci_locality,
    read_cpus,
    read_nics,
    read_numa_nodes,
)


def test_cpus_cores_and_l3_from_recorded_tree(tmp_path: Path) -> None:
    sysd = make_sysfs(tmp_path)
    cpus = read_cpus(sysd)
    assert sorted(cpus) == [0, 1, 2, 3, 4, 5, 6]  # cpu7 is offline
    # core_id repeats per package; the global id must not
    assert len({c.core_id for c in cpus.values()}) == 4
    assert cpus[0].core_id == cpus[4].core_id != cpus[2].core_id
    assert cpus[2].package == 1 and cpus[2].numa_node == 1
    assert cpus[0].siblings == frozenset({0, 4})
    assert cpus[3].siblings == frozenset({3})  # sibling 7 is offline
    assert cpus[0].l3_id == cpus[5].l3_id != cpus[6].l3_id


def test_numa_nodes_memory_and_distances(tmp_path: Path) -> None:
    sysd = make_sysfs(tmp_path)
    nodes = read_numa_nodes(sysd, frozenset(read_cpus(sysd)))
    assert sorted(nodes) == [0, 1]
    assert nodes[1].cpus == frozenset({2, 3, 6})
    assert nodes[0].memory_total_bytes == 1024 * 1024 * 1024
    assert nodes[1].memory_total_bytes == 2 * 1024 * 1024 * 1024
    assert nodes[0].distances == {0: 10, 1: 21}


def test_pci_locality_and_bus_id_forms(tmp_path: Path) -> None:
    sysd = make_sysfs(tmp_path)
    assert normalize_bus_id("00000000:81:00.0") == "0000:81:00.0"
    assert normalize_bus_id("0000:1B:00.0") == "0000:1b:00.0"
    assert pci_locality("00000000:81:00.0", sysd) == (1, frozenset({2, 3, 6, 7}))
    assert pci_locality("0000:99:00.0", sysd) == (None, None)


def test_nics_walk_up_to_the_pci_function(tmp_path: Path) -> None:
    sysd = make_sysfs(tmp_path)
    nics = {n.name: n for n in read_nics(sysd)}
    eth = nics["eth0"]
    assert (eth.pci_bus_id, eth.numa_node, eth.speed_mbps, eth.mtu, eth.virtual) == (
        "0000:00:03.0", 0, 25000, 9000, False)
    assert nics["lo"].virtual and nics["lo"].pci_bus_id is None


def test_read_system_on_recorded_tree_without_driver(tmp_path: Path) -> None:
    sysd = make_sysfs(tmp_path)
    with nvml.use_backend(None, "no NVIDIA driver (test)"):
        topo = read_system(sysd, tmp_path / "proc")
    assert topo.hostname == "fakehost"
    assert topo.gpus == [] and topo.links == {}
    assert topo.note is not None and "no NVIDIA driver (test)" in topo.note
    assert not topo.replayed


def test_missing_sysfs_degrades_to_one_node(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    nodes = read_numa_nodes(tmp_path / "sys", frozenset({0}), tmp_path / "proc")
    assert list(nodes) == [0] and nodes[0].distances == {0: 10}


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="needs util-linux lscpu")
def test_this_machine_agrees_with_lscpu() -> None:
    """The real /sys of this machine, checked against util-linux's own reading."""
    out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True,
                         text=True, check=True).stdout
    rows = [line.split(",") for line in out.splitlines() if not line.startswith("#")]
    with nvml.use_backend(None, "not asked"):
        topo = read_system()
    online = {int(r[0]) for r in rows}
    assert topo.online_cpus() == online
    for r in rows:
        cpu = topo.cpus[int(r[0])]
        assert cpu.package == int(r[2] or 0)
        assert cpu.numa_node == int(r[3] or 0)
    # lscpu's core numbers are global too: same partition of CPUs into cores
    by_lscpu = {frozenset(int(r[0]) for r in rows if r[1] == core) for core in {r[1] for r in rows}}
    assert set(topo.cores().values()) == by_lscpu
