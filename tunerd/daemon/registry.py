"""Command handlers of the control socket, and the requests they receive.

A feature module registers its handlers with ``@command("name")`` and is listed
in HANDLER_MODULES; the daemon imports them all at start.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from tunerd.errors import PermissionDenied, UsageError

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon

# modules whose import registers handlers (one per feature area)
HANDLER_MODULES: list[str] = [
    "tunerd.daemon.cmd_core",
    # -- binding (bind/unbind/jobs):
    "tunerd.daemon.cmd_bind",
    # -- host settings (plan/apply/verify/revert):
    "tunerd.daemon.cmd_host",
    # -- topology:
    "tunerd.daemon.cmd_topology",
    # -- leases (alloc/release/run):
    "tunerd.daemon.cmd_leases",
    # -- monitor (metrics/top/advise/doctor):
    "tunerd.monitor.handlers",
]

T = TypeVar("T")
Handler = Callable[["Daemon", "Request"], Awaitable[Any]]
COMMANDS: dict[str, Handler] = {}
_MISSING: Any = object()


def command(name: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        if name in COMMANDS:
            raise RuntimeError(f"command {name!r} registered twice")
        COMMANDS[name] = fn
        return fn

    return deco


@dataclass(frozen=True)
class Peer:
    """Credentials of the socket peer, from SO_PEERCRED (never from the message)."""

    pid: int
    uid: int
    gid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@dataclass
class Request:
    cmd: str
    args: dict[str, Any]
    peer: Peer
    # set by handlers that keep the connection to learn when the client goes away
    extra: dict[str, Any] = field(default_factory=dict)

    def require_root(self, what: str) -> None:
        if not self.peer.is_root:
            raise PermissionDenied(f"{what} needs root (you are uid {self.peer.uid})")

    def require_owner(self, pid: int, owner_uid: int) -> None:
        """Non-root peers may act only on processes they own."""
        if not self.peer.is_root and owner_uid != self.peer.uid:
            raise PermissionDenied(
                f"process {pid} belongs to uid {owner_uid}; uid {self.peer.uid} may only "
                "act on its own processes",
                pid=pid,
            )

    def arg(self, name: str, kind: type[T], default: Any = _MISSING) -> T:
        """Argument ``name`` of type ``kind``; a missing or mistyped one is a UsageError."""
        if name not in self.args or self.args[name] is None:
            if default is _MISSING:
                raise UsageError(f"{self.cmd}: missing argument {name!r}")
            return default
        v = self.args[name]
        if kind is int and isinstance(v, bool):
            raise UsageError(f"{self.cmd}: argument {name!r} must be an integer, got {v!r}")
        if not isinstance(v, kind):
            raise UsageError(
                f"{self.cmd}: argument {name!r} must be {kind.__name__}, got {type(v).__name__}"
            )
        return v
