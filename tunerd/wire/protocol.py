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
from collections.abc import Callable
from typing import Any

from tunerd.base.errors import (
    DaemonUnreachable,
    Failed,
    NoSuchProcess,
    PermissionDenied,
    PlacementError,
    PolicyError,
    TunerdError,
    UsageError,
)
from tunerd.base.text import MAX_ERROR_MESSAGE as MAX_ERROR_MESSAGE
from tunerd.base.text import bounded_message

__all__ = [
    "MAX_CMD",
    "MAX_CMD_ARG",
    "MAX_CMD_ARGS",
    "MAX_INT_DIGITS",
    "MAX_MESSAGE",
    "MAX_NAME",
    "MAX_REQUEST_NUMBERS",
    "MAX_TAG",
    "PID_MAX_LIMIT",
    "ExitCode",
    "bounded_command",
    "bounded_str",
    "check_int",
    "command_record",
    "decode",
    "encode",
    "error_from_reply",
    "error_to_wire",
    "exit_code",
    "reply_id",
]

MAX_MESSAGE = 1 << 20  # 1 MiB: longer request lines are refused
DEFAULT_SOCKET = "/run/tunerd/tunerd.sock"


class ExitCode(enum.IntEnum):
    """Exit codes of tunerctl and tunerd (README, "Exit codes")."""

    OK = 0
    FAILED = 1  # the operation failed, a check found problems, or drift was found
    USAGE = 2  # usage error: bad flag, bad value, malformed input
    UNREACHABLE = 3  # the daemon is not reachable
    PERMISSION = 4  # permission denied


# error class -> (wire code, exit status); the most specific class of an error wins
_WIRE: dict[type[TunerdError], tuple[str, ExitCode]] = {
    TunerdError: ("failed", ExitCode.FAILED),
    Failed: ("failed", ExitCode.FAILED),
    UsageError: ("usage", ExitCode.USAGE),
    NoSuchProcess: ("no_such_process", ExitCode.FAILED),
    PermissionDenied: ("permission", ExitCode.PERMISSION),
    DaemonUnreachable: ("unreachable", ExitCode.UNREACHABLE),
    PlacementError: ("placement", ExitCode.FAILED),
    PolicyError: ("policy", ExitCode.FAILED),
}
_BY_CODE: dict[str, type[TunerdError]] = {
    "failed": Failed, "usage": UsageError, "no_such_process": NoSuchProcess,
    "permission": PermissionDenied, "unreachable": DaemonUnreachable,
    "placement": PlacementError, "policy": PolicyError,
}


def _wire(err: TunerdError) -> tuple[str, ExitCode]:
    for cls in type(err).__mro__:
        hit = _WIRE.get(cls)
        if hit is not None:
            return hit
    return _WIRE[TunerdError]


def exit_code(err: TunerdError) -> ExitCode:
    """The exit status a command that failed with ``err`` ends with."""
    return _wire(err)[1]


# characters of an error's message in a reply (one that quotes a user's 900 KB
# --cpus, or lists every lease, is cut: the CLI prints it on someone's terminal)
def error_to_wire(err: TunerdError) -> dict[str, Any]:
    """The ``error`` object of a reply: code, message (at most MAX_ERROR_MESSAGE
    characters), exit status, details."""
    code, status = _wire(err)
    d: dict[str, Any] = {"code": code, "message": bounded_message(err.message),
                         "exit": int(status)}
    if err.details:
        d["details"] = err.details
    return d


def error_from_reply(err: dict[str, Any]) -> TunerdError:
    """Rebuild the exception a daemon reply describes (client side)."""
    cls = _BY_CODE.get(str(err.get("code")), Failed)
    details = err.get("details")
    return cls(str(err.get("message", "unknown error")),
               **(details if isinstance(details, dict) else {}))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):  # 1e999: valid JSON syntax, but no finite number
        raise ValueError(f"{text[:40]} is out of range")
    return value


_INF = float("inf")

# Bounds on what a client may send (docs/security-limits.md). A whole message is at
# most MAX_MESSAGE; integers fit 64 bits (a 5,000-digit number is refused before
# Python converts it); user-chosen strings that the daemon keeps or shows have their
# own limits, checked by bounded_str.
MAX_INT_DIGITS = 19  # |n| < 10**19: every value the daemon takes fits an int64
MAX_TAG = 128  # alloc/run --tag
MAX_NAME = 128  # names: rules, policies, process names shown
# `tunerctl run` sends the daemon a record of its command (for jobs/leases/the log;
# it exec()s its own argv, which these limits do not touch): the first 8 words
MAX_CMD_ARGS = 8  # words of the command as recorded
MAX_CMD_ARG = 512  # bytes of one word of it
MAX_CMD = 1024  # bytes of the whole record
MAX_REQUEST_NUMBERS = 4096  # numbers in one request (no node has more CPUs or GPUs)


