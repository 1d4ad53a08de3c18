"""Who asks, and whether they may act on a process: ``Peer`` and ``require_owner``.

The socket peer's credentials come from SO_PEERCRED, never from the message.
Ownership is checked once, on the process pinned by pidfd (``JobRegistry.bind``),
so a pid reused between the check and the change cannot be acted on.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from tunerd.base.errors import NoSuchProcess, PermissionDenied

__all__ = ["Peer", "PidNamespaces", "require_owner", "scan_namespace"]


@dataclass(frozen=True)
class Peer:
    """Credentials of the socket peer, from SO_PEERCRED (never from the message)."""

    pid: int
    uid: int
    gid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def require_owner(peer: Peer, pid: int, uid: int, euid: int) -> None:
    """Non-root peers may act only on processes they own (real ``uid`` or effective
    ``euid`` of process ``pid``); PermissionDenied otherwise."""
    if not peer.is_root and peer.uid not in (uid, euid):
        raise PermissionDenied(
            f"process {pid} belongs to uid {uid}; uid {peer.uid} may only act on its own "
            "processes", pid=pid)


def _pid_ns(pid: int | str, proc: str) -> int | None:
    try:
        return os.stat(f"{proc}/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _nspid_last(pid: int | str, proc: str) -> int | None:
    """The last NSpid of ``pid``: its PID in its own (innermost) namespace."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def scan_namespace(ns: int, proc: str = "/proc") -> dict[int, int]:
    """{PID as seen in namespace ``ns``: PID in ours} for every process in ``ns``."""
    out: dict[int, int] = {}
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit() or _pid_ns(entry.name, proc) != ns:
            continue
        inner = _nspid_last(entry.name, proc)
        if inner is not None:
            out[inner] = int(entry.name)
    return out


class PidNamespaces:
    """``pid`` as a caller in another PID namespace means it, without a scan of /proc
    per request on the event loop (issue 28, found 2: 2,000 sleeping processes in a
    user's own namespace stalled everyone's requests for seconds).

    Per namespace, a map of its PIDs to ours, made by one scan of /proc in a worker
    thread. A PID found there is checked (its namespace and NSpid, two small reads)
    before it is used; one that is not there (a new process, or none at all) waits for
    the next scan that starts after the request came, so a process started just
    before its bind is found, and a flood of absent PIDs shares scans instead of
    causing one each. The work is bounded per user: one scan at a time per namespace,
    one namespace scanned at a time per uid, at most ``MIN_GAP`` s apart per
    namespace; at most ``MAX_NAMESPACES`` maps are kept (least recently used out).
    """

    MIN_GAP = 0.05
    MAX_NAMESPACES = 256

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._mine: int | None = None
        self._maps: OrderedDict[int, tuple[float, dict[int, int]]] = OrderedDict()
        self._scans: dict[int, asyncio.Future[None]] = {}
        self._users: dict[int, tuple[asyncio.Lock, list[int]]] = {}  # uid -> lock, users
        self.scans = 0

    def _ours(self) -> int | None:
        if self._mine is None:
            self._mine = _pid_ns("self", self.proc)
        return self._mine

    async def host_pid(self, peer: Peer, pid: int) -> int:
        """``pid`` in the daemon's namespace (NoSuchProcess if the caller's namespace
        has no such process: never read as a host PID)."""
        mine, theirs = self._ours(), _pid_ns(peer.pid, self.proc)
        if mine is None or theirs is None or mine == theirs:
            return pid
        asked = time.monotonic()
        host = self._checked(theirs, pid)
        while host is None:
            done = self._maps.get(theirs)
            if done is not None and done[0] >= asked:  # scanned since: it is not there
                break
            fut = self._scans.get(theirs)
            if fut is None:
                fut = asyncio.get_running_loop().create_future()
                self._scans[theirs] = fut
                asyncio.get_running_loop().create_task(self._scan(theirs, peer.uid, fut))
            await asyncio.shield(fut)
            host = self._checked(theirs, pid)
        if host is None:
            raise NoSuchProcess(
                f"no process {pid} in the caller's PID namespace (pid {peer.pid} asks from "
                "another PID namespace than the daemon's; it may only name its own "
                "processes)", pid=pid)
        return host

    def _checked(self, ns: int, pid: int) -> int | None:
        ent = self._maps.get(ns)
        host = ent[1].get(pid) if ent is not None else None
        if host is None:
            return None
        self._maps.move_to_end(ns)
        if _pid_ns(host, self.proc) == ns and _nspid_last(host, self.proc) == pid:
            return host
        return None  # exited, or its PID reused: the next scan says

    async def _scan(self, ns: int, uid: int, fut: asyncio.Future[None]) -> None:
        ent = self._users.setdefault(uid, (asyncio.Lock(), [0]))
        lock, refs = ent
        refs[0] += 1
        try:
            async with lock:  # one namespace at a time per uid
                prev = self._maps.get(ns)
                if prev is not None:
                    gap = self.MIN_GAP - (time.monotonic() - prev[0])
                    if gap > 0:
                        await asyncio.sleep(gap)
                started = time.monotonic()
                try:
                    found = await asyncio.get_running_loop().run_in_executor(
                        None, scan_namespace, ns, self.proc)
                except (OSError, RuntimeError):  # no thread to run it: nothing found
                    found = {}
                self.scans += 1
                self._maps[ns] = (started, found)
                self._maps.move_to_end(ns)
                while len(self._maps) > self.MAX_NAMESPACES:
                    self._maps.popitem(last=False)
        finally:
            refs[0] -= 1
            if not refs[0]:
                self._users.pop(uid, None)
            self._scans.pop(ns, None)
            if not fut.done():
                fut.set_result(None)
