"""Who asks, and whether they may act on a process: ``Peer`` and ``require_owner``.

The socket peer's credentials come from SO_PEERCRED, never from the message.
Ownership is checked once, on the process pinned by pidfd (``JobRegistry.bind``),
so a pid reused between the check and the change cannot be acted on.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunerd.errors import PermissionDenied

__all__ = ["Peer", "require_owner"]


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
