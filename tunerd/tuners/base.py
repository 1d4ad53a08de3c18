"""What every tuner shares: the Change record, the write error, sysfs/procfs file access.

A tuner is one small class per setting kind with ``read()``, ``plan(desired)``,
``apply(change)`` and ``revert(key, saved)``; ``desired`` is its typed policy
section (tunerd.policy.typed). Reads degrade (a missing file makes a setting
"not available"); writes fail loudly with an ``SettingError`` that carries errno,
key, value and path.
"""

from __future__ import annotations

import errno as errno_mod
import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from tunerd.adapters.procfs import read_value
from tunerd.base.errors import Failed

__all__ = [
    "Change",
    "DeviceRule",
    "SettingError",
    "Tuner",
    "bracketed",
    "normalize",
    "to_setting_value",
    "write_text",
]


S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


def normalize(value: str | None) -> str | None:
    """Whitespace runs folded: "4096\\t87380  268435456" == "4096 87380 268435456"."""
    return None if value is None else " ".join(value.split())


def to_setting_value(value: str | int | bool) -> str:
    """A policy value as the kernel spells it (bools are 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return normalize(str(value)) or ""


def bracketed(text: str) -> str:
    """The selected word of a sysfs choice list: "none [mq-deadline] kyber" -> "mq-deadline"."""
    words = text.split()
    for w in words:
        if w.startswith("[") and w.endswith("]"):
            return w[1:-1]
    # a list with a single choice (e.g. "none" on some devices) is printed without brackets
    return words[0] if len(words) == 1 else text.strip()


@dataclass
class Change:
    """One setting: what it is now, what the policy wants, and whether it can be set here."""

    key: str  # KIND:NAME[:ATTR], e.g. "sysctl:net.core.somaxconn", "nic:veth0:mtu"
    current: str | None
    desired: str | None
    available: bool = True
    reason: str | None = None  # why not available
    path: str | None = None  # the file (or API) the setting lives in

    @property
    def needed(self) -> bool:
        """Available and different from what the policy wants."""
        return self.available and normalize(self.current) != normalize(self.desired)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SettingError(Failed):
    """The kernel (or driver) refused a write: carries errno, key, value and path."""

    def __init__(self, key: str, value: str | None, err: OSError | str,
                 path: str | None = None) -> None:
        if isinstance(err, OSError):
            num = err.errno or 0
            text = err.strerror or str(err)
        else:
            num, text = 0, err
        name = errno_mod.errorcode.get(num, "") if num else ""
        where = f" ({path})" if path else ""
        what = f"{name} {text}".strip() if name else text
        super().__init__(f"{key} = {value!r}: {what}{where}", key=key, value=value,
                         errno=num, errno_name=name or None, path=path)
        self.key = key
        self.value = value
        self.errno = num

    def to_error(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "message": self.message,
                "errno": self.errno or None, "errno_name": self.details.get("errno_name"),
                "path": self.details.get("path")}


def write_text(path: Path, value: str, key: str) -> None:
    """Write one value as `echo -n VALUE > FILE` does (O_TRUNC: harmless on sysfs, needed
    on a plain file in a test tree); an OSError becomes SettingError."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    except OSError as err:
        raise SettingError(key, value, err, str(path)) from err
    try:
        # one write() call: sysfs/procfs parse the whole buffer of a single write
        os.write(fd, value.encode())
    except OSError as err:
        raise SettingError(key, value, err, str(path)) from err
    finally:
        os.close(fd)


class Tuner(Protocol[S_contra]):
    """One setting kind (sysctl, nic, nccl, ...); ``S_contra`` is its policy section's type."""

    kind: str  # the key prefix: "sysctl", "nic", ...

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        """Current values of ``keys`` (default: every setting of this kind found here)."""
        ...

    def plan(self, desired: S_contra) -> list[Change]:
        """One Change per setting the policy section names (``needed`` says if it differs)."""
        ...

    def apply(self, change: Change) -> None:
        """Write ``change.desired``; raises SettingError."""
        ...

    def save_original(self, change: Change) -> dict[str, Any]:
        """What to keep in state.json so that ``revert`` can restore this setting."""
        ...

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        """Put back the original ``saved`` (from ``save_original``); raises SettingError."""
        ...

    def mentions(self, key: str, desired: S_contra) -> bool:
        """Whether the policy section ``desired`` still names setting ``key``."""
        ...


