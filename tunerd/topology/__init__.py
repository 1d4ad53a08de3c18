"""Node topology: CPUs, cores, NUMA nodes, GPUs, links, NICs.

``load_topology()`` reads the real node (sysfs + NVML); ``load_topology(path)``
replays a snapshot written by ``tunerctl topology --save``.
"""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

from tunerd.base.errors import UsageError
from tunerd.topology.model import (
    LINK_KINDS,
    SCHEMA,
    Cpu,
    Gpu,
    Link,
    Nic,
    NumaNode,
    RdmaDevice,
    SnapshotError,
    Topology,
)

__all__ = [
    "LINK_KINDS",
    "SCHEMA",
    "Cpu",
    "Gpu",
    "Link",
    "Nic",
    "NumaNode",
    "RdmaDevice",
    "SnapshotError",
    "Topology",
    "load_topology",
    "read_snapshot",
    "read_system",
]


def read_snapshot(path: Path) -> Topology:
    """Replay a snapshot file; a missing or malformed one is a UsageError naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise UsageError(f"cannot read topology snapshot {path}: {err.strerror or err}") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"topology snapshot {path} is not valid JSON: {err}") from err
    try:
        return Topology.from_json(data, origin=str(path))
    except SnapshotError as err:
        raise UsageError(f"bad topology snapshot {err}") from err


def _hostname(proc_root: Path) -> str:
    try:
        name = (proc_root / "sys/kernel/hostname").read_text().strip()
    except OSError:
        name = ""
    return name or socket.gethostname()


def read_system(sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> Topology:
    """The real node: sysfs for CPUs/NUMA/PCI/NICs, NVML for GPUs and their links."""
    from tunerd.topology.gpu import read_gpus
    from tunerd.topology.sysfs import pcie_path, read_cpus, read_nics, read_numa_nodes, read_rdma

    cpus = read_cpus(sys_root)
    nodes = read_numa_nodes(sys_root, frozenset(cpus), proc_root)
    gpus, links, note = read_gpus(sys_root, ncpus=max(cpus, default=0) + 1)
    for i, g in enumerate(gpus):
        node: int | None = g.numa_node
        mem_first: tuple[int, ...] = ()
        if node is not None and node in nodes and not nodes[node].cpus:
            # the PCI function says the GPU's own memory node (no CPUs: a Grace GPU's
            # memory onlined): that is its memory; its CPUs' node comes from its CPUs
            mem_first, node = (node,), None
        if node is None and g.local_cpus:
            # sysfs gave no proximity (numa_node -1): the node holding most local CPUs
            best = max(nodes.values(), key=lambda n: (len(n.cpus & g.local_cpus), -n.id))
            if best.cpus & g.local_cpus:
                node = best.id
        # GPU memory as a NUMA node (Grace Hopper C2C) is a node without CPUs; drivers
        # that answer the NVML NUMA node id with the CPU node on x86 are not that
        mem_nodes = tuple(dict.fromkeys(n for n in (*mem_first, *g.memory_numa_nodes)
                                        if n in nodes and not nodes[n].cpus and n != node))
        gpus[i] = replace(g, numa_node=node, memory_numa_nodes=mem_nodes,
                          pcie_path=pcie_path(g.pci_bus_id, sys_root) if g.pci_bus_id else ())
    return Topology(hostname=_hostname(proc_root), replayed=False, note=note, cpus=cpus,
                    numa_nodes=nodes, gpus=gpus, links=links, nics=read_nics(sys_root),
                    rdma=read_rdma(sys_root))


def load_topology(snapshot: Path | None = None) -> Topology:
    """The node's topology: replayed from ``snapshot`` if given, else read live."""
    if snapshot is not None:
        return read_snapshot(snapshot)
    return read_system()
