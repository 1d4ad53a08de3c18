"""Block queue settings per device glob (``block:<dev>:scheduler|read_ahead_kb|nr_requests``).

The scheduler file lists the choices with the active one in brackets
("[mq-deadline] none"); writing a bare name selects it.
"""

from __future__ import annotations

from pathlib import Path

from tunerd.tuners.base import DeviceGlobTuner, bracketed

ATTRS = ("scheduler", "read_ahead_kb", "nr_requests")


class BlockTuner(DeviceGlobTuner):
    kind = "block"
    attrs = {a: f"queue/{a}" for a in ATTRS}

    def __init__(self, sys_root: Path | str = "/sys") -> None:
        super().__init__(Path(sys_root) / "block")

    def parse(self, key: str, raw: str) -> str:
        return bracketed(raw) if key.endswith(":scheduler") else raw.strip()
