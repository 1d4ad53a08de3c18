"""A topology snapshot's GPU replay plus a recording's driver and GPU telemetry.

``tunerd`` config ``debug_nvml_replay = FILE`` (tests only, with ``--topology``):
the snapshot answers device enumeration and locality, the recording
(tests/fixtures/nvml/*.json, as tests/fixtures/nvml/record_telemetry.py writes them)
the driver/CUDA versions and, where it has them, each GPU's utilization, power,
temperature, clocks and throttle reasons (GPU i of the snapshot reads GPU i mod n of
the recording). What neither records stays ``NA``. It is the typed replay backend of
tunerd.topology.nvml_replay with the recording loaded and checked.
"""

from __future__ import annotations

import json
from pathlib import Path

from tunerd.base.errors import UsageError
from tunerd.topology.model import Topology
from tunerd.topology.nvml_replay import ReplayNvml

__all__ = ["RecordedNvml"]


class RecordedNvml(ReplayNvml):
    def __init__(self, topo: Topology, recording: Path,
                 processes: Path | None = None) -> None:
        try:
            rec = json.loads(recording.read_text())
            str(rec["driver_version"])
            int(rec["cuda_driver_version"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"{recording}: not an NVML recording (driver_version, "
                             f"cuda_driver_version): {err}") from err
        super().__init__(topo, rec, processes)
