"""Read CPUs, cores, caches, NUMA nodes, PCI locality and NICs from sysfs.

Roots are arguments (``sys_root="/sys"``) so tests read recorded trees. Reads
degrade: a missing file gives a default, never an exception, because containers
and VMs hide parts of sysfs (e.g. no ``cache/`` on some hypervisors).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tunerd.adapters.procfs import read_value
from tunerd.base.cpulist import CpuListError, parse_cpulist
from tunerd.topology.model import Cpu, Nic, NumaNode, RdmaDevice

__all__ = [
    "normalize_bus_id",
    "pci_locality",
    "pcie_path",
    "read_cpus",
    "read_nics",
    "read_numa_nodes",
    "read_rdma",
]

_PCI_ADDR = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")



def _read_int(path: Path) -> int | None:
    s = read_value(path)
    try:
        return int(s) if s is not None else None
    except ValueError:
        return None


def _read_cpulist(path: Path) -> frozenset[int] | None:
    s = read_value(path)
    if s is None:
        return None
    try:
        return parse_cpulist(s)
    except CpuListError:
        return None


def normalize_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` -> sysfs's ``0000:18:00.0`` (lowercase, 4-digit domain)."""
    s = bus_id.strip().lower()
    dom, sep, rest = s.partition(":")
    if not sep:
        return s
    try:
        return f"{int(dom, 16):04x}:{rest}"
    except ValueError:
        return s


