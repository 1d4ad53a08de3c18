"""GPU settings through NVML: ``gpu:<index>:persistence_mode|compute_mode|power_limit_w``.

Everything goes through ``tunerd.nvml`` (lazy init, "not available" instead of
exceptions for reads). Without a driver or GPU every setting is "not available"
in the plan and nothing fails. Equivalent shell commands:
``nvidia-smi -i N -pm 1``, ``nvidia-smi -i N -c EXCLUSIVE_PROCESS``,
``nvidia-smi -i N -pl WATTS``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tunerd import nvml
from tunerd.policy.typed import GpuSection
from tunerd.tuners.base import Change, SettingError, to_setting_value

ATTRS = ("persistence_mode", "compute_mode", "power_limit_w")
# NVML_COMPUTEMODE_* values
COMPUTE_MODES = {"default": 0, "exclusive_thread": 1, "prohibited": 2, "exclusive_process": 3}
_MODE_NAMES = {v: k for k, v in COMPUTE_MODES.items()}


def _asked(desired: GpuSection) -> dict[str, str]:
    """attribute -> value (as the kernel-style string) of the settings the policy names."""
    return {a: to_setting_value(v) for a in ATTRS if (v := getattr(desired, a)) is not None}


def _raw(fn: str, *args: Any) -> Any:
    """Call an NVML setter so that its error surfaces (reads use nvml.call instead)."""
    mod = nvml.module()
    if mod is None:
        raise RuntimeError(nvml.reason() or "NVML not available")
    return getattr(mod, fn)(*args)


class GpuTuner:
    kind = "gpu"

    def __init__(self, unavailable_reason: str | None = None) -> None:
        # set when GPU settings must not be applied at all (daemon in topology replay)
        self.unavailable_reason = unavailable_reason

    def count(self) -> int:
        n = nvml.call("nvmlDeviceGetCount", default=0)
        return n if isinstance(n, int) else 0

    def _handle(self, index: int) -> Any:
        return nvml.call("nvmlDeviceGetHandleByIndex", index)

    def current(self, key: str) -> str | None:
        parts = key.split(":")
        if len(parts) != 3 or parts[2] not in ATTRS or not parts[1].isdigit():
            return None
        index = int(parts[1])
        if index >= self.count():
            return None
        h = self._handle(index)
        if h is nvml.NA:
            return None
        if parts[2] == "persistence_mode":
            v = nvml.call("nvmlDeviceGetPersistenceMode", h)
            return None if v is nvml.NA else ("1" if int(v) else "0")
        if parts[2] == "compute_mode":
            v = nvml.call("nvmlDeviceGetComputeMode", h)
            return None if v is nvml.NA else _MODE_NAMES.get(int(v), str(v))
        v = nvml.call("nvmlDeviceGetPowerManagementLimit", h)  # in milliwatts
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
        try:
            h = _raw("nvmlDeviceGetHandleByIndex", int(idx))
            if attr == "persistence_mode":
                _raw("nvmlDeviceSetPersistenceMode", h, 1 if value in ("1", "True") else 0)
            elif attr == "compute_mode":
                if value not in COMPUTE_MODES:
                    raise SettingError(key, value, f"unknown compute mode (one of "
                                       f"{', '.join(COMPUTE_MODES)})")
                _raw("nvmlDeviceSetComputeMode", h, COMPUTE_MODES[value])
            else:
                _raw("nvmlDeviceSetPowerManagementLimit", h, int(value) * 1000)
        except SettingError:
            raise
        except Exception as err:  # NVMLError_NoPermission, _InvalidArgument, ...
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
