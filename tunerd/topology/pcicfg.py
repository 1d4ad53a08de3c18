"""PCI configuration space from sysfs (``/sys/bus/pci/devices/BDF/config``), read-only.

What the I/O-path checks need, decoded without setpci/lspci so that they run on
recorded trees: the ACS Control register of a bridge (extended capability 0x000D,
register at +6: bit 0 = Source Validation, the bit NCCL asks to clear), the PCI
Express Device Control register (capability 0x10, +8: bit 4 = Enable Relaxed
Ordering), the link's current and maximum speed/width (sysfs attributes) and the
IOMMU domain type of the device's group (``identity`` = passthrough). Only root reads
past the first 64 bytes of ``config``: the extended registers are None otherwise.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from tunerd.adapters.procfs import read_value

__all__ = ["ACS_CAP", "ACS_SV", "PciFunction", "acs_offset", "read_function"]

ACS_CAP = 0x000D
ACS_SV = 0x0001  # ACS Source Validation Enable
_PCIE_CAP = 0x10
_RELAXED_ORDERING = 0x0010


@dataclass(frozen=True)
class PciFunction:
    bdf: str
    acs_ctl: int | None  # ACS Control register; None: no ACS capability (or unreadable)
    relaxed_ordering: bool | None
    link_speed: str | None  # "16.0 GT/s PCIe"
    link_width: int | None
    max_link_speed: str | None
    max_link_width: int | None
    iommu_type: str | None  # "identity" | "DMA" | "DMA-FQ" | None (no IOMMU group)

    @property
    def acs_source_validation(self) -> bool | None:
        return None if self.acs_ctl is None else bool(self.acs_ctl & ACS_SV)


def _u16(cfg: bytes, off: int) -> int | None:
    return struct.unpack_from("<H", cfg, off)[0] if off + 2 <= len(cfg) else None


def _u32(cfg: bytes, off: int) -> int | None:
    return struct.unpack_from("<I", cfg, off)[0] if off + 4 <= len(cfg) else None


def acs_offset(cfg: bytes) -> int | None:
    """Offset of the ACS extended capability, walking the list from 0x100."""
    off, seen = 0x100, 0
    while off and off >= 0x100 and seen < 64:
        hdr = _u32(cfg, off)
        if hdr is None or hdr in (0, 0xFFFFFFFF):
            return None
        if hdr & 0xFFFF == ACS_CAP:
            return off
        off, seen = (hdr >> 20) & 0xFFC, seen + 1
    return None


def _pcie_cap(cfg: bytes) -> int | None:
    status = _u16(cfg, 0x06)
    if status is None or not status & 0x10 or len(cfg) <= 0x34:
        return None
    off, seen = cfg[0x34] & 0xFC, 0
    while off and seen < 48:
        if off + 2 > len(cfg):
            return None
        if cfg[off] == _PCIE_CAP:
            return off
        off, seen = cfg[off + 1] & 0xFC, seen + 1
    return None


def _int(v: str | None) -> int | None:
    return int(v) if v is not None and v.isdigit() else None


def read_function(bdf: str, sys_root: Path = Path("/sys")) -> PciFunction:
    d = sys_root / "bus/pci/devices" / bdf
    try:
        cfg = (d / "config").read_bytes()
    except OSError:
        cfg = b""
    acs = acs_offset(cfg)
    cap = _pcie_cap(cfg)
    devctl = _u16(cfg, cap + 8) if cap is not None else None
    iommu = read_value(d / "iommu_group/type")
    return PciFunction(
        bdf=bdf, acs_ctl=_u16(cfg, acs + 6) if acs is not None else None,
        relaxed_ordering=None if devctl is None else bool(devctl & _RELAXED_ORDERING),
        link_speed=read_value(d / "current_link_speed"),
        link_width=_int(read_value(d / "current_link_width")),
        max_link_speed=read_value(d / "max_link_speed"),
        max_link_width=_int(read_value(d / "max_link_width")),
        iommu_type=iommu)