class FileTuner(Generic[S]):
    """A tuner whose every key is one sysfs/procfs file holding one value."""

    kind = ""
    # True: a missing file is a setting the kernel refuses (the apply fails with ENOENT,
    # e.g. a sysctl this kernel lacks); False: "not available" here (e.g. no THP)
    missing_is_error = False

    def path_for(self, key: str) -> Path | None:
        raise NotImplementedError

    def wanted(self, desired: S) -> dict[str, str]:
        """key -> desired value for a policy section."""
        raise NotImplementedError

    def known_keys(self) -> list[str]:
        return []

    def parse(self, key: str, raw: str) -> str:
        return normalize(raw) or ""

    def missing_reason(self, key: str, path: Path | None) -> str:
        return f"{path} does not exist" if path else f"no such setting {key}"

    def current(self, key: str) -> str | None:
        path = self.path_for(key)
        raw = read_value(path) if path else None
        return None if raw is None else self.parse(key, raw)

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        return {k: self.current(k) for k in (self.known_keys() if keys is None else keys)}

    def plan(self, desired: S) -> list[Change]:
        return self.plan_wanted(self.wanted(desired))

    def plan_wanted(self, wanted: dict[str, str]) -> list[Change]:
        changes = []
        for key, value in wanted.items():
            path = self.path_for(key)
            cur = self.current(key)
            if cur is None and self.missing_is_error:
                changes.append(Change(key, None, value, path=str(path) if path else None))
            elif cur is None:
                changes.append(Change(key, None, value, available=False,
                                      reason=self.missing_reason(key, path),
                                      path=str(path) if path else None))
            else:
                changes.append(Change(key, cur, value, path=str(path)))
        return changes

    def apply(self, change: Change) -> None:
        path = self.path_for(change.key)
        if path is None or change.desired is None:
            raise SettingError(change.key, change.desired, "not available here")
        write_text(path, change.desired, change.key)

    def save_original(self, change: Change) -> dict[str, Any]:
        return {"value": change.current}

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        value = saved.get("value")
        path = self.path_for(key)
        if value is None or path is None:
            return  # nothing was there before: nothing to put back
        if normalize(self.current(key)) != normalize(str(value)):
            write_text(path, str(value), key)

    def mentions(self, key: str, desired: S) -> bool:
        return key in self.wanted(desired)


class DeviceRule(Protocol):
    """A ``[[nic]]`` / ``[[block]]`` entry: a device-name glob and optional attributes."""

    @property
    def match(self) -> str: ...


class DeviceGlobTuner(FileTuner[Sequence[DeviceRule]]):
    """Per-device files matched by name glob: ``KIND:<device>:<attr>`` (NICs, block queues).

    ``attrs`` maps a policy attribute to the file below ``root/<device>/``. Later policy
    entries override earlier ones for a device both match.
    """

    attrs: dict[str, str] = {}

    def __init__(self, root: Path) -> None:
        self.root = root

    def devices(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir())
        except OSError:
            return []

    def path_for(self, key: str) -> Path | None:
        parts = key.split(":")
        if len(parts) != 3 or parts[2] not in self.attrs or "/" in parts[1]:
            return None
        return self.root / parts[1] / self.attrs[parts[2]]

    def known_keys(self) -> list[str]:
        return [f"{self.kind}:{d}:{a}" for d in self.devices() for a in self.attrs]

    def wanted(self, desired: Sequence[DeviceRule], only: str | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        names = [only] if only else self.devices()
        for entry in desired:
            for dev in names:
                if not fnmatch.fnmatchcase(dev, entry.match):
                    continue
                for attr in self.attrs:
                    value = getattr(entry, attr)
                    if value is not None:
                        out[f"{self.kind}:{dev}:{attr}"] = to_setting_value(value)
        return out

    def plan_device(self, desired: Sequence[DeviceRule], dev: str) -> list[Change]:
        """The plan for one device (used when a uevent says it appeared)."""
        return self.plan_wanted(self.wanted(desired, only=dev))

    def mentions(self, key: str, desired: Sequence[DeviceRule]) -> bool:
        # by glob, not by the devices present now: a NIC that went away is still named
        parts = key.split(":")
        return len(parts) == 3 and key in self.wanted(desired, only=parts[1])
