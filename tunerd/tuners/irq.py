"""Interrupts of managed devices kept near them, off the CPUs ranks hold (``irq:<dev>:<N>``).

``[irq] devices`` names what is managed: NIC names or globs (network interfaces and
RDMA devices such as ``mlx5_*``) and ``"gpu"`` for the GPUs' own interrupts. Each
device's MSI/MSI-X vectors (``/sys/bus/pci/devices/X/msi_irqs``) go to the CPUs of its
NUMA node (``local_cpulist``), housekeeping CPUs first, never onto a CPU a bound rank
holds. An interrupt whose device has no such CPU stays where it is and the plan says
why. An interrupt already inside its allowed set is in sync (irqbalance may choose
within it; only a move outside it is drift).

Affinities are read and written through ``/proc/irq/N/smp_affinity`` (the hex mask):
the saved original is that file's text, written back byte for byte by ``revert``.
Kernel-managed interrupts (NVMe queues, some virtio queues) refuse a write with EIO:
that is reported for the key, nothing else is touched.

``irqbalance = "ban"`` (the default) also keeps a managed block in irqbalance's
environment file (``/etc/default/irqbalance`` or ``/etc/sysconfig/irqbalance``, the
one that exists) naming every managed IRQ with ``--banirq`` (and keeping the
file's own ``IRQBALANCE_ARGS`` in front), so irqbalance leaves them alone once it reads
it (at its next start); ``"leave"`` never touches irqbalance's files.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.adapters.procfs import read_value
from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist
from tunerd.policy.typed import IrqSection
from tunerd.tuners.base import Change, SettingError, write_text
from tunerd.tuners.nccl import NcclTuner

__all__ = ["IrqContext", "IrqTuner", "ManagedDevice", "RewriteLimit", "format_mask",
           "parse_mask"]

_PCI_ADDR = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
BALANCE_KEY = "irq:irqbalance:IRQBALANCE_ARGS"
BALANCE_FILES = ("default/irqbalance", "sysconfig/irqbalance")


def parse_mask(text: str) -> frozenset[int]:
    """``00000000,00000003`` -> {0, 1} (the kernel's comma-grouped hex cpumask)."""
    bits = int(text.strip().replace(",", "") or "0", 16)
    out, i = set(), 0
    while bits:
        if bits & 1:
            out.add(i)
        bits >>= 1
        i += 1
    return frozenset(out)


def format_mask(cpus: Iterable[int], like: str | None = None) -> str:
    """A cpumask in the kernel's spelling, with as many 32-bit groups as ``like``."""
    bits = 0
    for c in cpus:
        bits |= 1 << c
    like_groups = like.strip().split(",") if like else ["00000000"]
    groups = max(len(like_groups), (bits.bit_length() + 31) // 32, 1)
    parts = [f"{(bits >> (32 * i)) & 0xFFFFFFFF:08x}" for i in range(groups)][::-1]
    # the kernel prints 8 hex digits a group, the first one only as wide as nr_cpu_ids
    # needs ("3" on 2 CPUs): keep that width when the value fits in it
    if groups == len(like_groups):
        w = len(like_groups[0])
        if len(parts[0].lstrip("0")) <= w:
            parts[0] = parts[0][-w:]
    return ",".join(parts)


# each interrupt's affinity is rewritten at most this often by the quick check: binds
# and unbinds that move it faster (a user rebinding between two CPUs) are not followed
# move by move, and an outside writer fighting tunerd (irqbalance) gets a bounded answer
REWRITES_PER_WINDOW = 4
REWRITE_WINDOW_S = 10.0


class RewriteLimit:
    """At most ``per_window`` rewrites of one interrupt per ``window`` seconds; what is
    held back stays drift and is written when the window allows."""

    def __init__(self, per_window: int = REWRITES_PER_WINDOW,
                 window: float = REWRITE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_window = per_window
        self.window = window
        self.clock = clock
        self._times: dict[str, deque[float]] = {}  # one entry per managed interrupt
        self.held_back = 0  # rewrites deferred so far (status)

    def allow(self, key: str) -> bool:
        """Whether ``key`` may be rewritten now (counted when it may)."""
        now = self.clock()
        times = self._times.setdefault(key, deque())
        while times and now - times[0] >= self.window:
            times.popleft()
        if len(times) >= self.per_window:
            self.held_back += 1
            return False
        times.append(now)
        return True

    def forget(self, keep: set[str]) -> None:
        """Drop the interrupts no longer managed (the table stays bounded)."""
        for key in [k for k in self._times if k not in keep]:
            del self._times[key]


@dataclass(frozen=True)
class IrqContext:
    """What placement decides with, given by the daemon on each plan."""

    online: frozenset[int]
    held: Mapping[int, str] = field(default_factory=dict)  # CPU -> the rank holding it
    housekeeping: frozenset[int] = frozenset()
    gpus: Sequence[tuple[int, str]] = ()  # (GPU index, PCI bus id) for "gpu"


@dataclass(frozen=True)
class ManagedDevice:
    name: str  # eth0, mlx5_0, gpu3
    pci: str
    irqs: tuple[int, ...]
    local_cpus: frozenset[int]
    numa_node: int | None


class IrqTuner:
    kind = "irq"

    def __init__(self, proc_root: Path | str = "/proc", sys_root: Path | str = "/sys",
                 etc_root: Path | str = "/etc",
                 context: Callable[[], IrqContext] | None = None) -> None:
        self.proc = Path(proc_root)
        self.sys = Path(sys_root)
        self.etc = Path(etc_root)
        self.context = context or self._default_context
        self.stuck: dict[str, str] = {}  # device -> why its interrupts stay (last plan)
        # the check runs every second: what never changes for a device is read once
        self._pci_cache: dict[tuple[str, str], str | None] = {}
        self._local_cache: dict[str, tuple[frozenset[int], int | None]] = {}
        self._masks: dict[str, tuple[frozenset[int], str]] = {}  # mask text -> (CPUs, list)

    # -- discovery -------------------------------------------------------------
    def _default_context(self) -> IrqContext:
        try:
            online = parse_cpulist(read_value(self.sys / "devices/system/cpu/online") or "")
        except CpuListError:
            online = frozenset()
        return IrqContext(online=online or frozenset(os.sched_getaffinity(0)))

    def _pci_of(self, dev: Path) -> str | None:
        try:
            p = dev.resolve(strict=True)
        except OSError:
            return None
        for q in (p, *p.parents):
            if _PCI_ADDR.match(q.name):
                return q.name
        return None

    def candidates(self, ctx: IrqContext) -> list[tuple[str, str]]:
        """(name, PCI function) of every device ``devices`` may name, in name order."""
        out: list[tuple[str, str]] = []
        for cls in ("net", "infiniband"):
            d = self.sys / "class" / cls
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for name in names:
                k = (cls, name)
                if k not in self._pci_cache:
                    self._pci_cache[k] = self._pci_of(d / name / "device")
                pci = self._pci_cache[k]
                if pci is not None:
                    out.append((name, pci))
        out += [(f"gpu{i}", bus) for i, bus in ctx.gpus]
        return out

    def devices(self, section: IrqSection, ctx: IrqContext) -> list[ManagedDevice]:
        """The managed devices present, one per PCI function (first name that matches)."""
        seen: dict[str, ManagedDevice] = {}
        for name, pci in self.candidates(ctx):
            if pci in seen or not _names(section, name):
                continue
            d = f"{self.sys}/bus/pci/devices/{pci}"
            try:
                irqs = tuple(sorted(int(x) for x in os.listdir(d + "/msi_irqs") if x.isdigit()))
            except OSError:
                irqs = ()
            if pci not in self._local_cache:
                try:
                    local = parse_cpulist(read_value(Path(d, "local_cpulist")) or "")
                except CpuListError:
                    local = frozenset()
                node_s = read_value(Path(d, "numa_node"))
                node = int(node_s) if node_s and node_s.lstrip("-").isdigit() else None
                self._local_cache[pci] = (local, node if node is not None and node >= 0
                                          else None)
                if not irqs:  # not bound to a driver yet: read its locality again later
                    del self._local_cache[pci]
                    seen[pci] = ManagedDevice(name, pci, irqs, local, node)
                    continue
            local, node = self._local_cache[pci]
            seen[pci] = ManagedDevice(name, pci, irqs, local, node)
        return list(seen.values())

    def target(self, dev: ManagedDevice, section: IrqSection,
               ctx: IrqContext) -> tuple[frozenset[int], str | None]:
        """(CPUs the device's interrupts may use, why none when empty)."""
        local = (dev.local_cpus & ctx.online) or ctx.online
        if section.cpus:
            local &= section.cpus
        where = (f"NUMA node {dev.numa_node}" if dev.numa_node is not None else "the node")
        if not local:
            return frozenset(), (f"{dev.name}: no online CPU of {where} is in [irq] cpus "
                                 f"({format_cpulist(section.cpus or frozenset())})")
        free = frozenset(c for c in local if c not in ctx.held)
        if not free:
            holders = sorted(set(ctx.held[c] for c in local))
            return frozenset(), (f"{dev.name}: every CPU of {where} ({format_cpulist(local)}) "
                                 f"is held by a bound rank ({'; '.join(holders[:3])}"
                                 f"{'...' if len(holders) > 3 else ''}); its interrupts stay")
        hk = free & ctx.housekeeping
        return (hk or free), None

    # -- the tuner protocol ----------------------------------------------------
    def _path(self, key: str) -> Path | None:
        parts = key.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            return None
        return self.proc / "irq" / parts[2] / "smp_affinity"

    def _balance(self) -> NcclTuner | None:
        """irqbalance's environment file as a managed block (the NCCL tuner's mechanics)."""
        for rel in BALANCE_FILES:
            p = self.etc / rel
            if p.is_file():
                t = NcclTuner(self.etc)
                t.path = p
                return t
        return None

    def _affinity(self, irq: int) -> tuple[frozenset[int], str] | None:
        """(CPUs, cpulist) of /proc/irq/N/smp_affinity; None when it cannot be read."""
        try:
            fd = os.open(f"{self.proc}/irq/{irq}/smp_affinity", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            raw = os.read(fd, 4096).decode("ascii", "replace").strip()
        except OSError:
            return None
        finally:
            os.close(fd)
        hit = self._masks.get(raw)
        if hit is None:
            try:
                cpus = parse_mask(raw)
            except ValueError:
                return None
            if len(self._masks) > 4096:
                self._masks.clear()
            hit = self._masks[raw] = (cpus, format_cpulist(cpus))
        return hit

    def current(self, key: str) -> str | None:
        if key == BALANCE_KEY:
            bal = self._balance()
            return None if bal is None else bal.current_of(bal.load(), "IRQBALANCE_ARGS")
        parts = key.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            return None
        aff = self._affinity(int(parts[2]))
        return None if aff is None else aff[1]

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        if keys is None:
            return {}
        return {k: self.current(k) for k in keys}

    def plan(self, desired: IrqSection) -> list[Change]:
        if not desired.devices:
            self.stuck = {}
            return []
        ctx = self.context()
        changes: list[Change] = []
        stuck: dict[str, str] = {}
        managed: list[int] = []
        for dev in self.devices(desired, ctx):
            cpus, why = self.target(dev, desired, ctx)
            want = format_cpulist(cpus)
            if not dev.irqs:
                stuck[dev.name] = f"{dev.name}: no MSI/MSI-X interrupts ({dev.pci})"
            for irq in dev.irqs:
                key = f"irq:{dev.name}:{irq}"
                path = f"{self.proc}/irq/{irq}/smp_affinity"
                aff = self._affinity(irq)
                if aff is None:
                    changes.append(Change(key, None, None, available=False,
                                          reason=f"{path} cannot be read", path=path))
                    continue
                managed.append(irq)
                now, cur = aff
                if why is not None:
                    stuck[dev.name] = why
                    changes.append(Change(key, cur, None, available=False, reason=why,
                                          path=path))
                    continue
                inside = bool(now) and now <= cpus
                changes.append(Change(key, cur, cur if inside else want, path=path))
        self.stuck = stuck
        if desired.irqbalance == "ban" and managed:
            bal = self._balance()
            if bal is not None:
                changes.append(self._ban_change(bal, sorted(set(managed))))
        return changes

    def _ban_change(self, bal: NcclTuner, irqs: list[int]) -> Change:
        conf = bal.load()
        own = conf.outside_value("IRQBALANCE_ARGS") or ""
        own = own.strip().strip('"').strip()
        args = " ".join([*([own] if own else []), *(f"--banirq={i}" for i in irqs)])
        return Change(BALANCE_KEY, bal.current_of(conf, "IRQBALANCE_ARGS"), f'"{args}"',
                      path=str(bal.path))

    def apply(self, change: Change) -> None:
        if change.key == BALANCE_KEY:
            bal = self._balance()
            if bal is None:
                raise SettingError(change.key, change.desired, "no irqbalance environment file")
            bal.apply(Change("x:IRQBALANCE_ARGS", change.current, change.desired))
            return
        path = self._path(change.key)
        if path is None or change.desired is None:
            raise SettingError(change.key, change.desired, "not available here")
        like = read_value(path)
        try:
            cpus = parse_cpulist(change.desired)
        except CpuListError as err:
            raise SettingError(change.key, change.desired, str(err), str(path)) from err
        write_text(path, format_mask(cpus, like), change.key)

    def save_original(self, change: Change) -> dict[str, Any]:
        if change.key == BALANCE_KEY:
            bal = self._balance()
            return bal.save_original(Change("x:IRQBALANCE_ARGS", None, None)) if bal else {}
        path = self._path(change.key)
        raw = read_value(path) if path else None
        return {"value": change.current, "mask": raw}

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        if key == BALANCE_KEY:
            bal = self._balance()
            if bal is not None:
                bal.revert("x:IRQBALANCE_ARGS", saved)
            return
        path = self._path(key)
        mask = saved.get("mask")
        if path is None or not isinstance(mask, str):
            return
        now = read_value(path)
        if now is not None and parse_mask(now) == parse_mask(mask):
            return
        write_text(path, mask, key)

    def mentions(self, key: str, desired: IrqSection) -> bool:
        if key == BALANCE_KEY:
            return bool(desired.devices) and desired.irqbalance == "ban"
        parts = key.split(":")
        return len(parts) == 3 and _names(desired, parts[1])


def _names(section: IrqSection, name: str) -> bool:
    for pat in section.devices:
        if pat == "gpu":
            if re.fullmatch(r"gpu\d+", name):
                return True
        elif fnmatch.fnmatchcase(name, pat) and not re.fullmatch(r"gpu\d+", name):
            return True
    return False
