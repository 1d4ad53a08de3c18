"""The NVML reader, run on recorded GPUs through the replay backend (the one fake)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.topology_helpers import FIXTURE_NAMES, fixture, make_sysfs
from tunerd.adapters import nvml
from tunerd.topology import Topology
from tunerd.topology.gpu import read_gpus
from tunerd.topology.nvml_replay import ReplayDevice, ReplayNvml

GPU_FIXTURES = [n for n in FIXTURE_NAMES if fixture(n).gpus]


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_reader_recovers_recorded_gpus_and_links(tmp_path: Path, name: str) -> None:
    rec = fixture(name)
    with nvml.use_backend(ReplayNvml(rec)):
        gpus, links, note = read_gpus(tmp_path, ncpus=max(rec.cpus) + 1)
    assert note is None
    assert [g.pci_bus_id for g in gpus] == [g.pci_bus_id for g in rec.gpus]
    assert [g.model for g in gpus] == [g.model for g in rec.gpus]
    assert [g.uuid for g in gpus] == [g.uuid for g in rec.gpus]
    assert [g.memory_total_bytes for g in gpus] == [g.memory_total_bytes for g in rec.gpus]
    # no sysfs entry for these bus ids here: local CPUs come from nvmlDeviceGetCpuAffinity
    assert [g.local_cpus for g in gpus] == [g.local_cpus for g in rec.gpus]
    assert [g.memory_numa_nodes for g in gpus] == [g.memory_numa_nodes for g in rec.gpus]
    assert links == rec.links


def test_sysfs_locality_wins_over_nvml_affinity(tmp_path: Path) -> None:
    sysd = make_sysfs(tmp_path)
    rec = fixture("workstation.json")
    g = dataclasses.replace(rec.gpus[0], pci_bus_id="0000:81:00.0")
    topo = Topology(hostname="x", gpus=[g])
    with nvml.use_backend(ReplayNvml(topo)):
        gpus, _, _ = read_gpus(sysd)
    assert gpus[0].numa_node == 1
    assert gpus[0].local_cpus == frozenset({2, 3, 6, 7})  # not the recorded 0-31


def test_nvswitch_and_direct_nvlinks_are_counted() -> None:
    rec = fixture("pcie-8gpu.json")
    # bridge GPUs 0-1 with 4 direct NVLinks (like an NVLink bridge on PCIe cards)
    links = dict(rec.links)
    links[(0, 1)] = dataclasses.replace(links[(0, 1)], kind="NVLINK", nvlinks=4)
    topo = dataclasses.replace(rec, links=links, _cache={})
    with nvml.use_backend(ReplayNvml(topo)):
        _, got, _ = read_gpus(Path("/nonexistent"))
    assert got[(0, 1)].label == "NV4" and got[(0, 1)].pcie == "PIX"
    assert got[(0, 2)].label == rec.links[(0, 2)].label


def test_mig_gpus_are_reported(tmp_path: Path) -> None:
    rec = fixture("dgx-h100.json")
    migs = ({"index": 0, "uuid": "MIG-aaaa", "gpu_instance_id": 1, "compute_instance_id": 0,
             "memory_total_bytes": 10 << 30},
            {"index": 1, "uuid": "MIG-bbbb", "gpu_instance_id": 2, "compute_instance_id": 0,
             "memory_total_bytes": 10 << 30})
    gpus = [dataclasses.replace(rec.gpus[0], mig_enabled=True, mig_devices=migs), *rec.gpus[1:]]
    topo = dataclasses.replace(rec, gpus=gpus, _cache={})
    with nvml.use_backend(ReplayNvml(topo)):
        got, links, _ = read_gpus(tmp_path)
    assert got[0].mig_enabled and [m["uuid"] for m in got[0].mig_devices] == ["MIG-aaaa",
                                                                              "MIG-bbbb"]
    assert not got[1].mig_enabled and got[1].mig_devices == ()
    assert len(links) == 28


def test_no_driver_means_no_gpus_and_a_note(tmp_path: Path) -> None:
    with nvml.use_backend(None, "NVML could not start: driver not loaded"):
        gpus, links, note = read_gpus(tmp_path)
    assert gpus == [] and links == {}
    assert note == "no GPUs: NVML could not start: driver not loaded"


def test_real_nvml_probe_here_never_crashes(tmp_path: Path) -> None:
    """On this machine (no driver) the real pynvml path must degrade, not raise."""
    with nvml.use_backend(None):
        pass  # forget any earlier backend so the real probe runs
    gpus, _, note = read_gpus(tmp_path)
    assert gpus or note


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_real_readers_reproduce_every_recorded_node(tmp_path: Path, name: str) -> None:
    """snapshot -> sysfs tree + NVML replay -> read_system() gives the snapshot back."""
    from tests.topology_helpers import render_sysfs
    from tunerd.topology import read_system

    rec = fixture(name)
    sysd, procd = render_sysfs(rec, tmp_path)
    with nvml.use_backend(ReplayNvml(rec)):
        got = read_system(sysd, procd)
    a, b = got.to_json(), rec.to_json()
    for key in ("hostname", "cpus", "numa_nodes", "gpus", "links"):
        assert a[key] == b[key], key
    assert a.get("rdma") == b.get("rdma")  # InfiniBand/RoCE ports, their netdevs and paths
    assert sorted(a["nics"], key=lambda n: n["name"]) == sorted(b["nics"],
                                                                key=lambda n: n["name"])


class _OldDriverDevice(ReplayDevice):
    """A GPU as a pre-r470 driver answers: the remote device type is not available."""

    def nvlink_remote_device_type(self, link: int) -> nvml.NaOr[int]:
        return nvml.NA


class _OldDriverReplay(ReplayNvml):
    device_class = _OldDriverDevice


def test_nvswitch_links_found_without_remote_device_type(tmp_path: Path) -> None:
    rec = fixture("dgx-h100.json")
    with nvml.use_backend(_OldDriverReplay(rec)):
        gpus, links, _ = read_gpus(tmp_path)
    assert [g.nvswitch_links for g in gpus] == [18] * 8
    assert {lk.label for lk in links.values()} == {"NV18"}
