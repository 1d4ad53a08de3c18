"""Helpers for topology/placement tests: recorded fixtures and fake sysfs trees."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.helpers import FIXTURES
from tunerd import nvml
from tunerd.topology import Topology, read_snapshot

TOPOLOGIES = FIXTURES / "topologies"
FIXTURE_NAMES = sorted(p.name for p in TOPOLOGIES.glob("*.json"))


def fixture(name: str) -> Topology:
    return read_snapshot(TOPOLOGIES / name)


@contextmanager
def nvml_backend(mod: Any, why: str | None = None) -> Iterator[None]:
    """Use ``mod`` as NVML for the block, then forget it so the next user re-probes."""
    nvml.set_backend(mod, why)
    try:
        yield
    finally:
        nvml._state.update(tried=False, mod=None, reason=None)


def write(root: Path, rel: str, text: str) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")
    return p


def make_sysfs(root: Path) -> Path:
    """A small 2-socket machine in sysfs form.

    2 packages x 2 cores x 2 threads = 8 CPUs, numbered like Linux on x86
    (cpu N and N+4 are siblings); CPU 7 is offline; each package is a NUMA
    node with its own L3; core_id repeats across packages (0, 1 on each) as the
    kernel reports it. One PCI GPU-like device on node 1, one NIC on node 0
    behind a virtio child device, one virtual NIC.
    """
    sysd = root / "sys"
    cpu = "devices/system/cpu"
    write(sysd, f"{cpu}/online", "0-6")
    for c in range(8):
        pkg = (c % 4) // 2
        core = c % 2
        sib = f"{c % 4},{c % 4 + 4}"
        base = f"{cpu}/cpu{c}"
        write(sysd, f"{base}/topology/physical_package_id", str(pkg))
        write(sysd, f"{base}/topology/die_id", "0")
        write(sysd, f"{base}/topology/core_id", str(core))
        write(sysd, f"{base}/topology/thread_siblings_list", sib)
        write(sysd, f"{base}/cache/index0/level", "1")
        write(sysd, f"{base}/cache/index0/shared_cpu_list", sib)
        write(sysd, f"{base}/cache/index3/level", "3")
        l3 = "0-1,4-5" if pkg == 0 else "2-3,6-7"
        write(sysd, f"{base}/cache/index3/shared_cpu_list", l3)
    node = "devices/system/node"
    write(sysd, f"{node}/online", "0-1")
    write(sysd, f"{node}/possible", "0-3")
    for n, cpus in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        write(sysd, f"{node}/node{n}/cpulist", cpus)
        write(sysd, f"{node}/node{n}/distance", "10 21" if n == 0 else "21 10")
        write(sysd, f"{node}/node{n}/meminfo",
              f"Node {n} MemTotal:       {(n + 1) * 1024 * 1024} kB\nNode {n} MemFree: 1 kB")
    # PCI devices live under devices/pci*, bus/pci/devices has links to them
    gpu = sysd / "devices/pci0000:80/0000:80:01.0/0000:81:00.0"
    write(gpu, "numa_node", "1")
    write(gpu, "local_cpulist", "2-3,6-7")
    nicdev = sysd / "devices/pci0000:00/0000:00:03.0"
    write(nicdev, "numa_node", "0")
    (nicdev / "virtio2").mkdir(parents=True)
    links = sysd / "bus/pci/devices"
    links.mkdir(parents=True)
    os.symlink(gpu, links / "0000:81:00.0")
    os.symlink(nicdev, links / "0000:00:03.0")
    net = sysd / "class/net"
    write(sysd, "devices/virtual/net/lo/mtu", "65536")
    write(nicdev, "virtio2/net/eth0/mtu", "9000")
    write(nicdev, "virtio2/net/eth0/speed", "25000")
    os.symlink(nicdev / "virtio2", nicdev / "virtio2/net/eth0/device")
    net.mkdir(parents=True)
    os.symlink(nicdev / "virtio2/net/eth0", net / "eth0")
    os.symlink(sysd / "devices/virtual/net/lo", net / "lo")
    write(root, "proc/sys/kernel/hostname", "fakehost")
    return sysd
