"""The one policy gate for every exclusive or GPU reservation, whatever the command.

``alloc``, ``run``, ``bind --exclusive`` (with ``--cpus`` or ``--gpus``) and ``[[job]]``
rules all reserve through the Placer; before any of them does, this gate decides
with the same rules and the same words (PermissionDenied, exit code 4):

- ``[leases] user_exclusive``: a non-root user takes exclusive CPUs only where it
  is true (``EXCLUSIVE_DENIED``);
- ``[leases] max_per_user``: every reservation a non-root user holds counts, leases
  and ``bind --exclusive`` alike (``held_by``);
- ``[leases] alloc_ttl``: a reservation no process holds ends after it (leases);
  one a process holds ends with that process (``run`` leases, ``bind --exclusive``).

Rules: a rule that moves or reserves beyond the matched process (``exclusive``,
``placement = "exclusive"``, ``exclusive_scope``) acts only for the users its
``match.user`` names; one naming none acts only for root's processes
(``rule_reach_refused``), and ``tunerctl policy check`` warns about it.

GPUs a rule-bound process "uses" count as busy for other placements only when that
is seen from outside the process (``verified_gpus``): it holds the GPU's device node
open for reading or writing (``/proc/PID/fd`` -> a character device of major 195,
``/dev/nvidiaN``; ``/proc/PID/fdinfo`` flags without ``O_PATH``, which needs no
permission on the node) and the node's permissions let it open it so, or NVML lists it
among the GPU's processes. Its environment and command line are its own to
write, so ``CUDA_VISIBLE_DEVICES``/``LOCAL_RANK`` alone only choose where it is placed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tunerd.adapters import procfs
from tunerd.adapters.procfs import Creds, OpenDevice
from tunerd.adapters.subids import SubIds
from tunerd.base.errors import PermissionDenied
from tunerd.jobs.peer import Peer
from tunerd.jobs.placement import Mode, is_exclusive

__all__ = [
    "EXCLUSIVE_DENIED",
    "FdEvidence",
    "LeaseLimits",
    "ReservationGate",
    "device_gpus",
    "gpu_fds",
    "may_open",
    "rule_reach_refused",
    "rule_reaches_beyond",
    "set_test_device_nodes",
    "verified_gpus",
]

NVIDIA_MAJOR = 195  # /dev/nvidia0..N (minor = the GPU's minor number), nvidiactl = 255
NVIDIACTL_MINOR = 255
# fd entries of one process looked at in one look (its table listed lazily, in fd
# order: CUDA opens its nodes at initialisation, among a process's first files)
MAX_FDS_SCANNED = 1024

# one wording for alloc, run and bind alike
EXCLUSIVE_DENIED = (
    "exclusive CPUs and GPUs are for root on this node: the policy's [leases] "
    "user_exclusive is false (ask an administrator, or leave out --exclusive)")
COUNT_DENIED = (
    "uid {uid} holds {mine} reservations (leases and bind --exclusive), the most a "
    "user may hold on this node ([leases] max_per_user = {limit}); release some first "
    "(tunerctl leases, tunerctl release ID, tunerctl unbind PID)")


@dataclass(frozen=True)
class LeaseLimits:
    """``[leases]`` of the policy: what non-root users may hold."""

    user_exclusive: bool = False
    max_per_user: int = 64
    alloc_ttl: float = 86400.0  # seconds; 0 = no limit


class ReservationGate:
    """Admits or refuses a non-root user's exclusive or GPU reservation (root: always)."""

    def __init__(self, limits: Callable[[], LeaseLimits],
                 default_nofile: Callable[[], int | None] = lambda: None,
                 proc_root: str = "/proc", subids: SubIds | None = None) -> None:
        self.limits = limits
        self.default_nofile = default_nofile
        self.proc = proc_root
        # a user's subordinate uids (/etc/subuid) count as her
        self.subids = subids if subids is not None else SubIds(Path("/nonexistent"))
        self._counters: list[Callable[[Callable[[int], bool]], int]] = []
        # reservation key (tunerd.jobs.placer.ReservationKey) -> uid: bind --exclusive
        self._holds: dict[Hashable, int] = {}

    def count_with(self, counter: Callable[[Callable[[int], bool]], int]) -> None:
        """Another holder of a user's reservations (the lease service: its leases);
        ``counter(same)`` counts those whose uid ``same`` accepts."""
        self._counters.append(counter)

    def held_by(self, uid: int, *, besides: Hashable | None = None) -> int:
        """Reservations of ``uid``'s user: hers and her subordinate uids'."""
        self.subids.refresh()
        owner = self.subids.owner_cached(uid)

        def same(u: int) -> bool:
            return u == uid or self.subids.owner_cached(u) == owner

        return (sum(c(same) for c in self._counters)
                + sum(1 for k, u in self._holds.items() if same(u) and k != besides))

    def admit(self, peer: Peer, *, exclusive: bool, key: Hashable | None = None) -> None:
        """PermissionDenied unless ``peer`` may hold one more reservation (``key``: one
        it replaces, not counted)."""
        if peer.is_root:
            return
        limits = self.limits()
        if exclusive and not limits.user_exclusive:
            raise PermissionDenied(EXCLUSIVE_DENIED)
        mine = self.held_by(peer.uid, besides=key)
        if mine >= limits.max_per_user:
            owner = self.subids.owner_cached(peer.uid)
            who = peer.uid if owner == peer.uid else \
                f"{peer.uid} (a subordinate uid of uid {owner}, /etc/subuid)"
            raise PermissionDenied(COUNT_DENIED.format(uid=who, mine=mine,
                                                       limit=limits.max_per_user))

    def cap_nofile(self, uid: int | None, pid: int, nofile: int | None,
                   notes: list[str]) -> int | None:
        """``nofile`` for a process of a non-root ``uid``, at most the larger of its
        current hard limit and the policy's ``[limits] nofile`` (limits.conf is the
        admin's word on what a user may hold); a note says when it was cut."""
        if nofile is None or uid == 0:
            return nofile
        cap = max(_hard_nofile(pid, self.proc) or 0, self.default_nofile() or 0)
        if cap and nofile > cap:
            notes.append(f"nofile {nofile} capped at {cap}: a non-root process gets at most "
                         "its own hard limit or the policy's [limits] nofile")
            return cap
        return nofile

    def hold(self, key: Hashable, uid: int) -> None:
        self._holds[key] = uid

    def drop(self, key: Hashable) -> None:
        self._holds.pop(key, None)


