"""Each GPU's fabric NIC: the nearest InfiniBand/RoCE port or Ethernet interface.

A pure function of the topology (``gpu_nics(topo)``), so that it works the same on
the live node and on a replayed snapshot. Nearest means, in this order:

1. ``switch``: behind the same PCIe switch as the GPU (their PCIe paths share a
   bridge below the root port: ``PIX``/``PXB`` in ``nvidia-smi topo -m`` words);
   the deepest shared bridge wins;
2. ``host-bridge``: under the same host bridge (``PHB``);
3. ``numa``: on the GPU's NUMA node (``NODE``); several GPUs and NICs of one node
   are spread round-robin, so that no NIC carries every GPU of the node;
4. ``remote``: the node has none on the GPU's NUMA node (``SYS``): the least distant.

Fabric NICs are the RDMA ports (``/sys/class/infiniband``) when the node has any,
otherwise its physical Ethernet interfaces at the fastest speed present (a 1 Gb/s
management port is never a GPU's NIC next to a 100 Gb/s one). Where a node has both
InfiniBand and Ethernet (RoCE) RDMA ports, the InfiniBand ones are the compute fabric
and the Ethernet ones storage / in-band (DGX H100/B200's and GB200 trays' BlueField-3
ports): a GPU is paired with an InfiniBand port only, whatever is nearer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunerd.topology.model import Gpu, Topology

__all__ = ["TIERS", "FabricNic", "GpuNic", "fabric_nics", "gpu_nics", "nic_env",
           "pairing_json"]

TIERS = ("switch", "host-bridge", "numa", "remote")  # nearest first
# nvidia-smi topo -m's word for each tier
_TOPO_WORD = {"switch": "PIX/PXB", "host-bridge": "PHB", "numa": "NODE", "remote": "SYS"}


@dataclass(frozen=True)
class FabricNic:
    """A NIC a GPU may use: an RDMA port (``rdma``) or an Ethernet interface."""

    kind: str  # "rdma" | "ethernet"
    name: str  # mlx5_0 | ens1f0
    port: int | None  # the RDMA port; None for Ethernet
    netdev: str | None  # its network interface (the interface itself for Ethernet)
    pci_bus_id: str | None
    numa_node: int | None
    pcie_path: tuple[str, ...]
    speed_mbps: int | None
    link_layer: str | None = None  # RDMA ports: "InfiniBand" | "Ethernet"

    @property
    def device(self) -> str:
        """``mlx5_0:1`` (NCCL_IB_HCA, UCX_NET_DEVICES) or the interface name."""
        return f"{self.name}:{self.port}" if self.kind == "rdma" else self.name


@dataclass(frozen=True)
class GpuNic:
    """GPU ``gpu``'s NIC and how near it is."""

    gpu: int
    nic: FabricNic
    tier: str  # one of TIERS
    shared_path: tuple[str, ...]  # the PCIe bridges GPU and NIC both sit under

    @property
    def same_numa(self) -> bool:
        return self.tier != "remote"

    def to_json(self) -> dict[str, Any]:
        n = self.nic
        return {"gpu": self.gpu, "kind": n.kind, "name": n.name, "port": n.port,
                "device": n.device, "netdev": n.netdev, "pci_bus_id": n.pci_bus_id,
                "numa_node": n.numa_node, "tier": self.tier, "topo": _TOPO_WORD[self.tier],
                "shared_path": list(self.shared_path)}


def fabric_nics(topo: Topology) -> list[FabricNic]:
    """The NICs GPUs are paired with (see the module doc)."""
    netdev_speed = {n.name: n.speed_mbps for n in topo.nics}
    if topo.rdma:
        return [FabricNic("rdma", r.name, r.port, r.netdev, r.pci_bus_id, r.numa_node,
                          r.pcie_path,
                          r.rate_gbps * 1000 if r.rate_gbps else netdev_speed.get(r.netdev or ""),
                          r.link_layer)
                for r in topo.rdma]
    phys = [n for n in topo.nics if not n.virtual and n.pci_bus_id]
    fastest = max((n.speed_mbps or 0 for n in phys), default=0)
    return [FabricNic("ethernet", n.name, None, n.name, n.pci_bus_id, n.numa_node,
                      n.pcie_path, n.speed_mbps)
            for n in phys if (n.speed_mbps or 0) >= fastest]


