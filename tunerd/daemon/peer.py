"""Who asks, and whether they may act on a process: ``Peer`` and ``require_owner``.

The socket peer's credentials come from SO_PEERCRED, never from the message.
Ownership is checked once, on the process pinned by pidfd (``JobRegistry.bind``),
so a pid reused between the check and the change cannot be acted on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tunerd.errors import NoSuchProcess, PermissionDenied

__all__ = ["Peer", "host_pid", "require_owner"]


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


def host_pid(peer: Peer, pid: int, proc: str = "/proc") -> int:
    """``pid`` as the caller means it, in the daemon's PID namespace.

    A caller inside another PID namespace (a container) names processes by its own
    PIDs: the process whose NSpid ends in ``pid`` and that lives in the caller's
    namespace. One that no process there has is refused (NoSuchProcess), never read
    as a host PID.
    """
    mine, theirs = _pid_ns("self", proc), _pid_ns(peer.pid, proc)
    if mine is None or theirs is None or mine == theirs:
        return pid
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or _pid_ns(entry.name, proc) != theirs:
            continue
        try:
            with open(f"{proc}/{entry.name}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if line.split()[-1] == str(pid):
                            return int(entry.name)
                        break
        except OSError:
            continue
    raise NoSuchProcess(
        f"no process {pid} in the caller's PID namespace (pid {peer.pid} asks from "
        "another PID namespace than the daemon's; it may only name its own processes)",
        pid=pid)
