"""The kernel's cpulist syntax (``0-3,8,10-11``), used for CPU and NUMA-node sets.

Same grammar as ``/sys/devices/system/cpu/online`` and ``Cpus_allowed_list`` in
/proc/PID/status; see lib/bitmap.c ``bitmap_parselist`` in the kernel. Strides
(``0-15:2/4``) are accepted too, as the kernel does.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CpuListError", "format_cpulist", "parse_cpulist"]

MAX_ID = 1 << 16  # far above any real CPU count; guards against "0-4000000000"


class CpuListError(ValueError):
    """A cpulist string that does not parse; the message quotes it."""


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse ``0-3,8,10-11`` into ``{0, 1, 2, 3, 8, 10, 11}``.

    An empty (or all-whitespace) string is the empty set, as the kernel writes
    it for an empty mask. Raises CpuListError naming the bad part.
    """
    s = text.strip()
    if not s:
        return frozenset()
    out: set[int] = set()
    for part in s.split(","):
        part = part.strip()
        if not part:
            raise CpuListError(f"malformed cpulist {text!r}: empty element")
        stride = 1
        used = 0
        rng = part
        if ":" in part:
            # "lo-hi:used/group": the first ``used`` of every ``group`` ids, as in
            # bitmap_parselist (e.g. 0-1023:2/256 = 0,1,256,257,512,513,768,769)
            rng, _, step = part.partition(":")
            used_s, sep, group_s = step.partition("/")
            if not sep:
                raise CpuListError(f"malformed cpulist {text!r}: {part!r} needs ':used/group'")
            used = _num(used_s, text)
            stride = _num(group_s, text)
            if stride == 0 or used == 0 or used > stride:
                raise CpuListError(f"malformed cpulist {text!r}: bad stride in {part!r}")
        lo_s, dash, hi_s = rng.partition("-")
        lo = _num(lo_s, text)
        hi = _num(hi_s, text) if dash else lo
        if hi < lo:
            raise CpuListError(f"malformed cpulist {text!r}: range {rng!r} runs backwards")
        if hi >= MAX_ID:
            raise CpuListError(f"malformed cpulist {text!r}: {hi} is too large")
        if ":" in part:
            for base in range(lo, hi + 1, stride):
                out.update(x for x in range(base, min(base + used, hi + 1)))
        else:
            out.update(range(lo, hi + 1))
    return frozenset(out)


def _num(s: str, text: str) -> int:
    s = s.strip()
    # str.isdigit() is true for non-ASCII digits too ("\u0663"); the kernel takes ASCII only
    if not (s.isascii() and s.isdigit()):
        raise CpuListError(f"malformed cpulist {text!r}: {s!r} is not a number")
    return int(s)


def format_cpulist(ids: Iterable[int]) -> str:
    """Format a set of ids the way the kernel prints it: ``0-3,8,10-11``."""
    xs = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)
