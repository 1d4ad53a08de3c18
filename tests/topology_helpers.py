"""Helpers for topology/placement tests: recorded fixtures and fake sysfs trees."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import FIXTURES
from tunerd.topology import Topology, read_snapshot

TOPOLOGIES = FIXTURES / "topologies"
FIXTURE_NAMES = sorted(p.name for p in TOPOLOGIES.glob("*.json"))


def fixture(name: str) -> Topology:
    return read_snapshot(TOPOLOGIES / name)


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


def render_sysfs(topo: Topology, root: Path) -> tuple[Path, Path]:
    """Write ``topo`` as the sysfs/procfs tree the kernel would show; (sys, proc) roots.

    Used to run the real readers end to end on recorded node types: snapshot ->
    files -> read_system() must give the snapshot back.
    """
    from tunerd.base.cpulist import format_cpulist

    sysd, procd = root / "sys", root / "proc"
    write(procd, "sys/kernel/hostname", topo.hostname)
    cpu = "devices/system/cpu"
    write(sysd, f"{cpu}/online", format_cpulist(topo.cpus))
    groups = topo.l3_groups()
    for c in topo.cpus.values():
        base = f"{cpu}/cpu{c.id}"
        write(sysd, f"{base}/topology/physical_package_id", str(c.package))
        write(sysd, f"{base}/topology/die_id", "0")
        write(sysd, f"{base}/topology/core_id", str(c.core_id))
        write(sysd, f"{base}/topology/thread_siblings_list", format_cpulist(c.siblings))
        write(sysd, f"{base}/cache/index0/level", "1")
        write(sysd, f"{base}/cache/index0/shared_cpu_list", format_cpulist(c.siblings))
        if c.l3_id is not None:
            write(sysd, f"{base}/cache/index3/level", "3")
            write(sysd, f"{base}/cache/index3/shared_cpu_list", format_cpulist(groups[c.l3_id]))
    node = "devices/system/node"
    ids = sorted(topo.numa_nodes)
    write(sysd, f"{node}/online", format_cpulist(ids))
    for n in topo.numa_nodes.values():
        write(sysd, f"{node}/node{n.id}/cpulist", format_cpulist(n.cpus))
        write(sysd, f"{node}/node{n.id}/distance",
              " ".join(str(n.distances.get(m, 255)) for m in ids))
        write(sysd, f"{node}/node{n.id}/meminfo",
              f"Node {n.id} MemTotal:       {n.memory_total_bytes // 1024} kB")
    pci_links = sysd / "bus/pci/devices"
    pci_links.mkdir(parents=True, exist_ok=True)

    def pci_dev(bus: str, numa: int | None, local: frozenset[int],
                path: tuple[str, ...] = ()) -> Path:
        # under its recorded PCIe path (the bridges from the host bridge down); a
        # snapshot without one: directly under devices/ (read back as no path)
        d = sysd / "devices" / Path(*path) / bus if path else sysd / "devices" / bus
        write(d, "numa_node", str(-1 if numa is None else numa))
        write(d, "local_cpulist", format_cpulist(local))
        if not (pci_links / bus).exists():
            os.symlink(d, pci_links / bus)
        return d

    for g in topo.gpus:
        pci_dev(g.pci_bus_id, g.numa_node, g.local_cpus, g.pcie_path)
    net = sysd / "class/net"
    net.mkdir(parents=True, exist_ok=True)
    for nic in topo.nics:
        if nic.virtual or nic.pci_bus_id is None:
            d = sysd / "devices/virtual/net" / nic.name
        else:
            local = topo.numa_nodes[nic.numa_node].cpus if nic.numa_node is not None \
                else frozenset()
            dev = pci_dev(nic.pci_bus_id, nic.numa_node, local, nic.pcie_path)
            d = dev / "net" / nic.name
            d.mkdir(parents=True)
            os.symlink(dev, d / "device")
        write(d, "mtu", str(nic.mtu))
        if nic.speed_mbps:
            write(d, "speed", str(nic.speed_mbps))
        os.symlink(d, net / nic.name)
    for r in topo.rdma:  # InfiniBand / RoCE ports: /sys/class/infiniband/DEV
        ib = sysd / "class/infiniband" / r.name
        write(ib, f"ports/{r.port}/rate", f"{r.rate_gbps} Gb/sec (4X NDR)")
        write(ib, f"ports/{r.port}/link_layer", str(r.link_layer))
        if r.pci_bus_id:
            local = topo.numa_nodes[r.numa_node].cpus if r.numa_node is not None \
                else frozenset()
            dev = pci_dev(r.pci_bus_id, r.numa_node, local, r.pcie_path)
            os.symlink(dev, ib / "device")
            if r.netdev:
                write(dev / "net" / r.netdev, "dev_port", str(r.port - 1))
    return sysd, procd
