"""CPU frequency governor on every CPU (``cpu:governor``).

Reads /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor. Virtual machines
and some kernels have no cpufreq at all: the setting is then "not available".
The ``[cpu] housekeeping`` set is only used by placement: nothing to apply here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunerd.adapters.procfs import read_value
from tunerd.policy.typed import CpuSection
from tunerd.tuners.base import Change, SettingError, normalize, write_text

KEY = "cpu:governor"
_CPU_DIR = re.compile(r"cpu(\d+)$")


class CpuTuner:
    kind = "cpu"

    def __init__(self, sys_root: Path | str = "/sys") -> None:
        self.root = Path(sys_root) / "devices" / "system" / "cpu"

    def governor_files(self) -> dict[str, Path]:
        """cpuN -> its scaling_governor file, for CPUs that have cpufreq."""
        out: dict[str, Path] = {}
        try:
            dirs = sorted(self.root.iterdir(), key=lambda p: p.name)
        except OSError:
            return out
        for d in dirs:
            m = _CPU_DIR.match(d.name)
            f = d / "cpufreq" / "scaling_governor"
            if m and f.exists():
                out[d.name] = f
        return dict(sorted(out.items(), key=lambda kv: int(kv[0][3:])))

    def per_cpu(self) -> dict[str, str]:
        vals = {}
        for cpu, f in self.governor_files().items():
            v = read_value(f)
            if v is not None:
                vals[cpu] = v
        return vals

    def current(self, key: str = KEY) -> str | None:
        vals = set(self.per_cpu().values())
        if not vals:
            return None
        # CPUs that disagree show all governors in use, which never equals a desired one
        return vals.pop() if len(vals) == 1 else "mixed: " + ",".join(sorted(vals))

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        return {KEY: self.current()}

    def plan(self, desired: CpuSection) -> list[Change]:
        gov = desired.governor
        if gov is None:
            return []
        cur = self.current()
        if cur is None:
            return [Change(KEY, None, str(gov), available=False,
                           reason=f"no cpufreq on this machine ({self.root}/cpu*/cpufreq absent)")]
        return [Change(KEY, cur, str(gov), path=str(self.root / "cpu*/cpufreq/scaling_governor"))]

    def apply(self, change: Change) -> None:
        files = self.governor_files()
        if not files or change.desired is None:
            raise SettingError(KEY, change.desired, "no cpufreq on this machine")
        for f in files.values():
            if normalize(read_value(f)) != change.desired:
                write_text(f, change.desired, KEY)

    def save_original(self, change: Change) -> dict[str, Any]:
        return {"value": change.current, "per_cpu": self.per_cpu()}

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        files = self.governor_files()
        for cpu, gov in (saved.get("per_cpu") or {}).items():
            f = files.get(cpu)
            if f is not None and read_value(f) != gov:
                write_text(f, str(gov), KEY)

    def mentions(self, key: str, desired: CpuSection) -> bool:
        return key == KEY and desired.governor is not None
