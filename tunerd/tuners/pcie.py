"""ACS source validation cleared on the bridges between each GPU and its NIC (opt-in).

``[pcie] clear_acs = true``: for each GPU and its fabric NIC (tunerd.topology.iopath),
every bridge on the path between them whose ACS Control register (extended capability
0x000D, +6) has Source Validation set gets it cleared, as NCCL's troubleshooting guide
asks (``setpci -s BDF ECAP_ACS+6.w=0000``); keys ``pcie:<bdf>:acs``, values the register
in hex. Written through sysfs's ``config`` file (the same config-space write setpci
does), the original register saved first and written back by ``revert``. A reboot sets
ACS again: the daemon applies it at every start. Never inside a virtual machine, where
ACS is what keeps passed-through devices isolated: the plan says so and changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tunerd.adapters.procfs import read_value
from tunerd.policy.typed import PcieSection
from tunerd.topology.model import Topology
from tunerd.topology.pcicfg import ACS_SV, acs_offset
from tunerd.tuners.base import Change, SettingError

__all__ = ["PcieTuner", "in_vm"]


def in_vm(proc_root: Path, sys_root: Path) -> str | None:
    """Why this looks like a virtual machine (None: bare metal, as far as we can tell)."""
    for line in (read_value(proc_root / "cpuinfo") or "").splitlines():
        if line.startswith("flags") and " hypervisor" in line:
            return "the CPU flags name a hypervisor (/proc/cpuinfo)"
    vendor = read_value(sys_root / "class/dmi/id/sys_vendor") or ""
    if vendor in ("QEMU", "KVM", "VMware, Inc.", "Xen", "Microsoft Corporation",
                  "Amazon EC2", "Google", "innotek GmbH"):
        return f"DMI system vendor {vendor!r}"
    return None


class PcieTuner:
    kind = "pcie"

    def __init__(self, proc_root: Path | str = "/proc", sys_root: Path | str = "/sys",
                 topology: Callable[[], Topology | None] | None = None) -> None:
        self.proc = Path(proc_root)
        self.sys = Path(sys_root)
        self.topology = topology or (lambda: None)

    def bridges(self) -> list[str]:
        """Bridges on the path between each GPU and its NIC, in order, once each."""
        from tunerd.topology.iopath import gpu_nics

        topo = self.topology()
        if topo is None:
            return []
        out: dict[str, None] = {}
        pairs = gpu_nics(topo)
        for g in topo.gpus:
            for p in pairs.get(g.index, ()):
                start = max(len(p.shared_path) - 1, 1)
                for b in (*g.pcie_path[start:], *p.nic.pcie_path[start:]):
                    if not b.startswith("pci"):
                        out[b] = None
        return list(out)

    def _config(self, bdf: str) -> Path:
        return self.sys / "bus/pci/devices" / bdf / "config"

    def _register(self, bdf: str) -> tuple[int, int] | None:
        """(offset of the ACS Control register, its value); None: no ACS capability."""
        try:
            cfg = self._config(bdf).read_bytes()
        except OSError:
            return None
        off = acs_offset(cfg)
        if off is None or off + 8 > len(cfg):
            return None
        return off + 6, int.from_bytes(cfg[off + 6:off + 8], "little")

    def current(self, key: str) -> str | None:
        reg = self._register(key.split(":", 1)[1].rsplit(":", 1)[0])
        return None if reg is None else f"{reg[1]:04x}"

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        return {k: self.current(k) for k in (keys or [])}

    def plan(self, desired: PcieSection) -> list[Change]:
        if not desired.clear_acs:
            return []
        vm = in_vm(self.proc, self.sys)
        changes = []
        for bdf in self.bridges():
            key = f"pcie:{bdf}:acs"
            reg = self._register(bdf)
            if reg is None:
                continue  # no ACS capability on this bridge: nothing to clear
            cur = f"{reg[1]:04x}"
            if vm is not None:
                changes.append(Change(key, cur, None, available=False,
                                      reason=f"inside a virtual machine ({vm}): ACS keeps "
                                             "passed-through devices isolated; not cleared",
                                      path=str(self._config(bdf))))
                continue
            changes.append(Change(key, cur, f"{reg[1] & ~ACS_SV:04x}",
                                  path=str(self._config(bdf))))
        return changes

    def _write(self, key: str, value: str | None) -> None:
        bdf = key.split(":", 1)[1].rsplit(":", 1)[0]
        reg = self._register(bdf)
        path = self._config(bdf)
        if reg is None or value is None:
            raise SettingError(key, value, "no ACS capability", str(path))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, int(value, 16).to_bytes(2, "little"), reg[0])
            finally:
                os.close(fd)
        except OSError as err:
            raise SettingError(key, value, err, str(path)) from err

    def apply(self, change: Change) -> None:
        if in_vm(self.proc, self.sys) is not None:
            raise SettingError(change.key, change.desired, "refused inside a virtual machine")
        self._write(change.key, change.desired)

    def save_original(self, change: Change) -> dict[str, Any]:
        return {"value": change.current}

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        value = saved.get("value")
        if isinstance(value, str) and self.current(key) != value:
            self._write(key, value)

    def mentions(self, key: str, desired: PcieSection) -> bool:
        return desired.clear_acs and key.endswith(":acs")