def _hard_nofile(pid: int, proc_root: str) -> int | None:
    """The hard RLIMIT_NOFILE of ``pid`` from /proc/PID/limits (None if unreadable)."""
    try:
        with open(f"{proc_root}/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    hard = line.split()[4]
                    return None if hard == "unlimited" else int(hard)
    except (OSError, ValueError, IndexError):
        return None
    return None


# -- rules ---------------------------------------------------------------------------
class RuleReach(Protocol):
    """What the gate reads of a ``[[job]]`` rule (tunerd.watch.rules.JobRule)."""

    @property
    def name(self) -> str: ...
    @property
    def exclusive(self) -> bool: ...
    @property
    def placement(self) -> Mode: ...
    @property
    def exclusive_scope(self) -> str | None: ...
    @property
    def users(self) -> tuple[str, ...]: ...
    @property
    def uids(self) -> frozenset[int]: ...


def rule_reaches_beyond(rule: RuleReach) -> bool:
    """Whether a rule moves or reserves more than the process it matched."""
    return is_exclusive(rule.exclusive, rule.placement) or bool(rule.exclusive_scope)


def rule_reach_refused(rule: RuleReach, uid: int | None) -> str | None:
    """Why ``rule`` may not act for a process of ``uid`` (None: it may)."""
    if not rule_reaches_beyond(rule) or uid == 0:
        return None
    if rule.users and uid in rule.uids:
        return None
    return (f"rule {rule.name} is exclusive and names no match.user"
            if not rule.users else f"rule {rule.name}: uid {uid} is not in its match.user")


# -- GPUs a process really uses --------------------------------------------------
# (major, minor) of a device node -> the NVIDIA minor it stands for: empty on a real
# node; a test daemon on a replayed node (``debug_gpu_device_nodes``) names nodes that
# open without the NVIDIA driver (a test cannot open a real major-195 node here)
_TEST_NODES: dict[tuple[int, int], int] = {}
_READ, _WRITE = 4, 2
_NEED = {0: _READ, 1: _WRITE, 2: _READ | _WRITE}  # O_RDONLY, O_WRONLY, O_RDWR


@dataclass(frozen=True)
class FdEvidence:
    """What one look at a process's fd table proved: the NVIDIA minors it holds open
    for reading or writing, how many fd entries were looked at, whether it was cut."""

    minors: frozenset[int]
    looked: int
    cut: bool


def set_test_device_nodes(nodes: dict[tuple[int, int], int]) -> None:
    """A replayed node's stand-in device nodes (test daemons only)."""
    _TEST_NODES.clear()
    _TEST_NODES.update(nodes)


def may_open(dev: OpenDevice, creds: Creds) -> bool:
    """Whether ``dev``'s fd proves GPU use: opened for reading or writing (an
    ``O_PATH`` handle needs no permission on the node and reads nothing), on a node
    whose permissions let the process's fs uid/gid/groups open it that way (an fd
    another process passed it does not count)."""
    if dev.flags & procfs.O_PATH:
        return False
    need = _NEED.get(dev.flags & procfs.O_ACCMODE)
    if need is None:
        return False
    if creds.fsuid == 0:
        return True  # CAP_DAC_OVERRIDE
    if creds.fsuid == dev.uid:
        bits = dev.mode >> 6
    elif dev.gid == creds.fsgid or dev.gid in creds.groups:
        bits = dev.mode >> 3
    else:
        bits = dev.mode
    return bits & need == need


def gpu_fds(pid: int, proc_root: str = "/proc",
            max_fds: int = MAX_FDS_SCANNED) -> FdEvidence | None:
    """The ``/dev/nvidiaN`` nodes ``pid`` proves it uses (``may_open``), read from its
    fds' targets as the kernel sees them (st_rdev, not the name) and their fdinfo
    flags; at most ``max_fds`` fd entries are looked at. None if unreadable."""
    creds = procfs.read_creds(pid, proc_root)
    if creds is None:
        return None
    majors = frozenset({NVIDIA_MAJOR, *(m for m, _ in _TEST_NODES)})
    found, looked, cut = procfs.open_char_devices(pid, majors, proc_root, max_fds)
    out: set[int] = set()
    for dev in found:
        major, minor = os.major(dev.rdev), os.minor(dev.rdev)
        if (major, minor) in _TEST_NODES:
            minor = _TEST_NODES[(major, minor)]
        elif major != NVIDIA_MAJOR or minor == NVIDIACTL_MINOR:
            continue
        if may_open(dev, creds):
            out.add(minor)
    return FdEvidence(frozenset(out), looked, cut)


def device_gpus(pid: int, proc_root: str = "/proc") -> frozenset[int] | None:
    """Minor numbers of the ``/dev/nvidiaN`` nodes ``pid`` proves it uses (``gpu_fds``:
    open for reading or writing, by a process that may open them); None if unreadable."""
    ev = gpu_fds(pid, proc_root)
    return None if ev is None else ev.minors


def verified_gpus(pid: int, claimed: Iterable[int],
                  minors: Callable[[int], int | None] | None = None,
                  nvml_gpus: Callable[[int], Iterable[int]] | None = None,
                  proc_root: str = "/proc") -> tuple[int, ...]:
    """The GPUs of ``claimed`` that ``pid`` is seen using from outside: an open device
    node (GPU index -> minor number through ``minors``; the index itself without NVML)
    or NVML's process list (``nvml_gpus``)."""
    claimed = tuple(claimed)
    if not claimed:
        return ()
    held = device_gpus(pid, proc_root) or frozenset()
    seen = {g for g in claimed if (minors(g) if minors else g) in held}
    if len(seen) < len(claimed) and nvml_gpus is not None:
        seen |= set(nvml_gpus(pid)) & set(claimed)
    return tuple(g for g in claimed if g in seen)
