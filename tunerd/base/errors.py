"""tunerd's errors: every layer raises these.

An error carries a human message that names what went wrong (file, key, value,
PID) and structured ``details`` for scripts. It knows nothing of wire codes or
exit statuses: only the daemon's control server and the client map errors to
those (``tunerd.wire.protocol``), so that placement, binding, policy, topology and the
tuners depend on this small module alone.

Stdlib only and cheap to import: ``tunerctl`` imports it on every command.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DaemonUnreachable",
    "Failed",
    "NoSuchProcess",
    "PermissionDenied",
    "PlacementError",
    "PolicyError",
    "TunerdError",
    "UsageError",
]


class TunerdError(Exception):
    """Base class: a message for people and ``details`` for scripts."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class Failed(TunerdError):
    """The request was valid but could not be carried out."""


class UsageError(TunerdError):
    """Bad input: a malformed value, an unknown CPU, a limit out of range."""


class NoSuchProcess(TunerdError):
    """The target PID does not exist, exited, or was reused."""


class PermissionDenied(TunerdError):
    """The caller (or the daemon itself) may not do this."""


class DaemonUnreachable(TunerdError):
    """No daemon answers on the control socket (or it is not one we trust)."""


class PlacementError(Failed):
    """No placement fits; the message says what is free and who holds the rest."""


class PolicyError(TunerdError):
    """A policy file (or set of files) that cannot be used; nothing from it is applied.

    ``message`` names the file, the key path and the bad value (or the line, for
    TOML syntax errors); ``details["errors"]`` lists every problem found.
    """
