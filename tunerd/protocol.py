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


# JSON through the C accelerator module directly: importing the ``json`` package
# (json.decoder, json.scanner, json.encoder) costs about 1 ms of every tunerctl
# run. The results are exactly json.dumps(obj, separators=(",", ":")) and
# json.loads; ``json`` itself is imported only to word an error, or where the
# accelerator is missing.
class _ScanContext:
    """The attributes _json.make_scanner reads from a json.JSONDecoder."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo: dict[str, Any] = {}

    @staticmethod
    def parse_constant(name: str) -> float:
        return float({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[name])


def _not_serializable(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


try:
    import _json

    _context: Any = _ScanContext  # duck-typed: typeshed names the real class
    _scan: Any = _json.make_scanner(_context)
    _make_encoder: Any = _json.make_encoder
    _encode_str: Any = _json.encode_basestring_ascii
except (ImportError, AttributeError):  # pragma: no cover - no C accelerator
    _scan = _make_encoder = _encode_str = None

_JSON_SPACE = " \t\n\r"


def encode(obj: dict[str, Any]) -> bytes:
    if _make_encoder is None:  # pragma: no cover
        import json

        return json.dumps(obj, separators=(",", ":"), sort_keys=False).encode() + b"\n"
    enc = _make_encoder({}, _not_serializable, _encode_str, None, ":", ",", False, False, True)
    return "".join(enc(obj, 0)).encode() + b"\n"


def _loads(line: bytes) -> Any:
    if _scan is not None:
        try:
            text = line.decode()
            s = text.strip(_JSON_SPACE)
            obj, end = _scan(s, 0)
            if end == len(s):
                return obj
        except (UnicodeDecodeError, ValueError, StopIteration):
            pass  # json.loads below words the error
    import json

    return json.loads(line)


def decode(line: bytes) -> dict[str, Any]:
    """Parse one message; raises UsageError for anything but a JSON object."""
    try:
        obj = _loads(line)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise UsageError(f"malformed message: {err}") from err
    if not isinstance(obj, dict):
        raise UsageError("malformed message: expected a JSON object")
    return obj
