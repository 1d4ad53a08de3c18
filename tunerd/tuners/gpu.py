"""GPU settings through NVML: ``gpu:<index>:persistence_mode|compute_mode|power_limit_w``.

Everything goes through the typed GPU layer ``tunerd.adapters.nvml`` (lazy init, ``NA``
instead of exceptions for reads, ``NvmlError`` with its NVML code for writes).
Without a driver or GPU every setting is "not available" in the plan and nothing
fails. Equivalent shell commands: ``nvidia-smi -i N -pm 1``,
``nvidia-smi -i N -c EXCLUSIVE_PROCESS``, ``nvidia-smi -i N -pl WATTS``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tunerd.adapters import nvml
from tunerd.policy.typed import GpuSection
from tunerd.tuners.base import Change, SettingError, to_setting_value

ATTRS = ("persistence_mode", "compute_mode", "power_limit_w")
# NVML_COMPUTEMODE_* values
COMPUTE_MODES = {"default": 0, "exclusive_thread": 1, "prohibited": 2, "exclusive_process": 3}
_MODE_NAMES = {v: k for k, v in COMPUTE_MODES.items()}


def _asked(desired: GpuSection) -> dict[str, str]:
    """attribute -> value (as the kernel-style string) of the settings the policy names."""
    return {a: to_setting_value(v) for a in ATTRS if (v := getattr(desired, a)) is not None}


class GpuTuner:
    kind = "gpu"

    def __init__(self, unavailable_reason: str | None = None) -> None:
        # set when GPU settings must not be applied at all (daemon in topology replay)
        self.unavailable_reason = unavailable_reason

    def count(self) -> int:
        return nvml.device_count()

    def current(self, key: str) -> str | None:
        parts = key.split(":")
        if len(parts) != 3 or parts[2] not in ATTRS or not parts[1].isdigit():
            return None
        index = int(parts[1])
        if index >= self.count():
            return None
        dev = nvml.device(index)
        if isinstance(dev, nvml.NotAvailable):
            return None
        if parts[2] == "persistence_mode":
            v = dev.persistence_mode
            return None if v is nvml.NA else ("1" if v else "0")
        if parts[2] == "compute_mode":
            v = dev.compute_mode
            return None if v is nvml.NA else _MODE_NAMES.get(int(v), str(v))
        v = dev.power_management_limit_mw
        return None if v is nvml.NA else str(int(v) // 1000)

    def wanted(self, desired: GpuSection) -> dict[str, str]:
        asked = _asked(desired)
        return {f"gpu:{i}:{a}": v for i in range(self.count()) for a, v in asked.items()}

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        if keys is None:
            keys = [f"gpu:{i}:{a}" for i in range(self.count()) for a in ATTRS]
        return {k: self.current(k) for k in keys}

    def plan(self, desired: GpuSection) -> list[Change]:
        asked = _asked(desired)
        if not asked:
            return []
        why = self.unavailable_reason or (None if nvml.available() else
                                           nvml.reason() or "NVML not available")
        if why:
            return [Change(f"gpu:*:{a}", None, v, available=False, reason=why)
                    for a, v in asked.items()]
        if self.count() == 0:
            return [Change(f"gpu:*:{a}", None, v, available=False,
                           reason="no GPU on this node") for a, v in asked.items()]
        out = []
        for key, value in self.wanted(desired).items():
            cur = self.current(key)
            if cur is None:
                out.append(Change(key, None, value, available=False,
                                  reason="NVML cannot read this setting on this GPU",
                                  path="nvml"))
            else:
                out.append(Change(key, cur, value, path="nvml"))
        return out

    def _write(self, key: str, value: str) -> None:
        _, idx, attr = key.split(":")
        if attr == "compute_mode" and value not in COMPUTE_MODES:
            raise SettingError(key, value, f"unknown compute mode (one of "
                               f"{', '.join(COMPUTE_MODES)})")
        if not nvml.available():
            raise SettingError(key, value, nvml.reason() or "NVML not available", "nvml")
        dev = nvml.device(int(idx))
        if isinstance(dev, nvml.NotAvailable):
            raise SettingError(key, value, f"no GPU {idx} on this node", "nvml")
        try:
            if attr == "persistence_mode":
                dev.set_persistence_mode(value in ("1", "True"))
            elif attr == "compute_mode":
                dev.set_compute_mode(COMPUTE_MODES[value])
            else:
                dev.set_power_limit_mw(int(value) * 1000)
        except (nvml.NvmlError, ValueError) as err:  # no permission, invalid argument...
            raise SettingError(key, value, f"NVML refused: {err}", "nvml") from err

    def apply(self, change: Change) -> None:
        if change.desired is None:
            raise SettingError(change.key, None, "nothing to set")
        self._write(change.key, change.desired)

    def save_original(self, change: Change) -> dict[str, Any]:
        return {"value": change.current}

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        value = saved.get("value")
        if value is not None and self.current(key) != value:
            self._write(key, str(value))

    def mentions(self, key: str, desired: GpuSection) -> bool:
        return key.rpartition(":")[2] in _asked(desired)
