"""Small text helpers shared by the CLI and by checks that run without it (stdlib only).

``safe`` makes text a user chose (a lease tag, a process name set with
PR_SET_NAME, a command line, an environment value) safe to show on a terminal or
write to a log: control characters -- C0 (ESC, CR, LF, TAB ...), DEL, C1
(U+0080-U+009F, which some terminals take as CSI/OSC too) and the bidi overrides --
become visible escapes (``\\x1b``, ``\\n``, ``\\u202e``), so nothing a user wrote can
move the cursor, retitle a window (OSC 2) or forge a log line.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["MAX_ERROR_MESSAGE", "bounded_int", "bounded_message", "plural", "safe", "safe_tree"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(code: int) -> str:
    ch = chr(code)
    if ch in _NAMED:
        return _NAMED[ch]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


@functools.cache
def _table() -> dict[int, str]:
    """Code point -> its escape. Built whole on first use and then shared (threads of the
    daemon never see half of it). Every character in it is one str.isprintable() is
    false for (Cc, and the Cf bidi overrides), so printable text, nearly all of it,
    needs no table: tunerctl start-up time."""
    return {c: _escape(c) for r in (range(0x00, 0x20), range(0x7F, 0xA0),
                                    range(0x202A, 0x202F), range(0x2066, 0x206A))
            for c in r}


def _escape_all(text: str) -> str:
    return text if text.isprintable() else text.translate(_table())


def safe(text: str, limit: int | None = None) -> str:
    """``text`` with every control character escaped visibly; cut to ``limit``
    characters (with "...") when given. Backslashes are kept as they are: the escapes
    are for a human reader, not to be decoded."""
    out = _escape_all(text)
    if limit is not None and len(out) > limit:
        out = out[:max(limit - 3, 0)] + "..."
    return out


def safe_tree(obj: Any) -> Any:
    """``obj`` (a decoded JSON reply) with every string in it made ``safe``, keys too."""
    if isinstance(obj, str):
        return _escape_all(obj)
    if isinstance(obj, dict):
        return {safe_tree(k): safe_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [safe_tree(v) for v in obj]
    return obj


def bounded_int(text: str | None, lo: int, hi: int) -> int | None:
    """A decimal integer ``lo <= n <= hi`` from ``text`` (environment, /proc, a file);
    None for anything else -- never a ValueError, and no conversion of a 5,000-digit
    string (Python refuses those with ValueError past 4,300 digits)."""
    if text is None:
        return None
    s = text.strip()
    if not s.isascii() or not s.isdigit() or len(s) > len(str(hi)):
        return None
    n = int(s)
    return n if lo <= n <= hi else None


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "thread")`` -> "1 thread"; ``plural(2, "thread")`` -> "2 threads"."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


MAX_ERROR_MESSAGE = 4096


def bounded_message(text: str, limit: int = MAX_ERROR_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    note = f"... ({len(text) - limit + 60} more characters)"
    return text[:limit - 60] + note
