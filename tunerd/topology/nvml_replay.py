"""A GPU backend replaying a topology snapshot — the one allowed fake.

``tunerd.adapters.nvml.set_backend(ReplayNvml(topo))`` runs the real GPU reading code
(tunerd.topology.gpu, the placement code) on a recorded node. It implements the same
interface as the real library (``tunerd.adapters.nvml.Backend`` / ``Device``) and answers only
what a snapshot records (identity, memory size, locality, NVLink, MIG, PCIe levels);
every other reading is ``NA``, exactly as on a driver that does not support it.

Given a telemetry recording too (tests/fixtures/nvml/*.json, as
tests/fixtures/nvml/record_telemetry.py writes them), it also answers the driver and
CUDA versions and, where the recording has them, each GPU's utilization, power,
temperature, clocks, throttle reasons and PCIe link (GPU i of the snapshot reads GPU
i mod n of the recording).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tunerd.adapters import nvml
from tunerd.adapters.nvml import NA, GpuProcess, MemoryInfo, NaOr
from tunerd.base.errors import Failed
from tunerd.base.safefs import read_trusted
from tunerd.topology.model import Gpu, Topology

__all__ = ["ReplayDevice", "ReplayNvml"]

_LEVEL = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


class ReplayDevice(nvml.Device):
    """One GPU of a snapshot (or one of its MIG slices, ``mig`` = slot)."""

    def __init__(self, replay: ReplayNvml, gpu: Gpu, mig: int | None = None,
                 parent: nvml.Device | None = None) -> None:
        super().__init__(gpu.index if mig is None else mig, parent)
        self.replay = replay
        self.gpu = gpu
        self.mig = mig

    def _tel(self, key: str) -> Any:
        """A recorded reading of this GPU (None: not recorded, or a MIG slice)."""
        rec = self.replay.telemetry_gpus
        if self.mig is not None or not rec:
            return None
        return rec[self.gpu.index % len(rec)].get(key)

    def _tel_int(self, key: str) -> NaOr[int]:
        v = self._tel(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else NA

    @property
    def utilization(self) -> nvml.Utilization:
        u = self._tel("utilization")
        if not isinstance(u, dict):
            return nvml.Utilization(NA, NA)
        g, m = u.get("gpu"), u.get("memory")
        return nvml.Utilization(g if isinstance(g, int) else NA, m if isinstance(m, int) else NA)

    @property
    def power_usage_mw(self) -> NaOr[int]:
        return self._tel_int("power_mw")

    @property
    def enforced_power_limit_mw(self) -> NaOr[int]:
        return self._tel_int("power_limit_mw")

    @property
    def temperature_c(self) -> NaOr[int]:
        return self._tel_int("temperature")

    @property
    def sm_clock_mhz(self) -> NaOr[int]:
        return self._tel_int("sm_clock_mhz")

    @property
    def memory_clock_mhz(self) -> NaOr[int]:
        return self._tel_int("mem_clock_mhz")

    @property
    def graphics_clock_mhz(self) -> NaOr[int]:
        return self._tel_int("graphics_clock_mhz")

    @property
    def clocks_event_reasons(self) -> NaOr[int]:
        return self._tel_int("clocks_event_reasons")

    @property
    def pcie_link_gen(self) -> NaOr[int]:
        return self._tel_int("pcie_link_gen")

    @property
    def pcie_link_width(self) -> NaOr[int]:
        return self._tel_int("pcie_link_width")

    def _mig_rec(self) -> dict[str, Any]:
        return dict(self.gpu.mig_devices[self.mig]) if self.mig is not None else {}

    @property
    def uuid(self) -> NaOr[str]:
        if self.mig is not None:
            return str(self._mig_rec().get("uuid") or "") or NA
        return self.gpu.uuid or NA

    @property
    def name(self) -> NaOr[str]:
        return self.gpu.model or NA

    @property
    def pci_bus_id(self) -> NaOr[str]:
        return self.gpu.pci_bus_id or NA

    @property
    def memory_info(self) -> MemoryInfo:
        total = (int(self._mig_rec().get("memory_total_bytes") or 0) if self.mig is not None
                 else self.gpu.memory_total_bytes)
        return MemoryInfo(total, 0, total)  # a snapshot records no load: nothing in use

    def compute_processes(self) -> NaOr[list[GpuProcess]]:
        if self.mig is not None or self.replay.processes is None:
            return NA  # a snapshot records no processes
        return [GpuProcess(pid, NA) for pid in self.replay.listed().get(self.gpu.index, ())]

    @property
    def minor_number(self) -> NaOr[int]:
        return self.gpu.index if self.mig is None else NA  # /dev/nvidiaN: N = index here

    def cpu_affinity(self, ncpus: int) -> NaOr[frozenset[int]]:
        words = max(1, (ncpus + 63) // 64)  # what NVML's 64-bit mask array can hold
        return frozenset(c for c in self.gpu.local_cpus if c < words * 64)

    @property
    def numa_node_id(self) -> NaOr[int]:
        return self.gpu.memory_numa_nodes[0] if self.gpu.memory_numa_nodes else NA

    def common_ancestor(self, other: nvml.Device) -> NaOr[int]:
        if not isinstance(other, ReplayDevice):
            return NA
        a, b = self.gpu, other.gpu
        link = self.replay.topo.link(a.index, b.index)
        kind = link.pcie if link and link.pcie else (link.kind if link else None)
        if kind in _LEVEL:
            return _LEVEL[kind]
        return 40 if a.numa_node == b.numa_node else 50

    def _end(self, link: int) -> NaOr[tuple[str, str]]:
        ends = self.replay.nvlink_ends[self.gpu.index] if self.mig is None else []
        return ends[link] if 0 <= link < len(ends) else NA

    def nvlink_active(self, link: int) -> NaOr[bool]:
        return NA if self._end(link) is NA else True

    def nvlink_remote_device_type(self, link: int) -> NaOr[int]:
        end = self._end(link)
        if isinstance(end, tuple):
            return nvml.NVLINK_DEVICE_TYPE_SWITCH if end[0] == "switch" else 0
        return NA

    def nvlink_remote_bus_id(self, link: int) -> NaOr[str]:
        end = self._end(link)
        return end[1] if isinstance(end, tuple) else NA

    @property
    def mig_mode(self) -> NaOr[int]:
        return int(self.gpu.mig_enabled) if self.mig is None else NA

    def mig_devices(self) -> list[nvml.Device]:
        if self.mig is not None or not self.gpu.mig_enabled:
            return []
        return [ReplayDevice(self.replay, self.gpu, i, parent=self)
                for i in range(len(self.gpu.mig_devices))]

    @property
    def gpu_instance_id(self) -> NaOr[int]:
        v = self._mig_rec().get("gpu_instance_id")
        return v if isinstance(v, int) else NA

    @property
    def compute_instance_id(self) -> NaOr[int]:
        v = self._mig_rec().get("compute_instance_id")
        return v if isinstance(v, int) else NA


class ReplayNvml(nvml.Backend):
    """The GPUs of a topology snapshot (and a telemetry recording's readings, when given).
    ``device_class`` lets a test answer more."""

    device_class: type[ReplayDevice] = ReplayDevice

    def __init__(self, topo: Topology, telemetry: dict[str, Any] | None = None,
                 processes: Path | None = None) -> None:
        self.topo = topo
        self.processes = processes  # the processes file (module docstring), or None
        self._listed: tuple[tuple[int, int, int], dict[int, tuple[int, ...]]] | None = None
        self.telemetry = telemetry or {}
        gpus_rec = self.telemetry.get("gpus")
        self.telemetry_gpus: list[dict[str, Any]] = [
            g for g in gpus_rec if isinstance(g, dict)] if isinstance(gpus_rec, list) else []
        gpus = list(topo.gpus)
        # per GPU the remote end of each NVLink: ("switch", fake bus) or ("gpu", bus id)
        self.nvlink_ends: dict[int, list[tuple[str, str]]] = {}
        for g in gpus:
            ends: list[tuple[str, str]] = [
                ("switch", f"0000:{0xA0 + s % 4:02x}:00.0") for s in range(g.nvswitch_links)]
            for peer in gpus:
                if peer.index == g.index:
                    continue
                link = topo.link(g.index, peer.index)
                if link is None or link.kind != "NVLINK":
                    continue
                via_switch = (min(g.nvswitch_links, peer.nvswitch_links)
                              if g.nvswitch_links and peer.nvswitch_links else 0)
                ends += [("gpu", peer.pci_bus_id)] * max(0, link.nvlinks - via_switch)
            self.nvlink_ends[g.index] = ends
        self._devices: list[nvml.Device] = [self.device_class(self, g) for g in gpus]

    def devices(self) -> list[nvml.Device]:
        return list(self._devices)

    def listed(self) -> dict[int, tuple[int, ...]]:
        """GPU index -> the pids the processes file lists on it, read again only when
        the file changed (one stat per call otherwise)."""
        assert self.processes is not None
        try:
            st = os.stat(self.processes)
        except OSError:
            return {}
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._listed is None or self._listed[0] != key:
            self._listed = (key, _read_processes(self.processes))
        return self._listed[1]

    @property
    def driver_version(self) -> NaOr[str]:
        v = self.telemetry.get("driver_version")
        return str(v) if v else NA

    @property
    def nvml_version(self) -> NaOr[str]:
        v = self.telemetry.get("nvml_version")
        return str(v) if v else NA

    @property
    def cuda_driver_version(self) -> NaOr[int]:
        v = self.telemetry.get("cuda_driver_version")
        return v if isinstance(v, int) and not isinstance(v, bool) else NA


MAX_LISTED = 4096  # pids per GPU read from a processes file


def _read_processes(path: Path) -> dict[int, tuple[int, ...]]:
    """``{"<gpu index>": [pid, ...]}`` as GPU index -> pids; {} when it is no such file."""
    try:  # trusted as a policy file is (root's, no one else may write it), 1 MiB at most
        raw = json.loads(read_trusted(path, "processes file", 1 << 20))
    except (OSError, ValueError, Failed):
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[int, tuple[int, ...]] = {}
    for key, pids in raw.items():
        if str(key).isdigit() and isinstance(pids, list):
            out[int(key)] = tuple(p for p in pids[:MAX_LISTED]
                                  if isinstance(p, int) and not isinstance(p, bool) and p > 0)
    return out
