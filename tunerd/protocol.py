"""Control-socket protocol: JSON lines, error types and exit codes.

One request per line::

    {"id": 1, "cmd": "bind", "args": {"pid": 1234, "cpus": "2-5"}}

One reply per request::

    {"id": 1, "ok": true, "result": {...}}
    {"id": 1, "ok": false, "error": {"code": "usage", "message": "...", "exit": 2}}

This module is imported by ``tunerctl`` on every command: keep it stdlib-only
and cheap to import.
"""

from __future__ import annotations

import enum
import json
from typing import Any

__all__ = [
    "MAX_MESSAGE",
    "DaemonUnreachable",
    "ExitCode",
    "Failed",
    "NoSuchProcess",
    "PermissionDenied",
    "TunerdError",
    "UsageError",
    "decode",
    "encode",
    "error_from_reply",
]

MAX_MESSAGE = 1 << 20  # 1 MiB: longer request lines are refused
DEFAULT_SOCKET = "/run/tunerd/tunerd.sock"


class ExitCode(enum.IntEnum):
    """Exit codes of tunerctl and tunerd (DESIGN.md, Part 1)."""

    OK = 0
    FAILED = 1  # the operation failed, a check found problems, or drift was found
    USAGE = 2  # usage error: bad flag, bad value, malformed input
    UNREACHABLE = 3  # the daemon is not reachable
    PERMISSION = 4  # permission denied


class TunerdError(Exception):
    """An error with a stable code, an exit status and structured details."""

    code = "failed"
    exit_code = ExitCode.FAILED

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "code": self.code, "message": self.message, "exit": int(self.exit_code),
        }
        if self.details:
            d["details"] = self.details
        return d


class Failed(TunerdError):
    """The operation was valid but could not be done."""


class UsageError(TunerdError):
    """Bad input: a malformed value, an unknown CPU, a limit out of range."""

    code = "usage"
    exit_code = ExitCode.USAGE


class NoSuchProcess(TunerdError):
    """The target PID does not exist, exited, or was reused."""

    code = "no_such_process"


class PermissionDenied(TunerdError):
    code = "permission"
    exit_code = ExitCode.PERMISSION


class DaemonUnreachable(TunerdError):
    code = "unreachable"
    exit_code = ExitCode.UNREACHABLE


_BY_CODE: dict[str, type[TunerdError]] = {
    c.code: c for c in (TunerdError, Failed, UsageError, NoSuchProcess, PermissionDenied,
                        DaemonUnreachable)
}


def error_from_reply(err: dict[str, Any]) -> TunerdError:
    """Rebuild the exception a daemon reply describes (client side)."""
    cls = _BY_CODE.get(str(err.get("code")), TunerdError)
    exc = cls(str(err.get("message", "unknown error")), **(err.get("details") or {}))
    try:
        exc.exit_code = ExitCode(int(err.get("exit", cls.exit_code)))
    except ValueError:
        pass
    return exc


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """Parse one message; raises UsageError for anything but a JSON object."""
    try:
        obj = json.loads(line)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise UsageError(f"malformed message: {err}") from err
    if not isinstance(obj, dict):
        raise UsageError("malformed message: expected a JSON object")
    return obj
