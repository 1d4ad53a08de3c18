"""Small text helpers shared by the CLI and by checks that run without it (stdlib only)."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "thread")`` -> "1 thread"; ``plural(2, "thread")`` -> "2 threads"."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
