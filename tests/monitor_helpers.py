"""Helpers for the monitor tests: an NVML telemetry replay (the one allowed fake).

TelemetryReplay is a recorded libnvidia-ml: it has pynvml's function names and raises
pynvml's own NVMLError with the recorded NVML return code, so the real adapter
(tunerd.adapters.nvml.NvmlBackend: versioned fallbacks, error codes) runs on it unchanged.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from tests.helpers import FIXTURES

TELEMETRY = FIXTURES / "nvml" / "h100x2-telemetry.json"


def nvml_error(code: int) -> Exception:
    """What real pynvml raises for an NVML return code (NVMLError_NotSupported, ...)."""
    return pynvml.NVMLError(code)  # type: ignore[no-any-return]


class TelemetryReplay:
    """Answers pynvml's getters from a recorded reading; absent values raise like NVML."""

    def __init__(self, path: Path = TELEMETRY) -> None:
        self.rec: dict[str, Any] = json.loads(path.read_text())
        self.gpus: list[dict[str, Any]] = self.rec["gpus"]
        self.events = list(self.rec.get("xid_events") or [])
        self.registered: set[int] = set()

    def _g(self, h: int) -> dict[str, Any]:
        return self.gpus[h]

    @staticmethod
    def _need(v: Any) -> Any:
        if v is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return v

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self.rec["driver_version"])

    def nvmlSystemGetNVMLVersion(self) -> str:
        return str(self.rec["nvml_version"])

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self.rec["cuda_driver_version"])

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return str(self._g(h)["uuid"])

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self._g(h)["name"])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(**self._g(h)["utilization"])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(**self._g(h)["memory"])

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(self._need(self._g(h)["power_mw"]))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return int(self._need(self._g(h)["power_limit_mw"]))

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == 0
        return int(self._g(h)["temperature"])

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        key = {0: "graphics_clock_mhz", 1: "sm_clock_mhz", 2: "mem_clock_mhz"}[clock]
        return int(self._need(self._g(h).get(key)))

    # a recording without a field answers as a driver without the query does
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return int(self._need(self._g(h).get("pcie_link_gen")))

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return int(self._need(self._g(h).get("pcie_link_width")))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return int(self._need(self._g(h).get("pcie_link_gen_max")))

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return int(self._need(self._g(h).get("pcie_link_width_max")))

    def nvmlDeviceGetPciInfo_v3(self, h: int) -> Any:
        bus = self._need(self._g(h).get("pci_bus_id"))
        return SimpleNamespace(busId=bus.encode())

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        return int(self._need(self._g(h).get("numa_node_id")))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return int(self._g(h)["clocks_event_reasons"])

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        key = "pcie_tx_kbs" if counter == 0 else "pcie_rx_kbs"
        return int(self._need(self._g(h)[key]))

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return int(self._g(h)["ecc"]["corrected" if kind == 0 else "uncorrected"])

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        a, b, c, d = self._g(h)["remapped_rows"]
        return a, b, c, d

    # only the unversioned name exists here: exercises the fallback chain
    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(**p) for p in self._g(h)["processes"]]

    # graphics processes (an X server's): the versioned name, as drivers since 2022 have
    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=None) for pid in self._g(h)
                .get("graphics_pids", [])]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, es: str) -> None:
        self.registered.add(h)

    def nvmlEventSetWait_v2(self, es: str, timeout_ms: int) -> Any:
        if not self.events:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        ev = self.events.pop(0)
        return SimpleNamespace(device=ev["gpu"], eventType=0x8, eventData=ev["xid"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
