"""The node map: the slice of the node each GPU owns.

Every GPU owns a slice: its NUMA node's cores divided among the GPUs there, whole
cores with their SMT siblings, contiguous in core order, L3 (core complex) groups kept
whole where the counts allow, the slice's memory node, and its nearest fabric NIC(s)
(tunerd.topology.iopath: behind the same PCIe switch first). Housekeeping CPUs belong to
no slice; CPUs of nodes with no GPU form the shared pool. A rank near GPU g is placed
in g's slice (tunerd.jobs.placement), so ranks of different jobs on different GPUs never
share a core, whoever bound them.

Computed once per topology and housekeeping set (kept in ``Topology._cache``), as
torchrun's ``numa/binding.py`` computes its per-GPU sets: pure functions over the
topology, no I/O. A new topology (CPU or memory hotplug, a replay) is a new map.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from tunerd.base.cpulist import format_cpulist
from tunerd.topology.model import Gpu, Topology

__all__ = ["GpuSlice", "NodeMap", "home_node", "node_map", "rank_mems"]


@dataclass(frozen=True)
class GpuSlice:
    gpu: int
    numa_node: int | None  # the node whose cores the slice takes (None: no NUMA info)
    cpus: frozenset[int]  # whole cores, SMT siblings together
    mems: frozenset[int]  # the memory node(s) of the slice
    l3_groups: tuple[int, ...]  # L3 groups the slice holds whole
    shares_cores: bool = False  # fewer cores than GPUs on its node: cores shared
    nics: tuple[str, ...] = ()  # its nearest fabric NIC(s) (tunerd.topology.iopath)
    nic_tier: str | None = None  # how near: switch, host-bridge, numa, remote

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "numa_node": self.numa_node,
                "cpus": format_cpulist(self.cpus), "ncpus": len(self.cpus),
                "mems": format_cpulist(self.mems), "l3_groups": list(self.l3_groups),
                "shares_cores": self.shares_cores, "nics": list(self.nics),
                "nic_tier": self.nic_tier}


@dataclass(frozen=True)
class NodeMap:
    slices: dict[int, GpuSlice]  # GPU index -> its slice
    shared: frozenset[int]  # CPUs near no GPU (nodes without GPUs)
    housekeeping: frozenset[int]  # CPUs of no slice

    def slice_cpus(self, gpus: Iterable[int]) -> frozenset[int]:
        """The union of the slices of ``gpus`` (empty where none has one)."""
        out: frozenset[int] = frozenset()
        for g in gpus:
            s = self.slices.get(g)
            if s is not None:
                out |= s.cpus
        return out

    def owner_of(self, cpu: int) -> tuple[int, ...]:
        """The GPUs whose slice holds ``cpu``."""
        return tuple(g for g, s in sorted(self.slices.items()) if cpu in s.cpus)

    def to_json(self) -> dict[str, Any]:
        return {"slices": [s.to_json() for _, s in sorted(self.slices.items())],
                "shared": format_cpulist(self.shared),
                "housekeeping": format_cpulist(self.housekeeping)}


def home_node(topo: Topology, gpu: Gpu) -> int | None:
    """The NUMA node with CPUs a GPU belongs to: its own node where that has CPUs, else
    the node most of its local CPUs are on (a Grace Hopper GPU's memory node has none)."""
    node = topo.numa_nodes.get(gpu.numa_node) if gpu.numa_node is not None else None
    if node is not None and node.cpus:
        return node.id
    counts = Counter(topo.cpus[c].numa_node for c in gpu.local_cpus if c in topo.cpus)
    return counts.most_common(1)[0][0] if counts else None


def rank_mems(topo: Topology, mems: frozenset[int] | None, gpus: Iterable[int],
              gpu_memory: bool = False) -> frozenset[int] | None:
    """The memory nodes of a rank placed with ``mems`` (its CPUs' nodes) near ``gpus``:
    ``mems`` itself, unless a policy asks (``[[job]] gpu_memory = true``) for the GPUs'
    own memory nodes too (a Grace GPU's memory onlined as a NUMA node without CPUs). A
    node without CPUs is never a rank's memory node otherwise."""
    if not gpu_memory or mems is None:
        return mems
    extra = {n for g in topo.gpus if g.index in set(gpus) for n in g.memory_numa_nodes
             if n in topo.numa_nodes}
    return mems | frozenset(extra)


def node_map(topo: Topology, housekeeping: frozenset[int] = frozenset()) -> NodeMap:
    """The node map of ``topo`` with ``housekeeping`` CPUs (grown to whole cores) left out.

    Kept in the topology's cache: the bind path only looks it up."""
    hk = frozenset(c for h in housekeeping if h in topo.cpus for c in topo.cpus[h].siblings)
    key = f"nodemap:{format_cpulist(hk)}"
    hit = topo._cache.get(key)
    if isinstance(hit, NodeMap):
        return hit
    m = _compute(topo, hk)
    if len(topo._cache) < 64:
        topo._cache[key] = m
    return m


def _compute(topo: Topology, hk: frozenset[int]) -> NodeMap:
    by_node: dict[int | None, list[Gpu]] = {}
    for g in sorted(topo.gpus, key=lambda g: g.index):
        by_node.setdefault(home_node(topo, g), []).append(g)
    slices: dict[int, GpuSlice] = {}
    shared: set[int] = set()
    for node in sorted(topo.numa_nodes.values(), key=lambda n: n.id):
        cpus = frozenset(c for c in node.cpus if c in topo.cpus) - hk
        gpus = by_node.get(node.id, [])
        if not gpus:
            shared |= cpus
            continue
        for g, (part, l3s, shares) in zip(gpus, _divide(topo, cpus, len(gpus)), strict=True):
            slices[g.index] = GpuSlice(gpu=g.index, numa_node=node.id, cpus=part,
                                       mems=frozenset({node.id}), l3_groups=l3s,
                                       shares_cores=shares)
    for g in by_node.get(None, []):  # no NUMA information: the GPU's local CPUs
        local = frozenset(g.local_cpus) - hk
        slices[g.index] = GpuSlice(gpu=g.index, numa_node=None, cpus=local, mems=frozenset(),
                                   l3_groups=(), shares_cores=True)
    from tunerd.topology.iopath import gpu_nics  # the I/O path: each slice's NIC

    for index, pairs in gpu_nics(topo).items():
        if index in slices and pairs:
            slices[index] = replace(slices[index], nics=tuple(p.nic.device for p in pairs),
                                    nic_tier=pairs[0].tier)
    return NodeMap(slices=slices, shared=frozenset(shared), housekeeping=hk)


def _divide(topo: Topology, cpus: frozenset[int], k: int
            ) -> list[tuple[frozenset[int], tuple[int, ...], bool]]:
    """``cpus`` (one NUMA node's) in ``k`` parts of whole cores, contiguous in (L3 group,
    core) order; whole L3 groups per part when the groups divide evenly among the parts."""
    cores: dict[int, list[int]] = {}
    l3_of: dict[int, int] = {}
    for c in sorted(cpus):
        cpu = topo.cpus[c]
        cores.setdefault(cpu.core_id, []).append(c)
        l3_of[cpu.core_id] = cpu.l3_id if cpu.l3_id is not None else -1
    order = sorted(cores, key=lambda core: (l3_of[core], core))
    if not order:
        return [(frozenset(), (), True)] * k
    if len(order) < k:  # fewer cores than GPUs: each GPU one core, round robin
        return [(frozenset(cores[order[i % len(order)]]),
                 (), True) for i in range(k)]
    groups: dict[int, list[int]] = {}
    for core in order:
        groups.setdefault(l3_of[core], []).append(core)
    sizes = {len(v) for v in groups.values()}
    parts: list[list[int]]
    if -1 not in groups and len(groups) >= k and len(groups) % k == 0 and len(sizes) == 1:
        per = len(groups) // k
        ids = sorted(groups)
        parts = [[core for gid in ids[i * per:(i + 1) * per] for core in groups[gid]]
                 for i in range(k)]
    else:
        base, extra = divmod(len(order), k)
        parts, at = [], 0
        for i in range(k):
            n = base + (1 if i < extra else 0)
            parts.append(order[at:at + n])
            at += n
    out = []
    for part in parts:
        l3 = Counter(l3_of[core] for core in part)
        whole = tuple(sorted(gid for gid, n in l3.items()
                             if gid >= 0 and n == len(groups[gid])))
        out.append((frozenset(c for core in part for c in cores[core]), whole, False))
    return out
