"""Logging helpers for the daemon: a filter that rate-limits repeated identical messages.

A local user can make the daemon fail the same way thousands of times a second
(a connection flood, a stream of malformed requests). Each failure is worth one
line, not one line per occurrence: the log (journald, a file) is a shared
resource too, and 30 MB of identical tracebacks hide the one line that matters.
"""

from __future__ import annotations

import contextvars
import logging
import logging.handlers
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tunerd.base.text import safe

__all__ = ["LOG_FILE_BACKUPS", "LOG_FILE_BYTES", "MAX_LOG_TEXT", "EscapeFilter",
           "PrivateRotatingFileHandler", "RepeatFilter", "UserRateFilter", "acting_for",
           "safe_traceback"]

# characters of one log message, and of one line of a traceback (an exception's text
# may quote a whole command line, a tag, an environment value or a policy string)
MAX_LOG_TEXT = 16384

# --log-file (no journald): at most LOG_FILE_BYTES * (1 + LOG_FILE_BACKUPS) on disk
LOG_FILE_BYTES = 10 << 20
LOG_FILE_BACKUPS = 3


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """Size-rotated log file (FILE, FILE.1 ... FILE.N), mode 0600: it holds command
    lines and other users' process names, which /proc may hide from them (hidepid).
    Opened without following a symlink."""

    def __init__(self, path: str, max_bytes: int = LOG_FILE_BYTES,
                 backups: int = LOG_FILE_BACKUPS) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8",
                         delay=False)

    def _open(self):  # type: ignore[no-untyped-def]  # logging's own untyped hook
        return os.fdopen(open_log_file(self.baseFilename), "a", encoding=self.encoding,
                         errors=self.errors)


def open_log_file(path: str) -> int:
    """``path`` opened for appending, as only a file no one else could have put there:
    its directory (and those above it) owned by root (or the daemon's uid) and
    writable by no one else (tunerd.base.safefs.check_dir), the file itself a regular file
    (O_NOFOLLOW: no symlink; O_NONBLOCK: a FIFO cannot hang the start) owned by the
    same, mode 0600. Anything else is a ``Failed`` naming the path and why."""
    import errno
    import stat

    from tunerd.base.errors import Failed
    from tunerd.base.safefs import check_dir, file_kind, trusted_uids

    try:
        check_dir(Path(path).parent, "log directory")
    except Failed as err:
        raise Failed(f"log file {path}: {err.message}", path=path) from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Failed(f"log file {path}: a symbolic link; refusing to follow it",
                         path=path) from None
        if err.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader, a dir
            raise Failed(f"log file {path}: not a regular file", path=path) from None
        raise Failed(f"log file {path}: {err.strerror or err}", path=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Failed(f"log file {path}: not a regular file ({file_kind(st.st_mode)})",
                         path=path)
        if st.st_uid not in trusted_uids():
            raise Failed(f"log file {path}: owned by uid {st.st_uid}, not by root; "
                         "refusing it (its owner could read what tunerd logs)", path=path)
        os.fchmod(fd, 0o600)  # an existing file from an older install: 0644 before
    except BaseException:
        os.close(fd)
        raise
    return fd

# the uid whose request (or exec, for a rule) the code running now serves; set in a
# context of its own per request by the control server, per match by the autobinder
_acting_uid: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "tunerd_acting_uid", default=None)


def acting_for(uid: int | None) -> None:
    """Log lines from here on (in this context) are caused by ``uid``."""
    _acting_uid.set(uid)


