"""GPU sampler: every number through ``tunerd.nvml.call`` so one missing metric is NA.

Without a driver the sample is ``{"available": False, "reason": ...}`` and no
GPU series exist. Units follow the metric names: bytes, watts, celsius, hertz.
"""

from __future__ import annotations

from typing import Any

from tunerd import nvml
from tunerd.nvml import NA

# pynvml constants, spelled out so this module does not need pynvml to import
TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU            (nvidia-smi --query-gpu=temperature.gpu)
CLOCK_SM = 1  # NVML_CLOCK_SM                           (clocks.sm, MHz)
PCIE_UTIL_TX_BYTES, PCIE_UTIL_RX_BYTES = 0, 1  # NVML_PCIE_UTIL_* (KB/s over a 20 ms window)
FI_PCIE_COUNT_TX_BYTES, FI_PCIE_COUNT_RX_BYTES = 197, 198  # NVML_FI_DEV_PCIE_COUNT_*_BYTES
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED = 0, 1
AGGREGATE_ECC = 1  # NVML_AGGREGATE_ECC: lifetime counts (volatile ones reset at driver load)
EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError

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


def _text(v: Any) -> str | None:
    if v is NA or v is None:
        return None
    return v.decode() if isinstance(v, bytes) else str(v)


class GpuSampler:
    """Samples every GPU NVML reports; keeps handles and the Xid event set between cycles."""

    def __init__(self) -> None:
        self._handles: list[Any] | None = None
        self._uuids: list[str | None] = []
        self._events: Any = NA
        self._xid_counts: dict[int, int] = {}
        self._last_xid: dict[int, int] = {}

    def _setup(self) -> list[Any]:
        if self._handles is not None:
            return self._handles
        count = nvml.call("nvmlDeviceGetCount", default=0)
        handles = [nvml.call("nvmlDeviceGetHandleByIndex", i) for i in range(int(count))]
        self._handles = [h for h in handles if h is not NA]
        self._uuids = [_text(nvml.call("nvmlDeviceGetUUID", h)) for h in self._handles]
        # Xid critical errors arrive as NVML events; not every GPU or driver supports them.
        ev = nvml.call("nvmlEventSetCreate")
        if ev is not NA:
            for h in self._handles:
                nvml.call("nvmlDeviceRegisterEvents", h, EVENT_XID_CRITICAL, ev, default=None)
        self._events = ev
        return self._handles

    def _drain_xids(self) -> None:
        if self._events is NA:
            return
        by_uuid = {u: i for i, u in enumerate(self._uuids) if u}
        for _ in range(64):  # bounded: a storm of events must not stall a cycle
            data = nvml.call("nvmlEventSetWait_v2|nvmlEventSetWait", self._events, 0)
            if data is NA or data is None:  # NVML_ERROR_TIMEOUT: no event pending
                return
            # the event names its device by handle; a handle is a fresh ctypes object, so
            # match on the UUID (-1 when the device cannot be told)
            idx = by_uuid.get(_text(nvml.call("nvmlDeviceGetUUID", data.device)) or "", -1)
            self._xid_counts[idx] = self._xid_counts.get(idx, 0) + 1
            self._last_xid[idx] = int(getattr(data, "eventData", 0) or 0)

    def sample(self) -> dict[str, Any]:
        if not nvml.available():
            return {"available": False, "reason": f"not available: {nvml.reason()}",
                    "gpus": [], "processes": []}
        handles = self._setup()
        self._drain_xids()
        gpus: list[dict[str, Any]] = []
        procs: list[dict[str, Any]] = []
        for i, h in enumerate(handles):
            gpus.append(self._one(i, h))
            plist = nvml.call("nvmlDeviceGetComputeRunningProcesses_v3|"
                              "nvmlDeviceGetComputeRunningProcesses_v2|"
                              "nvmlDeviceGetComputeRunningProcesses", h, default=[])
            for p in plist or []:
                procs.append({"gpu": i, "pid": int(p.pid),
                              "used_memory_bytes": _num(getattr(p, "usedGpuMemory", None))})
        return {"available": True, "reason": None, "gpus": gpus, "processes": procs}

    def _one(self, i: int, h: Any) -> dict[str, Any]:
        util = nvml.call("nvmlDeviceGetUtilizationRates", h)
        mem = nvml.call("nvmlDeviceGetMemoryInfo", h)
        reasons = nvml.call("nvmlDeviceGetCurrentClocksEventReasons|"
                            "nvmlDeviceGetCurrentClocksThrottleReasons", h)
        tx, rx = self._pcie(h)
        rows = nvml.call("nvmlDeviceGetRemappedRows", h)
        reasons_i = None if reasons is NA else int(reasons)
        return {
            "gpu": i,
            "uuid": self._uuids[i] if i < len(self._uuids) else None,
            "name": _text(nvml.call("nvmlDeviceGetName", h)),
            "utilization_ratio": None if util is NA else _num(util.gpu, 0.01),
            "memory_utilization_ratio": None if util is NA else _num(util.memory, 0.01),
            "memory_used_bytes": None if mem is NA else _num(mem.used),
            "memory_total_bytes": None if mem is NA else _num(mem.total),
            "power_watts": _num(nvml.call("nvmlDeviceGetPowerUsage", h), 0.001),
            "power_limit_watts": _num(nvml.call("nvmlDeviceGetEnforcedPowerLimit", h), 0.001),
            "temperature_celsius": _num(nvml.call("nvmlDeviceGetTemperature", h,
                                                  TEMPERATURE_GPU)),
            "sm_clock_hertz": _num(nvml.call("nvmlDeviceGetClockInfo", h, CLOCK_SM), 1e6),
            "throttle_reasons": reasons_i,
            "throttle_reason_names": [] if reasons_i is None else
            [n for bit, n in THROTTLE_REASONS.items() if reasons_i & bit],
            "pcie_tx_bytes_per_second": tx,
            "pcie_rx_bytes_per_second": rx,
            "ecc_corrected_errors_total": _num(nvml.call(
                "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_CORRECTED, AGGREGATE_ECC)),
            "ecc_uncorrected_errors_total": _num(nvml.call(
                "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_UNCORRECTED, AGGREGATE_ECC)),
            "remapped_rows_correctable": None if rows is NA else _num(rows[0]),
            "remapped_rows_uncorrectable": None if rows is NA else _num(rows[1]),
            "remapped_rows_pending": None if rows is NA else bool(rows[2]),
            "xid_events_total": self._xid_counts.get(i, 0) if self._events is not NA else None,
            "last_xid": self._last_xid.get(i),
        }

    def _pcie(self, h: Any) -> tuple[float | None, float | None]:
        # nvmlDeviceGetPcieThroughput sleeps ~20 ms inside the driver per call, which is
        # why the whole sampling cycle runs off the event loop (see service.py).
        tx = _num(nvml.call("nvmlDeviceGetPcieThroughput", h, PCIE_UTIL_TX_BYTES), 1024.0)
        rx = _num(nvml.call("nvmlDeviceGetPcieThroughput", h, PCIE_UTIL_RX_BYTES), 1024.0)
        return tx, rx
