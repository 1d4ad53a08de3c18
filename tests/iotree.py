"""Recorded /sys + /proc/irq trees built from a topology snapshot (tests/fixtures/topologies).

Every PCI device of the snapshot (GPUs, NICs, RDMA ports) gets its real sysfs
directory under its PCIe path (``sys/devices/pci0000:15/0000:15:01.0/...``) with
``numa_node``, ``local_cpulist`` and ``msi_irqs/N``, the ``bus/pci/devices`` link,
``class/net`` and ``class/infiniband`` entries; each MSI-X vector gets
``proc/irq/N/smp_affinity`` (every CPU) and a ``proc/interrupts`` line.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from tunerd.base.cpulist import format_cpulist
from tunerd.topology.model import Topology
from tunerd.tuners.irq import format_mask


def config_space(acs_ctl: int | None = None, relaxed_ordering: bool = True) -> bytes:
    """4 KiB of PCI config space: a PCI Express capability at 0x40 (Device Control with
    or without Relaxed Ordering) and, for ``acs_ctl``, an ACS extended capability at
    0x100 whose Control register is ``acs_ctl``."""
    cfg = bytearray(4096)
    struct.pack_into("<H", cfg, 0x06, 0x0010)  # status: capability list
    cfg[0x34] = 0x40
    cfg[0x40], cfg[0x41] = 0x10, 0x00  # PCI Express capability, last
    struct.pack_into("<H", cfg, 0x48, 0x2810 if relaxed_ordering else 0x2800)
    if acs_ctl is not None:
        struct.pack_into("<I", cfg, 0x100, 0x000D | (1 << 16))  # ACS, version 1, last
        struct.pack_into("<H", cfg, 0x104, 0x005F)  # capabilities
        struct.pack_into("<H", cfg, 0x106, acs_ctl)
    return bytes(cfg)


def build(root: Path, topo: Topology, vectors: int = 4, first_irq: int = 100,
          acs_on: frozenset[str] = frozenset()) -> dict[str, list[int]]:
    """Write the tree under ``root`` (``root/sys``, ``root/proc``); PCI bus id -> IRQs.

    Every bridge of a PCIe path gets a ``config`` with an ACS capability (Source
    Validation on for those in ``acs_on``); devices get x16 links at full width."""
    sysr, proc = root / "sys", root / "proc"
    online = frozenset(topo.cpus)
    (sysr / "devices/system/cpu").mkdir(parents=True, exist_ok=True)
    (sysr / "devices/system/cpu/online").write_text(format_cpulist(online) + "\n")
    for n in topo.numa_nodes.values():
        d = sysr / f"devices/system/node/node{n.id}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(format_cpulist(n.cpus) + "\n")
    devs: dict[str, tuple[tuple[str, ...], int | None]] = {}
    for g in topo.gpus:
        devs[g.pci_bus_id] = (g.pcie_path, g.numa_node)
    for nic in topo.nics:
        if nic.pci_bus_id:
            devs.setdefault(nic.pci_bus_id, (nic.pcie_path, nic.numa_node))
    for r in topo.rdma:
        if r.pci_bus_id:
            devs.setdefault(r.pci_bus_id, (r.pcie_path, r.numa_node))
    irqs: dict[str, list[int]] = {}
    nxt = first_irq
    all_mask = format_mask(online, "0," * (max(online) // 32) + "0")
    lines = ["    " + " ".join(f"CPU{c}" for c in sorted(online))]
    (proc / "irq").mkdir(parents=True, exist_ok=True)
    for bus, (path, node) in sorted(devs.items()):
        d = sysr / "devices" / Path(*(path or ("pci0000:00",))) / bus
        (d / "msi_irqs").mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{-1 if node is None else node}\n")
        local = topo.numa_nodes[node].cpus if node is not None else online
        (d / "local_cpulist").write_text(format_cpulist(local) + "\n")
        link = sysr / "bus/pci/devices" / bus
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(d, link.parent))
        (d / "config").write_bytes(config_space())
        for attr, v in (("current_link_speed", "32.0 GT/s PCIe"), ("max_link_speed",
                        "32.0 GT/s PCIe"), ("current_link_width", "16"),
                        ("max_link_width", "16")):
            (d / attr).write_text(v + "\n")
        parent = sysr / "devices"
        for part in path:
            parent = parent / part
            if part.startswith("pci"):
                continue
            blink = sysr / "bus/pci/devices" / part
            if not blink.exists():
                (parent / "config").write_bytes(
                    config_space(acs_ctl=0x001D if part in acs_on else 0x0000))
                blink.symlink_to(os.path.relpath(parent, blink.parent))
        irqs[bus] = []
        for v in range(vectors):
            (d / "msi_irqs" / str(nxt)).write_text("msix\n")
            q = proc / "irq" / str(nxt)
            q.mkdir()
            (q / "smp_affinity").write_text(all_mask + "\n")
            lines.append(f"{nxt}: " + " ".join("0" for _ in online)
                         + f" IR-PCI-MSIX-{bus} {v}-edge q{v}@pci:{bus}")
            irqs[bus].append(nxt)
            nxt += 1
    (proc / "interrupts").write_text("\n".join(lines) + "\n")
    for nic in topo.nics:
        d = sysr / "class/net" / nic.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "mtu").write_text(f"{nic.mtu or 1500}\n")
        if nic.pci_bus_id:
            (d / "device").symlink_to(os.path.relpath(sysr / "bus/pci/devices" / nic.pci_bus_id,
                                                      d))
    for r in topo.rdma:
        d = sysr / "class/infiniband" / r.name
        (d / f"ports/{r.port}").mkdir(parents=True, exist_ok=True)
        (d / f"ports/{r.port}/rate").write_text(f"{r.rate_gbps} Gb/sec (4X)\n")
        (d / f"ports/{r.port}/link_layer").write_text(f"{r.link_layer}\n")
        if r.pci_bus_id:
            (d / "device").symlink_to(os.path.relpath(sysr / "bus/pci/devices" / r.pci_bus_id,
                                                      d))
            if r.netdev:
                nd = sysr / "bus/pci/devices" / r.pci_bus_id / "net" / r.netdev
                nd.mkdir(parents=True, exist_ok=True)
                (nd / "dev_port").write_text(f"{r.port - 1}\n")
    return irqs
