"""The node topology as plain data, and its versioned JSON snapshot form.

A snapshot is what ``tunerctl topology --save FILE`` writes and what
``tunerd --topology FILE`` replays. CPU and node sets are stored as kernel
cpulist strings (``0-55,112-167``) so snapshots stay small and readable.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist

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
]

SCHEMA = "tunerd.topology/1"
# PCIe relationships in `nvidia-smi topo -m` words, nearest first (NVML_TOPOLOGY_*)
PCIE_KINDS = ("PIX", "PXB", "PHB", "NODE", "SYS")
LINK_KINDS = ("NVLINK", *PCIE_KINDS)


class SnapshotError(ValueError):
    """A snapshot that cannot be read; the message names the file/key/value."""


@dataclass(frozen=True)
class Cpu:
    id: int
    core_id: int  # globally unique physical core id (dense, ordered by lowest CPU)
    package: int
    numa_node: int
    l3_id: int | None  # globally unique L3 (core complex) group id
    siblings: frozenset[int]  # SMT threads of this core, including this CPU


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: frozenset[int]  # empty for memory-only nodes (GPU HBM on Grace Hopper, CXL)
    memory_total_bytes: int
    distances: dict[int, int]  # node id -> SLIT distance (10 = local)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    pci_bus_id: str  # sysfs form: 0000:18:00.0
    model: str
    memory_total_bytes: int
    numa_node: int | None
    local_cpus: frozenset[int]
    mig_enabled: bool = False
    mig_devices: tuple[dict[str, Any], ...] = ()
    nvswitch_links: int = 0  # active NVLinks that end at an NVSwitch
    memory_numa_nodes: tuple[int, ...] = ()  # NUMA nodes holding this GPU's memory (C2C)
    # PCIe path from the host bridge down to (not including) the GPU, from sysfs's real
    # device path: ("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0")
    pcie_path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Link:
    """How two GPUs reach each other (`nvidia-smi topo -m` vocabulary)."""

    kind: str  # "NVLINK" | "PIX" | "PXB" | "PHB" | "NODE" | "SYS"
    nvlinks: int = 0  # number of NVLinks between the pair (direct + through NVSwitch)
    pcie: str | None = None  # the PCIe relationship, also known for NVLink pairs

    @property
    def label(self) -> str:
        """``NV18`` / ``PIX`` ... as in the nvidia-smi matrix."""
        return f"NV{self.nvlinks}" if self.kind == "NVLINK" else self.kind


@dataclass(frozen=True)
class Nic:
    name: str
    numa_node: int | None
    pci_bus_id: str | None
    speed_mbps: int | None
    mtu: int | None
    virtual: bool = False
    pcie_path: tuple[str, ...] = ()  # bridges above the NIC's PCI function (as Gpu's)


@dataclass(frozen=True)
class RdmaDevice:
    """One port of an InfiniBand / RoCE device (/sys/class/infiniband/mlx5_0/ports/1)."""

    name: str  # mlx5_0
    port: int = 1
    netdev: str | None = None  # its network interface (ibp24s0, ens1f0np0), if any
    pci_bus_id: str | None = None
    numa_node: int | None = None
    link_layer: str | None = None  # "InfiniBand" | "Ethernet" (RoCE)
    rate_gbps: int | None = None
    pcie_path: tuple[str, ...] = ()

    @property
    def hca(self) -> str:
        """``mlx5_0:1``: NCCL_IB_HCA's and UCX_NET_DEVICES' spelling."""
        return f"{self.name}:{self.port}"


@dataclass
class Topology:
    hostname: str = field(default_factory=socket.gethostname)
    replayed: bool = False
    note: str | None = None
    cpus: dict[int, Cpu] = field(default_factory=dict)
    numa_nodes: dict[int, NumaNode] = field(default_factory=dict)
    gpus: list[Gpu] = field(default_factory=list)
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    nics: list[Nic] = field(default_factory=list)
    rdma: list[RdmaDevice] = field(default_factory=list)  # InfiniBand / RoCE ports
    source: Any = None  # where a recorded snapshot's facts come from (URLs, "recorded")
    # derived indexes for tunerd.jobs.placement; not part of equality or the snapshot. A
    # Topology is read-only once built: build a new one (or clear this) to change it
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- queries -------------------------------------------------------------
    def online_cpus(self) -> frozenset[int]:
        return frozenset(self.cpus)

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index}")

    def link(self, a: int, b: int) -> Link | None:
        return self.links.get((a, b) if a < b else (b, a))

    def cores(self) -> dict[int, frozenset[int]]:
        """Physical core id -> its CPUs."""
        out: dict[int, set[int]] = {}
        for c in self.cpus.values():
            out.setdefault(c.core_id, set()).add(c.id)
        return {k: frozenset(v) for k, v in sorted(out.items())}

    def packages(self) -> dict[int, frozenset[int]]:
        out: dict[int, set[int]] = {}
        for c in self.cpus.values():
            out.setdefault(c.package, set()).add(c.id)
        return {k: frozenset(v) for k, v in sorted(out.items())}

    def l3_groups(self) -> dict[int, frozenset[int]]:
        out: dict[int, set[int]] = {}
        for c in self.cpus.values():
            if c.l3_id is not None:
                out.setdefault(c.l3_id, set()).add(c.id)
        return {k: frozenset(v) for k, v in sorted(out.items())}

    def summary(self) -> str:
        """``2 sockets, 112 cores / 224 CPUs, 2 NUMA nodes, 8 x NVIDIA H100 80GB HBM3``."""
        def n(k: int, word: str) -> str:
            return f"{k} {word}" + ("" if k == 1 else "s")

        models: dict[str, int] = {}
        for g in self.gpus:
            models[g.model] = models.get(g.model, 0) + 1
        gpus = ", ".join(f"{k} x {m}" for m, k in sorted(models.items())) or "no GPUs"
        return (f"{n(len(self.packages()), 'socket')}, {len(self.cores())} cores / "
                f"{len(self.cpus)} CPUs, {n(len(self.numa_nodes), 'NUMA node')}, {gpus}")

    # -- snapshot ------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "hostname": self.hostname,
            "replayed": self.replayed,  # informational: a loaded snapshot is always a replay
            "note": self.note,
        }
        if self.source is not None:
            d["source"] = self.source
        d["cpus"] = [
            {"id": c.id, "core_id": c.core_id, "package": c.package, "numa_node": c.numa_node,
             "l3_id": c.l3_id, "siblings": format_cpulist(c.siblings)}
            for c in sorted(self.cpus.values(), key=lambda c: c.id)
        ]
        d["numa_nodes"] = [
            {"id": n.id, "cpus": format_cpulist(n.cpus),
             "memory_total_bytes": n.memory_total_bytes,
             "distances": {str(k): v for k, v in sorted(n.distances.items())}}
            for n in sorted(self.numa_nodes.values(), key=lambda n: n.id)
        ]
        d["gpus"] = [
            {"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "model": g.model,
             "memory_total_bytes": g.memory_total_bytes, "numa_node": g.numa_node,
             "local_cpus": format_cpulist(g.local_cpus), "mig_enabled": g.mig_enabled,
             "mig_devices": [dict(m) for m in g.mig_devices],
             "nvswitch_links": g.nvswitch_links,
             "memory_numa_nodes": list(g.memory_numa_nodes),
             **({"pcie_path": list(g.pcie_path)} if g.pcie_path else {})}
            for g in self.gpus
        ]
        d["links"] = [
            {"a": a, "b": b, "kind": link.kind, "nvlinks": link.nvlinks, "pcie": link.pcie}
            for (a, b), link in sorted(self.links.items())
        ]
        d["nics"] = [
            {"name": n.name, "numa_node": n.numa_node, "pci_bus_id": n.pci_bus_id,
             "speed_mbps": n.speed_mbps, "mtu": n.mtu, "virtual": n.virtual,
             **({"pcie_path": list(n.pcie_path)} if n.pcie_path else {})}
            for n in self.nics
        ]
        if self.rdma:  # absent in snapshots of nodes without InfiniBand/RoCE (and old ones)
            d["rdma"] = [
                {"name": r.name, "port": r.port, "netdev": r.netdev,
                 "pci_bus_id": r.pci_bus_id, "numa_node": r.numa_node,
                 "link_layer": r.link_layer, "rate_gbps": r.rate_gbps,
                 "pcie_path": list(r.pcie_path)}
                for r in self.rdma
            ]
        return d

    @classmethod
    def from_json(cls, d: Any, *, origin: str = "snapshot") -> Topology:
        """Rebuild a Topology; raises SnapshotError naming ``origin`` and the bad key."""
        return _Reader(origin).topology(d)


_WORDS = {int: "an integer", str: "a string", bool: "true/false", list: "a list",
          dict: "an object", type(None): "null"}


class _Reader:
    """Strict snapshot reader: every error names the file and the key path."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, path: str, msg: str) -> SnapshotError:
        return SnapshotError(f"{self.origin}: {path}: {msg}")

    def get(self, d: dict[str, Any], key: str, kind: type | tuple[type, ...], path: str,
            default: Any = ...) -> Any:
        if key not in d or d[key] is None:
            if default is ...:
                raise self.fail(f"{path}.{key}", "missing")
            return default
        v = d[key]
        if isinstance(v, bool) and kind in (int, (int, type(None))):
            raise self.fail(f"{path}.{key}", f"expected an integer, got {v!r}")
        if not isinstance(v, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            names = " or ".join(_WORDS.get(k, k.__name__) for k in kinds)
            raise self.fail(f"{path}.{key}", f"expected {names}, got {v!r}")
        return v

    def cpus(self, d: dict[str, Any], key: str, path: str) -> frozenset[int]:
        text = self.get(d, key, str, path, "")
        try:
            return parse_cpulist(text)
        except CpuListError as err:
            raise self.fail(f"{path}.{key}", str(err)) from err

    def path(self, d: dict[str, Any], p: str) -> tuple[str, ...]:
        xs = self.get(d, "pcie_path", list, p, [])
        for i, x in enumerate(xs):
            if not isinstance(x, str) or not x:
                raise self.fail(f"{p}.pcie_path[{i}]", f"expected a PCI address, got {x!r}")
        return tuple(xs)

    def items(self, d: dict[str, Any], key: str) -> list[tuple[str, dict[str, Any]]]:
        xs = self.get(d, key, list, "$", [])
        out = []
        for i, x in enumerate(xs):
            if not isinstance(x, dict):
                raise self.fail(f"$.{key}[{i}]", f"expected an object, got {x!r}")
            out.append((f"$.{key}[{i}]", x))
        return out

    def topology(self, d: Any) -> Topology:
        if not isinstance(d, dict):
            raise self.fail("$", "a topology snapshot must be a JSON object")
        schema = d.get("schema")
        if schema != SCHEMA:
            raise self.fail("$.schema", f"unsupported snapshot schema {schema!r} "
                                         f"(this tunerd reads {SCHEMA!r})")
        topo = Topology(hostname=self.get(d, "hostname", str, "$"), replayed=True,
                        note=self.get(d, "note", str, "$", None), source=d.get("source"))
        for p, c in self.items(d, "cpus"):
            cpu = Cpu(id=self.get(c, "id", int, p), core_id=self.get(c, "core_id", int, p),
                      package=self.get(c, "package", int, p),
                      numa_node=self.get(c, "numa_node", int, p),
                      l3_id=self.get(c, "l3_id", int, p, None),
                      siblings=self.cpus(c, "siblings", p) or frozenset({c["id"]}))
            if cpu.id in topo.cpus:
                raise self.fail(f"{p}.id", f"CPU {cpu.id} listed twice")
            topo.cpus[cpu.id] = cpu
        for p, n in self.items(d, "numa_nodes"):
            dist_raw = self.get(n, "distances", dict, p, {})
            try:
                dist = {int(k): int(v) for k, v in dist_raw.items()}
            except (TypeError, ValueError) as err:
                raise self.fail(f"{p}.distances", f"expected {{node: distance}}: {err}") from err
            node = NumaNode(id=self.get(n, "id", int, p), cpus=self.cpus(n, "cpus", p),
                            memory_total_bytes=self.get(n, "memory_total_bytes", int, p, 0),
                            distances=dist)
            topo.numa_nodes[node.id] = node
        for p, g in self.items(d, "gpus"):
            migs = self.get(g, "mig_devices", list, p, [])
            numa = self.get(g, "numa_node", int, p, None)
            topo.gpus.append(Gpu(
                index=self.get(g, "index", int, p), uuid=self.get(g, "uuid", str, p, ""),
                pci_bus_id=self.get(g, "pci_bus_id", str, p, ""),
                model=self.get(g, "model", str, p),
                memory_total_bytes=self.get(g, "memory_total_bytes", int, p, 0),
                numa_node=numa, local_cpus=self.cpus(g, "local_cpus", p),
                mig_enabled=self.get(g, "mig_enabled", bool, p, False),
                mig_devices=tuple(m for m in migs if isinstance(m, dict)),
                nvswitch_links=self.get(g, "nvswitch_links", int, p, 0),
                memory_numa_nodes=tuple(self.get(g, "memory_numa_nodes", list, p, [])),
                pcie_path=self.path(g, p),
            ))
        indexes = [g.index for g in topo.gpus]
        if len(set(indexes)) != len(indexes):
            raise self.fail("$.gpus", f"GPU indexes repeat: {indexes}")
        for p, lk in self.items(d, "links"):
            a, b = self.get(lk, "a", int, p), self.get(lk, "b", int, p)
            kind = self.get(lk, "kind", str, p)
            if kind not in LINK_KINDS:
                raise self.fail(f"{p}.kind", f"{kind!r} is not one of {', '.join(LINK_KINDS)}")
            if a == b or a not in indexes or b not in indexes:
                raise self.fail(p, f"link {a}-{b} does not join two different listed GPUs")
            pcie = self.get(lk, "pcie", str, p, None)
            topo.links[(min(a, b), max(a, b))] = Link(
                kind=kind, nvlinks=self.get(lk, "nvlinks", int, p, 0), pcie=pcie)
        for p, n in self.items(d, "nics"):
            topo.nics.append(Nic(
                name=self.get(n, "name", str, p), numa_node=self.get(n, "numa_node", int, p, None),
                pci_bus_id=self.get(n, "pci_bus_id", str, p, None),
                speed_mbps=self.get(n, "speed_mbps", int, p, None),
                mtu=self.get(n, "mtu", int, p, None),
                virtual=self.get(n, "virtual", bool, p, False), pcie_path=self.path(n, p)))
        for p, r in self.items(d, "rdma"):
            topo.rdma.append(RdmaDevice(
                name=self.get(r, "name", str, p), port=self.get(r, "port", int, p, 1),
                netdev=self.get(r, "netdev", str, p, None),
                pci_bus_id=self.get(r, "pci_bus_id", str, p, None),
                numa_node=self.get(r, "numa_node", int, p, None),
                link_layer=self.get(r, "link_layer", str, p, None),
                rate_gbps=self.get(r, "rate_gbps", int, p, None), pcie_path=self.path(r, p)))
        for cpu in topo.cpus.values():
            if topo.numa_nodes and cpu.numa_node not in topo.numa_nodes:
                raise self.fail("$.cpus", f"CPU {cpu.id} is on NUMA node {cpu.numa_node}, "
                                          "which $.numa_nodes does not list")
        return topo