class UserRateFilter(logging.Filter):
    """At most ``burst`` lines per ``window`` seconds caused by one non-root uid.

    What a user's requests make the daemon log (a lease made and released, a rule
    bound) is one distinct line each, which the repeat filter cannot stop: a loop of
    6,000 allocs would be 12,000 lines. Past the burst, one line says the uid's lines
    are being suppressed, and the first line let through in a later window says how
    many were. A traceback counts every line it writes (the line that says the rest
    is suppressed goes without its traceback). At most ``max_users`` uids are
    tracked (least recent out).
    """

    def __init__(self, burst: int = 20, window: float = 60.0, max_users: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.max_users = max_users
        self.clock = clock
        self._users: OrderedDict[int, list[float]] = OrderedDict()  # [start, passed, dropped]
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        uid = _acting_uid.get()
        if uid is None or uid == 0:
            return True
        cost = _lines(record)  # a traceback counts every line it writes
        now = self.clock()
        ent = self._users.get(uid)
        if ent is None or now - ent[0] >= self.window:
            dropped = int(ent[2]) if ent is not None else 0
            ent = self._users[uid] = [now, 0, 0]
            if len(self._users) > self.max_users:
                self._users.popitem(last=False)
            if dropped:
                self._amend(record, f" [uid {uid}: {dropped} line(s) suppressed in the "
                                    f"previous {self.window:g} s]")
        self._users.move_to_end(uid)
        if ent[1] + cost <= self.burst:
            ent[1] += cost
            return True
        ent[2] += cost
        self.dropped_total += cost
        if ent[2] == cost:  # say once that the rest of this window is not logged
            _one_line(record)
            self._amend(record, f" [uid {uid}: {self.burst} lines in {self.window:g} s: "
                                "further lines its requests cause are suppressed for now]")
            return True
        return False

    @staticmethod
    def _amend(record: logging.LogRecord, note: str) -> None:
        try:
            text = record.getMessage()
        except Exception:
            return
        record.msg, record.args = text + note, None


def _lines(record: logging.LogRecord) -> int:
    """Lines ``record`` writes: its message, its traceback, its stack."""
    n = 1
    if record.exc_info and not record.exc_text:
        record.exc_text = safe_traceback(record.exc_info)  # what the Formatter writes
    if record.exc_text:
        n += record.exc_text.count("\n") + 1
    if record.stack_info:
        n += record.stack_info.count("\n") + 1
    return n


def _one_line(record: logging.LogRecord) -> None:
    """``record`` without its traceback and stack: the one line of its message."""
    record.exc_info, record.exc_text, record.stack_info = None, None, None


class EscapeFilter(logging.Filter):
    """Control characters in a message (a tag, a command line, a process name a user
    chose) are escaped visibly (tunerd.base.text.safe): no user can forge a log line with a
    newline, or send ESC sequences to whoever reads the log on a terminal. The message
    is cut to MAX_LOG_TEXT; a traceback (``log.exception``) is written with each line
    escaped the same way (safe_traceback), its stack (``stack_info``) too."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string is the handler's problem, not ours
            return True
        clean = safe(text, MAX_LOG_TEXT)
        if clean != text:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:  # the Formatter keeps exc_text
            record.exc_text = safe_traceback(record.exc_info)
        if record.stack_info:
            record.stack_info = "\n".join(safe(line, MAX_LOG_TEXT)
                                          for line in record.stack_info.splitlines())
        return True


_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"
ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


def safe_traceback(exc_info: ExcInfo) -> str:
    """The traceback logging would write for ``exc_info``, each line made ``safe`` and
    cut to MAX_LOG_TEXT: an exception's message that quotes a user's text (a command
    line with ESC and CR LF in it) stays on its one line, escaped, instead of moving
    the reader's cursor or starting a line that looks like a record of its own."""
    import traceback

    value = exc_info[1]
    if value is None:
        return "NoneType: None"
    chain: list[tuple[str | None, traceback.TracebackException]] = []
    te: traceback.TracebackException | None = traceback.TracebackException(
        type(value), value, exc_info[2])
    seen: set[int] = set()
    while te is not None and id(te) not in seen and len(chain) < 32:
        seen.add(id(te))
        if te.__cause__ is not None:
            chain.append((_CAUSE, te))
            te = te.__cause__
        elif te.__context__ is not None and not te.__suppress_context__:
            chain.append((_CONTEXT, te))
            te = te.__context__
        else:
            chain.append((None, te))
            te = None
    lines: list[str] = []
    for why, exc in reversed(chain):  # the first cause first, as Python prints it
        if why is not None:
            lines += ["", why, ""]
        if exc.stack:
            lines.append("Traceback (most recent call last):")
            lines += [ln for chunk in exc.stack.format() for ln in chunk.splitlines()]
        # one chunk is "Type: message" whole, the newlines in the message with it
        lines += [chunk.rstrip("\n") for chunk in exc.format_exception_only()]
    return "\n".join(safe(line, MAX_LOG_TEXT) for line in lines)


class RepeatFilter(logging.Filter):
    """Let through ``burst`` identical records per ``window`` seconds, drop the rest.

    Records are identical when logger, level, rendered message and exception type
    are. The first record let through after some were dropped says how many.
    At most ``max_keys`` distinct messages are tracked (least recently seen first
    out), so the filter's memory is bounded whatever is logged.
    """

    def __init__(self, burst: int = 5, window: float = 60.0, max_keys: int = 2048,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.max_keys = max_keys
        self.clock = clock
        # key -> [window start, records let through in it, records dropped]
        self._seen: OrderedDict[tuple[object, ...], list[float]] = OrderedDict()
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        try:
            text = record.getMessage()
        except Exception:  # a bad format string is the handler's problem, not ours
            return True
        key = (record.name, record.levelno, text, exc)
        now = self.clock()
        ent = self._seen.get(key)
        if ent is None or now - ent[0] >= self.window:
            dropped = int(ent[2]) if ent is not None else 0
            self._seen[key] = [now, 1, 0]
            self._seen.move_to_end(key)
            if len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
            if dropped:
                self._note(record, dropped)
            return True
        self._seen.move_to_end(key)
        if ent[1] < self.burst:
            ent[1] += 1
            return True
        ent[2] += 1
        self.dropped_total += 1
        return False

    def _note(self, record: logging.LogRecord, dropped: int) -> None:
        record.msg = (f"{record.getMessage()} [{dropped} identical message(s) suppressed "
                      f"in the previous {self.window:g} s]")
        record.args = None