# Ranges of the integer arguments a request may carry, checked where the daemon takes
# them (Request.arg), before any of them reaches a system call: a value outside is a
# UsageError (exit 2) naming the argument, the value and the range.
PID_MAX_LIMIT = 1 << 22  # the kernel's PID_MAX_LIMIT (4,194,304): no PID is larger
MAX_COUNT = 1 << 16  # a count of CPUs, GPUs or workers (cpulist.MAX_ID, CUDA indices)
MAX_NOFILE = (1 << 31) - 1  # RLIMIT_NOFILE past this is above the kernel's nr_open
INT_RANGES: dict[str, tuple[int, int, str]] = {
    "pid": (1, PID_MAX_LIMIT, "the kernel's PID_MAX_LIMIT"),
    "ncpus": (1, MAX_COUNT, "a CPU count"),
    "gpus": (0, MAX_COUNT, "a GPU count"),
    "workers": (0, MAX_COUNT, "a worker count"),
    "nofile": (1, MAX_NOFILE, "RLIMIT_NOFILE"),
}


def check_int(cmd: str, name: str, value: int) -> int:
    """``value`` if argument ``name`` of ``cmd`` is within its range (INT_RANGES);
    a UsageError naming the argument, the value and the range otherwise."""
    rng = INT_RANGES.get(name)
    if rng is not None and not rng[0] <= value <= rng[1]:
        raise UsageError(f"{cmd}: {name} {value} is out of range: {rng[0]} to {rng[1]} "
                         f"({rng[2]})")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text) - (text[0] in "+-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits is out of range "
                         f"(at most {MAX_INT_DIGITS})")
    return int(text)


def bounded_str(what: str, value: str, limit: int) -> str:
    """``value`` if it is at most ``limit`` bytes (UTF-8); a UsageError naming ``what``
    and both sizes otherwise."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise UsageError(f"{what} is {size} bytes, longer than the limit of {limit} "
                         "(docs/security-limits.md)")
    return value


def command_record(argv: list[str]) -> list[str]:
    """What tunerctl sends as the record of ``argv``: within the limits bounded_command
    checks (words cut with "...")."""
    out: list[str] = []
    total = 0
    for word in argv[:MAX_CMD_ARGS]:
        b = word.encode("utf-8", "surrogateescape")
        if len(b) > MAX_CMD_ARG:
            word = b[:MAX_CMD_ARG - 3].decode("utf-8", "ignore") + "..."
        if total + len(word.encode("utf-8", "surrogateescape")) > MAX_CMD:
            break
        total += len(word.encode("utf-8", "surrogateescape"))
        out.append(word)
    return out


def bounded_command(cmd: list[str]) -> list[str]:
    """A `tunerctl run` command within MAX_CMD_ARGS words, MAX_CMD_ARG bytes a word and
    MAX_CMD bytes in all; a UsageError otherwise."""
    if len(cmd) > MAX_CMD_ARGS:
        raise UsageError(f"the command has {len(cmd)} words, more than the limit of "
                         f"{MAX_CMD_ARGS} (docs/security-limits.md)")
    total = 0
    for i, word in enumerate(cmd):
        bounded_str(f"word {i} of the command", word, MAX_CMD_ARG)
        total += len(word.encode("utf-8", "surrogatepass"))
    if total > MAX_CMD:
        raise UsageError(f"the command is {total} bytes, longer than the limit of {MAX_CMD} "
                         "(docs/security-limits.md)")
    return cmd


def encode(obj: dict[str, Any]) -> bytes:
    """One message line. Raises ValueError for NaN/Infinity (not JSON) and TypeError for
    values JSON cannot hold: a peer must never receive a line it cannot parse."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


class _NumberBudget:
    """parse_int/parse_float hooks that stop a parse at the (limit + 1)th number: what
    parsing a request costs stays bounded (a 1 MiB list of ``0,0,...`` holds 500,000
    numbers, each a Python call and an object) whatever its size."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def _take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {self.limit} numbers in one message "
                             "(docs/security.md)")

    def int_(self, text: str) -> int:
        self._take()
        return _bounded_int(text)

    def float_(self, text: str) -> float:
        self._take()
        return _finite(text)


def decode(line: bytes, max_numbers: int | None = None) -> dict[str, Any]:
    """Parse one message; raises UsageError for anything but a JSON object.

    NaN, Infinity and 1e999 (which Python's json accepts) are refused, and so is nesting
    deep enough to exhaust the parser's recursion (``[`` x 100,000), and, where
    ``max_numbers`` is given (requests), a message with more numbers than that.
    """
    parse_int: Callable[[str], int] = _bounded_int
    parse_float: Callable[[str], float] = _finite
    if max_numbers is not None:
        budget = _NumberBudget(max_numbers)
        parse_int, parse_float = budget.int_, budget.float_
    try:
        obj = json.loads(line, parse_constant=_no_constant, parse_float=parse_float,
                         parse_int=parse_int)
    except RecursionError:
        raise UsageError("malformed message: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise UsageError(f"malformed message: {err}") from err
    if not isinstance(obj, dict):
        raise UsageError("malformed message: expected a JSON object")
    return obj


def reply_id(msg: dict[str, Any]) -> str | int | None:
    """The request's ``id`` as a reply may echo it: a string, an integer or null."""
    rid = msg.get("id")
    if rid is None or isinstance(rid, str) or (isinstance(rid, int)
                                                and not isinstance(rid, bool)):
        return rid
    return None
