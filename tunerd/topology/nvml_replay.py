"""A replay of pynvml built from a topology snapshot — the one allowed fake.

Install it with ``tunerd.nvml.set_backend(ReplayNvml(topo))`` to run the real
NVML reading code (tunerd.topology.gpu, monitors) on a recorded node. It answers
only what a snapshot records; every other function is absent, so ``nvml.call``
reports it "not available" exactly as for an old driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunerd.topology.model import Gpu, Topology

__all__ = ["ReplayError", "ReplayNvml"]

_LEVEL = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


class ReplayError(Exception):
    """What the replay raises where real NVML raises NVMLError (not supported, bad index)."""


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int | None = None


@dataclass(frozen=True)
class _PciInfo:
    busId: bytes


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


def _nvml_bus_id(sysfs_id: str) -> bytes:
    """``0000:18:00.0`` -> NVML's ``00000000:18:00.0`` (upper case, 8-digit domain)."""
    dom, _, rest = sysfs_id.partition(":")
    try:
        return f"{int(dom, 16):08X}:{rest.upper()}".encode()
    except ValueError:
        return sysfs_id.encode()


class ReplayNvml:
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._gpus: list[Gpu] = list(topo.gpus)
        # per GPU the remote end of each NVLink: ("switch", fake bus) or ("gpu", bus id)
        self._nvlinks: list[list[tuple[str, str]]] = []
        for g in self._gpus:
            ends: list[tuple[str, str]] = [
                ("switch", f"0000:{0xA0 + s % 4:02x}:00.0") for s in range(g.nvswitch_links)]
            for peer in self._gpus:
                if peer.index == g.index:
                    continue
                link = topo.link(g.index, peer.index)
                if link is None or link.kind != "NVLINK":
                    continue
                via_switch = (min(g.nvswitch_links, peer.nvswitch_links)
                              if g.nvswitch_links and peer.nvswitch_links else 0)
                ends += [("gpu", peer.pci_bus_id)] * max(0, link.nvlinks - via_switch)
            self._nvlinks.append(ends)

    # -- device enumeration ---------------------------------------------------
    def nvmlInit(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> _Handle:
        if not 0 <= i < len(self._gpus):
            raise ReplayError(f"NVML_ERROR_INVALID_ARGUMENT: no GPU {i}")
        return _Handle(i)

    def _gpu(self, h: _Handle) -> Gpu:
        return self._gpus[h.gpu]

    def _mig(self, h: _Handle) -> dict[str, Any]:
        if h.mig is None:
            raise ReplayError("NVML_ERROR_INVALID_ARGUMENT: not a MIG device")
        return dict(self._gpu(h).mig_devices[h.mig])

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        if h.mig is not None:
            return str(self._mig(h).get("uuid", ""))
        return self._gpu(h).uuid

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._gpu(h).model

    def nvmlDeviceGetPciInfo_v3(self, h: _Handle) -> _PciInfo:
        return _PciInfo(_nvml_bus_id(self._gpu(h).pci_bus_id))

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> _Memory:
        total = (int(self._mig(h).get("memory_total_bytes", 0)) if h.mig is not None
                 else self._gpu(h).memory_total_bytes)
        return _Memory(total=total, free=total, used=0)

    def nvmlDeviceGetCpuAffinity(self, h: _Handle, words: int) -> list[int]:
        masks = [0] * words
        for c in self._gpu(h).local_cpus:
            if c // 64 < words:
                masks[c // 64] |= 1 << (c % 64)
        return masks

    def nvmlDeviceGetNumaNodeId(self, h: _Handle) -> int:
        g = self._gpu(h)
        if g.memory_numa_nodes:
            return g.memory_numa_nodes[0]
        raise ReplayError("NVML_ERROR_NOT_SUPPORTED")

    # -- MIG -------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, h: _Handle) -> tuple[int, int]:
        m = int(self._gpu(h).mig_enabled)
        return (m, m)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Handle) -> int:
        return 7 if self._gpu(h).mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, i: int) -> _Handle:
        if not 0 <= i < len(self._gpu(h).mig_devices):
            raise ReplayError("NVML_ERROR_NOT_FOUND")
        return _Handle(h.gpu, i)

    def nvmlDeviceGetGpuInstanceId(self, h: _Handle) -> Any:
        return self._mig(h).get("gpu_instance_id")

    def nvmlDeviceGetComputeInstanceId(self, h: _Handle) -> Any:
        return self._mig(h).get("compute_instance_id")

    # -- links -----------------------------------------------------------------
    def _end(self, h: _Handle, link: int) -> tuple[str, str]:
        ends = self._nvlinks[h.gpu]
        if not ends:
            raise ReplayError("NVML_ERROR_NOT_SUPPORTED")
        if not 0 <= link < len(ends):
            raise ReplayError("NVML_ERROR_INVALID_ARGUMENT")
        return ends[link]

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        self._end(h, link)
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: _Handle, link: int) -> int:
        return 2 if self._end(h, link)[0] == "switch" else 0

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h: _Handle, link: int) -> _PciInfo:
        return _PciInfo(_nvml_bus_id(self._end(h, link)[1]))

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: _Handle, h2: _Handle) -> int:
        a, b = self._gpu(h1), self._gpu(h2)
        link = self.topo.link(a.index, b.index)
        kind = link.pcie if link and link.pcie else (link.kind if link else None)
        if kind in _LEVEL:
            return _LEVEL[kind]
        return 40 if a.numa_node == b.numa_node else 50
