"""Human text for a topology: an `nvidia-smi topo -m` style matrix and summaries.

Works from the snapshot dict (what the daemon sends), stdlib only, so tunerctl
stays fast. Aims at 80 columns; wide matrices (16+ GPUs) simply get wider.
"""

from __future__ import annotations

from typing import Any

from tunerd.base.cpulist import format_cpulist
from tunerd.topology.model import Topology

__all__ = ["render"]

LEGEND = ("  X = self  NV# = # NVLinks  PIX = one PCIe switch  PXB = several switches\n"
          "  PHB = a host bridge  NODE = same NUMA node  SYS = across NUMA nodes / sockets")


def _size(n: int) -> str:
    if n <= 0:
        return "-"
    gib = n / (1 << 30)
    return f"{gib:.0f} GiB" if gib >= 10 else f"{gib:.1f} GiB"


def _table(rows: list[list[str]], gap: int = 2) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["".join(c.ljust(w + gap) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def render(data: dict[str, Any], origin: str = "") -> str:
    topo = Topology.from_json(data, origin="daemon reply")
    replayed = bool(data.get("replayed"))
    head = f"{topo.hostname}" + (" (replayed snapshot)" if replayed else "")
    if origin:
        head += f" [{origin}]"
    lines = [head, topo.summary()]
    if topo.note:
        lines.append(f"note: {topo.note}")

    if topo.gpus:
        lines.append("")
        idx = [g.index for g in topo.gpus]
        rows = [["", *[f"GPU{i}" for i in idx], "CPU Affinity", "NUMA Affinity"]]
        for g in topo.gpus:
            cells = []
            for j in idx:
                if j == g.index:
                    cells.append("X")
                else:
                    lk = topo.link(g.index, j)
                    cells.append(lk.label if lk else "?")
            rows.append([f"GPU{g.index}", *cells, format_cpulist(g.local_cpus) or "N/A",
                         "N/A" if g.numa_node is None else str(g.numa_node)])
        lines += _table(rows, gap=1)
        lines.append(LEGEND)
        lines.append("")
        rows = []
        for g in topo.gpus:
            extra = []
            if g.mig_enabled:
                extra.append(f"MIG on, {len(g.mig_devices)} instance(s)")
            if g.memory_numa_nodes:
                extra.append(f"memory on NUMA node {format_cpulist(g.memory_numa_nodes)}")
            rows.append([f"GPU{g.index}", g.model, _size(g.memory_total_bytes), g.pci_bus_id,
                         ", ".join(extra)])
        lines += _table(rows)

    lines.append("")
    lines += _numa_lines(topo)

    cores = topo.cores()
    threads = max((len(c) for c in cores.values()), default=1)
    l3 = topo.l3_groups()
    l3_sizes = sorted({len({topo.cpus[c].core_id for c in g}) for g in l3.values()})
    lines.append(
        f"CPUs: {len(topo.cpus)} online ({format_cpulist(topo.cpus)}), {len(cores)} cores x "
        f"{threads} thread{'s' if threads > 1 else ''}, {len(l3)} L3 group(s)"
        + (f" of {'/'.join(map(str, l3_sizes))} cores" if l3_sizes else ""))

    phys = [n for n in topo.nics if not n.virtual]
    virt = [n.name for n in topo.nics if n.virtual]
    if phys:
        lines.append("")
        rows = [["NIC", "PCI", "NUMA", "speed", "MTU"]]
        for nic in phys:
            speed = "-" if not nic.speed_mbps else (
                f"{nic.speed_mbps / 1000:g} Gb/s" if nic.speed_mbps >= 1000
                else f"{nic.speed_mbps} Mb/s")
            rows.append([nic.name, nic.pci_bus_id or "-",
                         "N/A" if nic.numa_node is None else str(nic.numa_node), speed,
                         str(nic.mtu or "-")])
        lines += _table(rows)
    if virt:
        lines.append(f"virtual interfaces: {', '.join(virt)}")
    if topo.rdma:
        import textwrap

        lines += textwrap.wrap("RDMA: " + ", ".join(
            f"{r.hca}" + (f" ({r.netdev})" if r.netdev else "") for r in topo.rdma),
            width=80, subsequent_indent="  ")
    lines += _node_map(topo)
    lines += _gpu_nics(topo)
    return "\n".join(lines)


def _numa_lines(topo: Topology) -> list[str]:
    """One line per NUMA node; a CPU-less node says so and whose memory it holds (a
    Grace GPU's HBM); empty CPU-less nodes (MIG memory partitions) on one line."""
    owners = {n: [f"GPU{g.index}" for g in topo.gpus if n in g.memory_numa_nodes]
              for n in topo.numa_nodes}
    empty = [n for n, node in sorted(topo.numa_nodes.items())
             if not node.cpus and not owners[n] and node.memory_total_bytes <= 0]
    node_ids = [n for n in sorted(topo.numa_nodes) if n not in empty]
    out = []
    for n in node_ids:
        node = topo.numa_nodes[n]
        dist = " ".join(str(node.distances.get(m, "-")) for m in node_ids)
        what = (f"CPUs {format_cpulist(node.cpus)} ({len(node.cpus)})" if node.cpus
                else f"{' '.join(owners[n])} memory, no CPUs"
                if owners[n]
                else "no CPUs")
        out.append(f"NUMA node {n}: {what}, {_size(node.memory_total_bytes)}, "
                   f"distances {dist}")
    if empty:
        out.append(f"NUMA nodes {format_cpulist(empty)}: no CPUs, no memory "
                   "(reserved, e.g. for MIG memory partitions)")
    return out


def _node_map(topo: Topology) -> list[str]:
    """Each GPU's slice of the node (tunerd.topology.nodemap)."""
    from tunerd.topology.nodemap import node_map

    if not topo.gpus:
        return []
    m = node_map(topo)
    rows = [["GPU", "slice CPUs", "CPUs", "memory node", "L3 groups", "NIC"]]
    for g in topo.gpus:
        sl = m.slices.get(g.index)
        if sl is None:
            rows.append([f"GPU{g.index}", "-", "0", "-", "-", "-"])
            continue
        rows.append([f"GPU{g.index}", format_cpulist(sl.cpus), str(len(sl.cpus)),
                     format_cpulist(sl.mems) or "N/A",
                     ",".join(map(str, sl.l3_groups)) or "-", ",".join(sl.nics) or "-"])
    out = ["", "Node map (each GPU's slice: ranks near a GPU are placed in it):",
           *("  " + r for r in _table(rows))]
    if m.shared:
        out.append(f"  shared pool (near no GPU): CPU {format_cpulist(m.shared)}")
    return out


def _gpu_nics(topo: Topology) -> list[str]:
    """Each GPU's nearest fabric NIC (tunerd.topology.iopath)."""
    from tunerd.topology.iopath import gpu_nics

    pairs = gpu_nics(topo)
    if not topo.gpus:
        return []
    rows = [["GPU", "NIC", "netdev", "path", "NUMA"]]
    for g in topo.gpus:
        ps = pairs.get(g.index, ())
        if not ps:
            rows.append([f"GPU{g.index}", "-", "-", "no fabric NIC", "-"])
            continue
        words = {"switch": "same PCIe switch", "host-bridge": "same host bridge",
                 "numa": "same NUMA node", "remote": "other NUMA node"}
        rows.append([f"GPU{g.index}", ",".join(p.nic.device for p in ps),
                     ",".join(p.nic.netdev or "-" for p in ps), words[ps[0].tier],
                     f"{g.numa_node if g.numa_node is not None else 'N/A'}"
                     f"/{ps[0].nic.numa_node if ps[0].nic.numa_node is not None else 'N/A'}"])
    return ["", "Each GPU's NIC (NUMA: GPU/NIC):", *("  " + r for r in _table(rows))]
