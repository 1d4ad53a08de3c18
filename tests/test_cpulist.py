"""The kernel cpulist syntax: parsing, formatting, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist


@pytest.mark.parametrize("text, ids", [
    ("", set()),
    ("  \n", set()),
    ("0", {0}),
    ("0-3", {0, 1, 2, 3}),
    ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
    ("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}),  # as read from sysfs
    ("3,1,2", {1, 2, 3}),
    ("1-1", {1}),
    ("0-3,2-5", {0, 1, 2, 3, 4, 5}),  # overlaps are fine
    # strides "lo-hi:used/group" (lib/bitmap.c bitmap_parselist)
    ("0-1023:2/256", {0, 1, 256, 257, 512, 513, 768, 769}),
    ("0-15:1/4", {0, 4, 8, 12}),
    ("0-7:4/4", set(range(8))),
    ("2-9:3/4", {2, 3, 4, 6, 7, 8}),
])
def test_parse(text: str, ids: set[int]) -> None:
    assert parse_cpulist(text) == frozenset(ids)


@pytest.mark.parametrize("text, fragment", [
    ("a", "'a' is not a number"),
    ("1-x", "'x' is not a number"),
    ("-3", "'' is not a number"),
    ("3-", "'' is not a number"),
    ("0,,1", "empty element"),
    ("0-3,", "empty element"),
    ("5-2", "runs backwards"),
    ("0-99999999", "too large"),
    ("0-15:4", "needs ':used/group'"),
    ("0-15:0/4", "bad stride"),
    ("0-15:5/4", "bad stride"),
    ("0-15:1/0", "bad stride"),
    ("\u0663", "is not a number"),  # Arabic-Indic digit three: not the kernel's syntax
    ("1.5", "is not a number"),
    ("0x3", "is not a number"),
])
def test_parse_errors_name_the_bad_part(text: str, fragment: str) -> None:
    with pytest.raises(CpuListError) as exc:
        parse_cpulist(text)
    assert fragment in str(exc.value)
    assert repr(text) in str(exc.value)


@pytest.mark.parametrize("ids, text", [
    (set(), ""),
    ({0}, "0"),
    ({0, 1, 2, 3}, "0-3"),
    ({0, 1, 2, 3, 8, 10, 11}, "0-3,8,10-11"),
    ([3, 1, 2, 2], "1-3"),
    ({0, 2, 4}, "0,2,4"),
    ({5, 6}, "5-6"),
])
def test_format(ids: set[int], text: str) -> None:
    assert format_cpulist(ids) == text


@given(st.sets(st.integers(min_value=0, max_value=600), max_size=80))
def test_round_trip(ids: set[int]) -> None:
    assert parse_cpulist(format_cpulist(ids)) == frozenset(ids)


@given(st.sets(st.integers(min_value=0, max_value=600), min_size=1, max_size=80))
def test_format_is_canonical(ids: set[int]) -> None:
    text = format_cpulist(ids)
    assert format_cpulist(parse_cpulist(text)) == text
    parts = text.split(",")
    # ranges never touch: the formatter merges neighbours
    ends = [int(p.split("-")[-1]) for p in parts]
    starts = [int(p.split("-")[0]) for p in parts]
    assert all(s > e + 1 for s, e in zip(starts[1:], ends[:-1], strict=True))


def test_real_sysfs_lists_parse() -> None:
    online = Path("/sys/devices/system/cpu/online")
    if not online.exists():
        pytest.skip("no /sys/devices/system/cpu/online")
    ids = parse_cpulist(online.read_text())
    assert ids and 0 in ids
    status = Path("/proc/self/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
    assert parse_cpulist(line.split(":", 1)[1]) <= ids
