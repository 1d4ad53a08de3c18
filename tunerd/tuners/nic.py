"""NIC MTU and transmit queue length per interface-name glob (``nic:<if>:mtu|txqueuelen``).

Written through sysfs (/sys/class/net/IF/{mtu,tx_queue_len}), which calls the
same dev_set_mtu()/dev_change_tx_queue_len() as netlink; a value the driver
refuses comes back as EINVAL and is reported with the key and value.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from tunerd.tuners.base import Change, FileTuner, list_section, to_setting_value

# policy key -> sysfs attribute
ATTRS = {"mtu": "mtu", "txqueuelen": "tx_queue_len"}


class NicTuner(FileTuner):
    kind = "nic"

    def __init__(self, sys_root: Path | str = "/sys") -> None:
        self.root = Path(sys_root) / "class" / "net"

    def interfaces(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir())
        except OSError:
            return []

    def path_for(self, key: str) -> Path | None:
        parts = key.split(":")
        if len(parts) != 3 or parts[2] not in ATTRS or "/" in parts[1]:
            return None
        return self.root / parts[1] / ATTRS[parts[2]]

    def known_keys(self) -> list[str]:
        return [f"nic:{i}:{a}" for i in self.interfaces() for a in ATTRS]

    def wanted(self, desired: Any, only: str | None = None) -> dict[str, str]:
        """Later entries override earlier ones for an interface both match."""
        out: dict[str, str] = {}
        names = [only] if only else self.interfaces()
        for entry in list_section(desired):
            pattern = str(entry.get("match", ""))
            for ifname in names:
                if not fnmatch.fnmatchcase(ifname, pattern):
                    continue
                for attr in ATTRS:
                    if entry.get(attr) is not None:
                        out[f"nic:{ifname}:{attr}"] = to_setting_value(entry[attr])
        return out

    def plan_device(self, desired: Any, ifname: str) -> list[Change]:
        """The plan for one interface (used when a uevent says it appeared)."""
        return self.plan_wanted(self.wanted(desired, only=ifname))

    def mentions(self, key: str, desired: Any) -> bool:
        # by glob, not by the interfaces present now: a NIC that went away is still named
        parts = key.split(":")
        return len(parts) == 3 and key in self.wanted(desired, only=parts[1])