def online_cpus(sys_root: Path) -> frozenset[int]:
    cpu_dir = sys_root / "devices/system/cpu"
    online = _read_cpulist(cpu_dir / "online")
    if online is not None:
        return online
    # very old kernels / odd containers: every cpuN directory counts
    return frozenset(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*") if p.name[3:].isdigit())


def _cpu_nodes(sys_root: Path) -> dict[int, int]:
    """CPU -> NUMA node, from node*/cpulist."""
    out: dict[int, int] = {}
    for node_dir in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        cpus = _read_cpulist(node_dir / "cpulist") or frozenset()
        for c in cpus:
            out[c] = int(node_dir.name[4:])
    return out


def read_cpus(sys_root: Path = Path("/sys")) -> dict[int, Cpu]:
    """Every online CPU with its global core id, package, NUMA node and L3 group."""
    cpu_dir = sys_root / "devices/system/cpu"
    node_of = _cpu_nodes(sys_root)
    raw: dict[int, tuple[int, int, int, frozenset[int], frozenset[int] | None]] = {}
    for cpu in sorted(online_cpus(sys_root)):
        d = cpu_dir / f"cpu{cpu}"
        topo = d / "topology"
        package = _read_int(topo / "physical_package_id")
        package = 0 if package is None or package < 0 else package
        die = _read_int(topo / "die_id") or 0
        core = _read_int(topo / "core_id")
        core = cpu if core is None else core
        siblings = (_read_cpulist(topo / "thread_siblings_list")
                    or _read_cpulist(topo / "core_cpus_list") or frozenset({cpu}))
        l3: frozenset[int] | None = None
        for idx in sorted((d / "cache").glob("index[0-9]*")):
            if _read_int(idx / "level") == 3:
                l3 = _read_cpulist(idx / "shared_cpu_list")
                break
        raw[cpu] = (package, die, core, siblings, l3)

    # core_id is only unique inside a package (and die): number (package, die, core)
    # keys densely, in the order of their lowest CPU, to get a global id. The core's
    # first SMT thread is part of the key: arm64 kernels without a package id (-1) can
    # repeat core_id across sockets, and CPUs that are not siblings are never one core
    def key(cpu: int) -> tuple[int, int, int, int]:
        package, die, core, siblings, _ = raw[cpu]
        return (package, die, core, min(siblings & raw.keys(), default=cpu))

    first_cpu: dict[tuple[int, int, int, int], int] = {}
    for cpu in sorted(raw):
        first_cpu.setdefault(key(cpu), cpu)
    core_ids = {k: i for i, k in enumerate(sorted(first_cpu, key=first_cpu.__getitem__))}
    l3_sets = sorted({r[4] for r in raw.values() if r[4]}, key=min)
    l3_ids = {s: i for i, s in enumerate(l3_sets)}
    out: dict[int, Cpu] = {}
    for cpu, (package, _die, _core, siblings, l3) in raw.items():
        out[cpu] = Cpu(
            id=cpu, core_id=core_ids[key(cpu)], package=package,
            numa_node=node_of.get(cpu, 0), l3_id=l3_ids.get(l3) if l3 else None,
            siblings=frozenset(s for s in siblings if s in raw) or frozenset({cpu}),
        )
    return out


def read_numa_nodes(sys_root: Path = Path("/sys"), cpus: frozenset[int] | None = None,
                    proc_root: Path = Path("/proc")) -> dict[int, NumaNode]:
    """NUMA nodes with their (online) CPUs, memory and SLIT distances.

    Without ``/sys/devices/system/node`` (CONFIG_NUMA=n) the machine is one node 0.
    """
    node_root = sys_root / "devices/system/node"
    out: dict[int, NumaNode] = {}
    dirs = sorted(node_root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    ids = [int(p.name[4:]) for p in dirs]
    for d, nid in zip(dirs, ids, strict=True):
        node_cpus = _read_cpulist(d / "cpulist") or frozenset()
        if cpus is not None:
            node_cpus &= cpus
        mem = 0
        meminfo = read_value(d / "meminfo") or ""
        m = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo)
        if m:
            mem = int(m.group(1)) * 1024
        dist: dict[int, int] = {}
        dist_s = read_value(d / "distance")
        if dist_s:
            # one value per *online* node, in node order (drivers/base/node.c,
            # node_read_distance: for_each_online_node)
            vals = [int(x) for x in dist_s.split() if x.isdigit()]
            online = sorted(_read_cpulist(node_root / "online") or frozenset(ids))
            if len(online) != len(vals):
                online = ids
            dist = {n: v for n, v in zip(online, vals, strict=False) if n in ids}
        out[nid] = NumaNode(id=nid, cpus=node_cpus, memory_total_bytes=mem,
                            distances=dist or {nid: 10})
    if not out:
        all_cpus = cpus if cpus is not None else online_cpus(sys_root)
        out[0] = NumaNode(id=0, cpus=all_cpus, memory_total_bytes=_mem_total(proc_root),
                          distances={0: 10})
    return out


def _mem_total(proc_root: Path) -> int:
    m = re.search(r"MemTotal:\s+(\d+)\s*kB", read_value(proc_root / "meminfo") or "")
    return int(m.group(1)) * 1024 if m else 0


def pci_locality(bus_id: str, sys_root: Path = Path("/sys")
                 ) -> tuple[int | None, frozenset[int] | None]:
    """(NUMA node, local CPUs) of a PCI device, from its sysfs directory.

    ``numa_node`` is -1 when the firmware gives no proximity (single-node machines,
    many VMs): that is reported as None.
    """
    d = sys_root / "bus/pci/devices" / normalize_bus_id(bus_id)
    node = _read_int(d / "numa_node")
    return (node if node is not None and node >= 0 else None,
            _read_cpulist(d / "local_cpulist"))


def _pci_parent(dev: Path) -> Path | None:
    """The PCI function a (possibly virtio / usb) device hangs off, walking up."""
    try:
        p = dev.resolve()
    except OSError:
        return None
    for q in (p, *p.parents):
        if _PCI_ADDR.match(q.name):
            return q
    return None


def _path_above(real: Path) -> tuple[str, ...]:
    """The PCIe bridges above the PCI function at ``real`` (its resolved sysfs dir):
    the host bridge (``pci0000:15``) first, the device itself left out."""
    out: list[str] = []
    for part in real.parent.parts:
        if part.startswith("pci") and ":" in part:
            out = [part]  # a host bridge starts the path (nothing above it counts)
        elif out and _PCI_ADDR.match(part):
            out.append(part)
    return tuple(out)


def pcie_path(bus_id: str, sys_root: Path = Path("/sys")) -> tuple[str, ...]:
    """The chain of bridges from the host bridge down to PCI device ``bus_id``, from
    sysfs's real device path (``/sys/devices/pci0000:15/0000:15:01.0/.../0000:18:00.0``);
    () when sysfs does not have it."""
    try:
        real = (sys_root / "bus/pci/devices" / normalize_bus_id(bus_id)).resolve(strict=True)
    except OSError:
        return ()
    return _path_above(real)


def read_rdma(sys_root: Path = Path("/sys")) -> list[RdmaDevice]:
    """InfiniBand / RoCE ports (/sys/class/infiniband/DEV/ports/N) with their netdev."""
    out: list[RdmaDevice] = []
    root = sys_root / "class/infiniband"
    try:
        names = sorted(os.listdir(root), key=_natural)
    except OSError:
        return out
    for name in names:
        d = root / name
        pci = _pci_parent(d / "device") if (d / "device").exists() else None
        node: int | None = None
        if pci is not None:
            n = _read_int(pci / "numa_node")
            node = n if n is not None and n >= 0 else None
        netdevs: list[tuple[int, str]] = []
        try:
            for nd in sorted(os.listdir(d / "device/net")):
                netdevs.append((_read_int(d / "device/net" / nd / "dev_port") or 0, nd))
        except OSError:
            pass
        try:
            ports = sorted(int(p) for p in os.listdir(d / "ports") if p.isdigit())
        except OSError:
            ports = [1]
        for port in ports:
            pd = d / "ports" / str(port)
            rate = re.match(r"\s*(\d+)", read_value(pd / "rate") or "")
            # a port's netdev: the one whose dev_port is port - 1, or the only one
            netdev = next((nd for dp, nd in netdevs if dp == port - 1), None)
            if netdev is None and len(netdevs) == 1:
                netdev = netdevs[0][1]
            out.append(RdmaDevice(
                name=name, port=port, netdev=netdev,
                pci_bus_id=pci.name if pci else None, numa_node=node,
                link_layer=read_value(pd / "link_layer"),
                rate_gbps=int(rate.group(1)) if rate else None,
                pcie_path=_path_above(pci) if pci else ()))
    return out


def _natural(name: str) -> tuple[str, int]:
    m = re.match(r"(.*?)(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)


def read_nics(sys_root: Path = Path("/sys")) -> list[Nic]:
    """Network interfaces; virtual ones (lo, bridges, veth, ifb...) are marked virtual."""
    out: list[Nic] = []
    net = sys_root / "class/net"
    try:
        names = sorted(os.listdir(net))
    except OSError:
        return out
    for name in names:
        d = net / name
        dev = d / "device"
        virtual = not dev.exists()
        pci = _pci_parent(dev) if not virtual else None
        node: int | None = None
        if pci is not None:
            n = _read_int(pci / "numa_node")
            node = n if n is not None and n >= 0 else None
        speed = _read_int(d / "speed")  # EINVAL while the link is down
        out.append(Nic(name=name, numa_node=node, pci_bus_id=pci.name if pci else None,
                       speed_mbps=speed if speed is not None and speed > 0 else None,
                       mtu=_read_int(d / "mtu"), virtual=virtual,
                       pcie_path=_path_above(pci) if pci else ()))
    return out
