"""A topology snapshot's NVML replay plus a recording's driver and GPU telemetry.

``tunerd`` config ``debug_nvml_replay = FILE`` (tests only, with ``--topology``):
the snapshot answers device enumeration (tunerd.topology.nvml_replay); the recording
(tests/fixtures/nvml/*.json, as tests/fixtures/nvml/record_telemetry.py writes them)
answers the driver/CUDA versions and, where it has them, each GPU's utilization,
power, temperature, clocks and throttle reasons (GPU i of the snapshot reads GPU
i mod n of the recording). What neither records stays "not available".
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tunerd.errors import UsageError
from tunerd.topology.model import Topology
from tunerd.topology.nvml_replay import ReplayError, ReplayNvml

__all__ = ["RecordedNvml"]


class RecordedNvml(ReplayNvml):
    def __init__(self, topo: Topology, recording: Path) -> None:
        super().__init__(topo)
        try:
            rec = json.loads(recording.read_text())
            self.driver = str(rec["driver_version"])
            self.cuda = int(rec["cuda_driver_version"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"{recording}: not an NVML recording (driver_version, "
                             f"cuda_driver_version): {err}") from err
        gpus = rec.get("gpus")
        self.gpus: list[dict[str, Any]] = gpus if isinstance(gpus, list) else []

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def _rec(self, h: Any, key: str) -> Any:
        if not self.gpus:
            raise ReplayError("NVML_ERROR_NOT_SUPPORTED")
        v = self.gpus[h.gpu % len(self.gpus)].get(key)
        if v is None:
            raise ReplayError("NVML_ERROR_NOT_SUPPORTED")
        return v

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        return SimpleNamespace(**self._rec(h, "utilization"))

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return int(self._rec(h, "power_mw"))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        return int(self._rec(h, "power_limit_mw"))

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return int(self._rec(h, "temperature"))

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        return int(self._rec(h, "sm_clock_mhz"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return int(self._rec(h, "clocks_event_reasons"))