def compute_nics(nics: list[FabricNic]) -> list[FabricNic]:
    """The ports a GPU may be paired with: InfiniBand ones where the node has both
    InfiniBand and Ethernet RDMA ports (the Ethernet ones carry storage), else all."""
    ib = [n for n in nics if n.link_layer == "InfiniBand"]
    return ib if ib and len(ib) < len(nics) else nics


def _common(a: Sequence[str], b: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        out.append(x)
    return tuple(out)


def _tier(gpu: Gpu, nic: FabricNic) -> tuple[str, tuple[str, ...]]:
    shared = _common(gpu.pcie_path, nic.pcie_path)
    # [host bridge, root port, switch upstream port, ...]: a switch is shared from index 2
    if len(shared) >= 3:
        return "switch", shared
    if len(shared) >= 1:
        return "host-bridge", shared
    if gpu.numa_node is not None and gpu.numa_node == nic.numa_node:
        return "numa", shared
    return "remote", shared


def _distance(topo: Topology, gpu: Gpu, nic: FabricNic) -> int:
    if gpu.numa_node is None or nic.numa_node is None:
        return 255
    node = topo.numa_nodes.get(gpu.numa_node)
    return node.distances.get(nic.numa_node, 255) if node else 255


def gpu_nics(topo: Topology) -> dict[int, tuple[GpuNic, ...]]:
    """GPU index -> its nearest fabric NIC(s), nearest tier only; () when the node
    has no fabric NIC. Several NICs at the GPU's best PCIe tier (a dual-port card
    behind its switch) are all its own; at the ``numa`` and ``remote`` tiers each GPU
    gets one, spread round-robin over the GPUs of that node."""
    nics = compute_nics(fabric_nics(topo))
    out: dict[int, tuple[GpuNic, ...]] = {}
    spread: dict[tuple[str, int | None], list[tuple[Gpu, list[GpuNic]]]] = {}
    for gpu in sorted(topo.gpus, key=lambda g: g.index):
        if not nics:
            out[gpu.index] = ()
            continue
        cands = [GpuNic(gpu.index, n, *_tier(gpu, n)) for n in nics]
        best = min(TIERS.index(c.tier) for c in cands)
        cands = [c for c in cands if TIERS.index(c.tier) == best]
        tier = TIERS[best]
        if tier in ("switch", "host-bridge"):
            depth = max(len(c.shared_path) for c in cands)
            out[gpu.index] = tuple(c for c in cands if len(c.shared_path) == depth)
            continue
        if tier == "remote":
            near = min(_distance(topo, gpu, c.nic) for c in cands)
            cands = [c for c in cands if _distance(topo, gpu, c.nic) == near]
        spread.setdefault((tier, cands[0].nic.numa_node if tier == "numa" else None),
                          []).append((gpu, cands))
    for group in spread.values():
        for i, (gpu, cands) in enumerate(group):
            out[gpu.index] = (cands[i % len(cands)],)
    return dict(sorted(out.items()))


def nic_env(pairs: Sequence[GpuNic]) -> dict[str, str]:
    """The NCCL/UCX variables that give a rank its GPU's NIC(s): ``NCCL_IB_HCA`` (with
    ``=``: exact names, so ``mlx5_1`` never also selects ``mlx5_10``) for RDMA ports,
    ``NCCL_SOCKET_IFNAME`` for Ethernet, and ``UCX_NET_DEVICES``; {} for no NIC."""
    if not pairs:
        return {}
    seen: dict[str, FabricNic] = {}
    for p in pairs:
        seen.setdefault(p.nic.device, p.nic)
    nics = list(seen.values())
    env: dict[str, str] = {}
    rdma = [n for n in nics if n.kind == "rdma"]
    if rdma:
        env["NCCL_IB_HCA"] = "=" + ",".join(n.device for n in rdma)
    else:
        env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(n.name for n in nics)
    env["UCX_NET_DEVICES"] = ",".join(n.device for n in nics)
    return env


def pairing_json(pairs: Mapping[int, Sequence[GpuNic]]) -> dict[str, list[dict[str, Any]]]:
    """``{"0": [{...}], ...}``: the pairing as `tunerctl topology --json` shows it."""
    return {str(g): [p.to_json() for p in ps] for g, ps in pairs.items()}
