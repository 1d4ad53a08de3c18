"""GPU sampler: every number through the typed GPU layer, so one missing metric is None.

Without a driver the sample is ``{"available": False, "reason": ...}`` and no
GPU series exist. Units follow the key names: bytes, watts, celsius, hertz.
"""

from __future__ import annotations

from typing import Any

from tunerd.adapters import nvml
from tunerd.adapters.nvml import NA

# Throttle ("clocks event") reason bits that mean the GPU is slowed by heat or power
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
    0x100: "display_clocks",
}
POWER_THERMAL_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def _num(v: Any, scale: float = 1.0) -> float | None:
    if v is NA or v is None:
        return None
    try:
        return float(v) * scale
    except (TypeError, ValueError):
        return None


def _opt(v: Any) -> Any:
    return None if v is NA else v


class GpuSampler:
    """Samples every GPU NVML reports; keeps the devices and the Xid watch between cycles."""

    def __init__(self) -> None:
        self._devices: list[nvml.Device] | None = None
        self._uuids: list[str | None] = []
        self._xids: nvml.XidWatch | nvml.NotAvailable = NA
        self._xid_counts: dict[int, int] = {}
        self._last_xid: dict[int, int] = {}

    def _setup(self) -> list[nvml.Device]:
        if self._devices is not None:
            return self._devices
        self._devices = nvml.devices()
        self._uuids = [_opt(d.uuid) for d in self._devices]
        # Xid critical errors arrive as NVML events; not every GPU or driver supports them.
        b = nvml.backend()
        self._xids = b.xid_watch(self._devices) if b is not None else NA
        return self._devices

    def _drain_xids(self) -> None:
        if isinstance(self._xids, nvml.NotAvailable):
            return
        by_uuid = {u: i for i, u in enumerate(self._uuids) if u}
        for ev in self._xids.poll(64):  # bounded: a storm must not stall a cycle
            idx = by_uuid.get(ev.uuid, -1) if isinstance(ev.uuid, str) else -1
            self._xid_counts[idx] = self._xid_counts.get(idx, 0) + 1
            self._last_xid[idx] = ev.xid

    def sample(self) -> dict[str, Any]:
        if not nvml.available():
            return {"available": False, "reason": f"not available: {nvml.reason()}",
                    "gpus": [], "processes": []}
        devices = self._setup()
        self._drain_xids()
        gpus: list[dict[str, Any]] = []
        procs: list[dict[str, Any]] = []
        graphics: list[list[int]] = []  # [GPU, pid]
        for i, d in enumerate(devices):
            gpus.append(self._one(i, d))
            plist = d.compute_processes()
            for p in [] if plist is NA else plist:
                procs.append({"gpu": i, "pid": p.pid, "used_memory_bytes": _num(p.used_memory)})
            glist = d.graphics_processes()  # for tunerd.jobs.gpuuse: who uses a GPU
            graphics.extend([i, p.pid] for p in ([] if glist is NA else glist))
        return {"available": True, "reason": None, "gpus": gpus, "processes": procs,
                "graphics_processes": graphics}

    def _one(self, i: int, d: nvml.Device) -> dict[str, Any]:
        util = d.utilization
        mem = d.memory_info
        reasons = d.clocks_event_reasons
        rows = d.remapped_rows
        reasons_i = None if reasons is NA else int(reasons)
        # PCIe throughput sleeps ~20 ms inside the driver per call, which is why the
        # whole sampling cycle runs off the event loop (see service.py).
        return {
            "gpu": i,
            "uuid": self._uuids[i] if i < len(self._uuids) else None,
            "name": _opt(d.name),
            "utilization_ratio": _num(util.gpu, 0.01),
            "memory_utilization_ratio": _num(util.memory, 0.01),
            "memory_used_bytes": _num(mem.used),
            "memory_total_bytes": _num(mem.total),
            "power_watts": _num(d.power_usage_mw, 0.001),
            "power_limit_watts": _num(d.enforced_power_limit_mw, 0.001),
            "temperature_celsius": _num(d.temperature_c),
            "sm_clock_hertz": _num(d.sm_clock_mhz, 1e6),
            "memory_clock_hertz": _num(d.memory_clock_mhz, 1e6),
            "pcie_link_generation": _opt(d.pcie_link_gen),
            "pcie_link_width": _opt(d.pcie_link_width),
            "throttle_reasons": reasons_i,
            "throttle_reason_names": [] if reasons_i is None else
            [n for bit, n in THROTTLE_REASONS.items() if reasons_i & bit],
            "pcie_tx_bytes_per_second": _num(d.pcie_throughput_kbs(nvml.PCIE_UTIL_TX_BYTES),
                                             1024.0),
            "pcie_rx_bytes_per_second": _num(d.pcie_throughput_kbs(nvml.PCIE_UTIL_RX_BYTES),
                                             1024.0),
            "ecc_corrected_errors_total": _num(d.ecc_errors_total(uncorrected=False)),
            "ecc_uncorrected_errors_total": _num(d.ecc_errors_total(uncorrected=True)),
            "remapped_rows_correctable": None if rows is NA else float(rows.correctable),
            "remapped_rows_uncorrectable": None if rows is NA else float(rows.uncorrectable),
            "remapped_rows_pending": None if rows is NA else rows.pending,
            "xid_events_total": (self._xid_counts.get(i, 0)
                                 if not isinstance(self._xids, nvml.NotAvailable) else None),
            "last_xid": self._last_xid.get(i),
        }
