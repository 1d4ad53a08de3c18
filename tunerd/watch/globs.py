"""fnmatch-style globs matched in time linear in the string, for the exec path.

``fnmatch.translate`` turns ``*train*.py*`` into a regex whose lazy ``.*?`` steps
through the string one character at a time in the regex engine (~15 ns a
character here, 15 ms for a 1 MiB command line); older Pythons also backtrack on
``*a*b*`` patterns. Here a glob is split at its stars into fixed-length segments;
the first must match at the start, the last at the end, and each one between is
found with the leftmost ``str.find`` (or, for a segment with ``?``/``[...]``, a
fixed-length regex search). Leftmost is always right for fixed-length segments,
so there is no backtracking, and ``str.find`` runs at memchr speed.

Same syntax and results as ``fnmatch.fnmatchcase`` (case-sensitive, ``*`` and ``?``
match ``/`` and newlines too); tests/test_procfs_rules.py checks that on random
patterns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["Glob", "GlobSet"]

_Segment = str | re.Pattern[str]  # a literal, or a regex for a segment with ? or [...]


def _atoms(pat: str) -> list[str | None]:
    """Regex source of each one-character atom of ``pat``; None for a run of stars.

    The bracket handling is fnmatch.translate's (CPython Lib/fnmatch.py), kept
    identical so that a glob means here what it means to fnmatch.
    """
    res: list[str | None] = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        i += 1
        if c == "*":
            if not res or res[-1] is not None:
                res.append(None)
        elif c == "?":
            res.append(".")
        elif c == "[":
            j = i
            if j < n and pat[j] == "!":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            while j < n and pat[j] != "]":
                j += 1
            if j >= n:
                res.append("\\[")
                continue
            stuff = pat[i:j]
            if "-" not in stuff:
                stuff = stuff.replace("\\", r"\\")
            else:
                chunks = []
                k = i + 2 if pat[i] == "!" else i + 1
                while True:
                    k = pat.find("-", k, j)
                    if k < 0:
                        break
                    chunks.append(pat[i:k])
                    i = k + 1
                    k = k + 3
                chunk = pat[i:j]
                if chunk:
                    chunks.append(chunk)
                else:
                    chunks[-1] += "-"
                for k in range(len(chunks) - 1, 0, -1):  # drop empty ranges (z-a)
                    if chunks[k - 1][-1] > chunks[k][0]:
                        chunks[k - 1] = chunks[k - 1][:-1] + chunks[k][1:]
                        del chunks[k]
                stuff = "-".join(s.replace("\\", r"\\").replace("-", r"\-") for s in chunks)
            stuff = re.sub(r"([&~|])", r"\\\1", stuff)  # set operations are literal here
            i = j + 1
            if not stuff:
                res.append("(?!)")  # empty set: never matches
            elif stuff == "!":
                res.append(".")
            else:
                if stuff[0] == "!":
                    stuff = "^" + stuff[1:]
                elif stuff[0] in ("^", "["):
                    stuff = "\\" + stuff
                res.append(f"[{stuff}]")
        else:
            res.append(re.escape(c))
    return res


def _segment(atoms: list[str], literal: list[str]) -> tuple[_Segment, int]:
    """A star-free run of atoms: a plain string when every atom is a literal."""
    if len(literal) == len(atoms):
        return "".join(literal), len(atoms)
    return re.compile("(?s:" + "".join(atoms) + ")"), len(atoms)


class Glob:
    """One glob, compiled once; :meth:`match` is linear in the string's length."""

    __slots__ = ("_head", "_middle", "_tail", "ends_with_star", "pattern", "starless")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        segs: list[list[tuple[str, str | None]]] = [[]]
        for a in _atoms(pattern):
            if a is None:
                segs.append([])
            else:
                # a literal character is its own re.escape-d source minus the backslash
                lit = a[1:] if a.startswith("\\") and len(a) == 2 else a
                is_lit = a == re.escape(lit) and len(lit) == 1
                segs[-1].append((a, lit if is_lit else None))
        compiled: list[tuple[_Segment, int]] = []
        for seg in segs:
            atoms = [a for a, _ in seg]
            lits = [lit for _, lit in seg if lit is not None]
            compiled.append(_segment(atoms, lits))
        self.starless = len(compiled) == 1
        self.ends_with_star = not self.starless and compiled[-1][1] == 0
        self._head = compiled[0]
        self._tail = compiled[-1] if not self.starless else ("", 0)
        self._middle = compiled[1:-1]

    def __repr__(self) -> str:
        return f"Glob({self.pattern!r})"

    @staticmethod
    def _at(seg: _Segment, s: str, pos: int) -> bool:
        if isinstance(seg, str):
            return s.startswith(seg, pos)
        return seg.match(s, pos) is not None

    def match(self, s: str, cut: bool = False) -> bool:
        """Whether the glob matches all of ``s``.

        ``cut``: ``s`` is only the start of a longer string. Then the glob must match
        within ``s`` and end with ``*`` (which stands for the unseen rest): a glob
        that needs anything past the cut does not match.
        """
        (head, hlen), (tail, tlen) = self._head, self._tail
        n = len(s)
        if self.starless:
            return not cut and n == hlen and self._at(head, s, 0)
        if cut and not self.ends_with_star:
            return False
        if n < hlen + tlen or not self._at(head, s, 0):
            return False
        pos, end = hlen, n - tlen
        for seg, length in self._middle:
            if isinstance(seg, str):
                k = s.find(seg, pos, end)
                if k < 0:
                    return False
            else:
                m = seg.search(s, pos, end)
                if m is None:
                    return False
                k = m.start()
            pos = k + length
        return tlen == 0 or self._at(tail, s, end)


class GlobSet:
    """Any of several globs."""

    __slots__ = ("globs",)

    def __init__(self, patterns: Iterable[str]) -> None:
        self.globs = tuple(Glob(p) for p in patterns)

    def __bool__(self) -> bool:
        return bool(self.globs)

    def __repr__(self) -> str:
        return f"GlobSet({[g.pattern for g in self.globs]!r})"

    def match(self, s: str, cut: bool = False) -> bool:
        return any(g.match(s, cut) for g in self.globs)
