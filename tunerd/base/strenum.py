"""A str enum for names that travel as text (policy, wire, state JSON)."""

from __future__ import annotations

import enum

__all__ = ["TextEnum"]


class TextEnum(str, enum.Enum):
    """Equal to, printed as and hashed as its string: a member and its spelling are
    interchangeable as dict keys, in f-strings and in JSON (Python 3.10 has no
    ``enum.StrEnum``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __hash__(self) -> int:  # equal to its string, so hashes the same
        return str.__hash__(self)
