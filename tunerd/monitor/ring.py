"""A fixed-size ring of fixed-width float rows, preallocated once.

The monitor keeps an hour of history for every GPU, the host and each bound
job. Storing rows as ``array('d')`` slots (8 bytes a value, NaN for "not
available") instead of dicts makes the memory bound a property of the
construction: ``capacity * width * 8`` bytes per ring, allocated up front and
never grown, whatever runs on the node.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence

NAN = math.nan


class Ring:
    """``capacity`` rows of ``len(fields)`` floats; the oldest row is overwritten."""

    __slots__ = ("_buf", "_next", "_size", "capacity", "fields", "width")

    def __init__(self, fields: Sequence[str], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be >= 1, got {capacity}")
        self.fields = tuple(fields)
        self.width = len(self.fields)
        self.capacity = capacity
        self._buf = array("d", bytes(8 * self.width * capacity))
        self._next = 0
        self._size = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the row storage (fixed at construction)."""
        return self._buf.itemsize * len(self._buf)

    def __len__(self) -> int:
        return self._size

    def append(self, row: Iterable[float | None]) -> None:
        """Store one row; ``None`` becomes NaN (not available). Wrong width is a bug."""
        # array("d") converts ints, floats and bools itself (a str is a TypeError)
        vals = array("d", [NAN if v is None else v for v in row])
        if len(vals) != self.width:
            raise ValueError(f"row has {len(vals)} values, ring has {self.width} fields")
        start = self._next * self.width
        self._buf[start:start + self.width] = vals
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def rows(self, last: int | None = None) -> list[tuple[float, ...]]:
        """The newest ``last`` rows (all when None), oldest first."""
        n = self._size if last is None else max(0, min(last, self._size))
        out: list[tuple[float, ...]] = []
        first = (self._next - n) % self.capacity
        for i in range(n):
            start = ((first + i) % self.capacity) * self.width
            out.append(tuple(self._buf[start:start + self.width]))
        return out

    def columns(self, last: int | None = None) -> dict[str, list[float]]:
        """The newest rows as one list per field (what the advise rules read)."""
        rows = self.rows(last)
        return {name: [r[i] for r in rows] for i, name in enumerate(self.fields)}
