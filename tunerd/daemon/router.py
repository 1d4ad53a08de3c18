"""Control-socket requests and the table of command handlers.

Handlers are plain async functions (usually bound methods of a small command
class that holds only the services it needs); the composition root registers
them with ``Router.add``. The server looks commands up here and never knows
the services.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tunerd.base.errors import PermissionDenied, UsageError
from tunerd.jobs.peer import Peer
from tunerd.wire.protocol import check_int

__all__ = ["Handler", "Peer", "Request", "Router"]

T = TypeVar("T")
_MISSING: Any = object()


@dataclass
class Request:
    cmd: str
    args: dict[str, Any]
    peer: Peer

    def require_root(self, what: str) -> None:
        if not self.peer.is_root:
            raise PermissionDenied(f"{what} needs root (you are uid {self.peer.uid})")

    def arg(self, name: str, kind: type[T], default: Any = _MISSING) -> T:
        """Argument ``name`` of type ``kind``; a missing or mistyped one is a UsageError,
        and so is an integer outside its range (``tunerd.wire.protocol.INT_RANGES``)."""
        if name not in self.args or self.args[name] is None:
            if default is _MISSING:
                raise UsageError(f"{self.cmd}: missing argument {name!r}")
            return default
        v = self.args[name]
        if kind is int and isinstance(v, bool):
            raise UsageError(f"{self.cmd}: argument {name!r} must be an integer, got {v!r}")
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, kind):
            raise UsageError(
                f"{self.cmd}: argument {name!r} must be {kind.__name__}, got {type(v).__name__}"
            )
        if isinstance(v, int) and not isinstance(v, bool):
            check_int(self.cmd, name, v)
        return v


Handler = Callable[[Request], Awaitable[Any]]


class Router:
    """Command name -> handler; refuses a name registered twice."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def add(self, name: str, handler: Handler) -> None:
        if name in self._handlers:
            raise RuntimeError(f"command {name!r} registered twice")
        self._handlers[name] = handler

    def get(self, name: str) -> Handler | None:
        return self._handlers.get(name)
