"""Block queue settings per device glob (``block:<dev>:scheduler|read_ahead_kb|nr_requests``).

The scheduler file lists the choices with the active one in brackets
("[mq-deadline] none"); writing a bare name selects it.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from tunerd.tuners.base import Change, FileTuner, bracketed, list_section, to_setting_value

ATTRS = ("scheduler", "read_ahead_kb", "nr_requests")


class BlockTuner(FileTuner):
    kind = "block"

    def __init__(self, sys_root: Path | str = "/sys") -> None:
        self.root = Path(sys_root) / "block"

    def devices(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir())
        except OSError:
            return []

    def path_for(self, key: str) -> Path | None:
        parts = key.split(":")
        if len(parts) != 3 or parts[2] not in ATTRS or "/" in parts[1]:
            return None
        return self.root / parts[1] / "queue" / parts[2]

    def parse(self, key: str, raw: str) -> str:
        return bracketed(raw) if key.endswith(":scheduler") else raw.strip()

    def known_keys(self) -> list[str]:
        return [f"block:{d}:{a}" for d in self.devices() for a in ATTRS]

    def wanted(self, desired: Any, only: str | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        names = [only] if only else self.devices()
        for entry in list_section(desired):
            pattern = str(entry.get("match", ""))
            for dev in names:
                if fnmatch.fnmatchcase(dev, pattern):
                    for attr in ATTRS:
                        if entry.get(attr) is not None:
                            out[f"block:{dev}:{attr}"] = to_setting_value(entry[attr])
        return out

    def plan_device(self, desired: Any, dev: str) -> list[Change]:
        return self.plan_wanted(self.wanted(desired, only=dev))

    def mentions(self, key: str, desired: Any) -> bool:
        parts = key.split(":")
        return len(parts) == 3 and key in self.wanted(desired, only=parts[1])
