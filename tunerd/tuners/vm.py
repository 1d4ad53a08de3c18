"""Memory-management settings: transparent hugepages and automatic NUMA balancing.

``vm:transparent_hugepage`` / ``vm:transparent_hugepage_defrag`` live in
/sys/kernel/mm/transparent_hugepage/{enabled,defrag} ("always [madvise] never");
``vm:numa_balancing`` is /proc/sys/kernel/numa_balancing, absent on kernels
built without NUMA balancing (then "not available").
"""

from __future__ import annotations

from pathlib import Path

from tunerd.policy.typed import VmSection
from tunerd.tuners.base import FileTuner, bracketed, to_setting_value

KEYS = ("transparent_hugepage", "transparent_hugepage_defrag", "numa_balancing")


class VmTuner(FileTuner[VmSection]):
    kind = "vm"

    def __init__(self, proc_root: Path | str = "/proc", sys_root: Path | str = "/sys") -> None:
        thp = Path(sys_root) / "kernel" / "mm" / "transparent_hugepage"
        self.paths = {
            "vm:transparent_hugepage": thp / "enabled",
            "vm:transparent_hugepage_defrag": thp / "defrag",
            "vm:numa_balancing": Path(proc_root) / "sys" / "kernel" / "numa_balancing",
        }

    def path_for(self, key: str) -> Path | None:
        return self.paths.get(key)

    def parse(self, key: str, raw: str) -> str:
        if key == "vm:numa_balancing":
            return raw.strip()
        return bracketed(raw)

    def known_keys(self) -> list[str]:
        return list(self.paths)

    def wanted(self, desired: VmSection) -> dict[str, str]:
        return {f"vm:{k}": to_setting_value(v) for k in KEYS
                if (v := getattr(desired, k)) is not None}

    def missing_reason(self, key: str, path: Path | None) -> str:
        if key == "vm:numa_balancing":
            return f"kernel has no automatic NUMA balancing ({path} does not exist)"
        return f"kernel has no transparent hugepages ({path} does not exist)"
