"""The node's ledger (tunerd.jobs.ledger) on real processes: one record per process,
one pidfd, slots read by exit callbacks and gone with the process, bounded caches."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Awaitable, Callable

from tunerd.adapters import procfs
from tunerd.jobs.ledger import UNWATCHED_MAX, Ledger, ProcKey, Slot

NAME: Slot[str] = Slot("name")
SEEN: Slot[int] = Slot("seen")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"])


def _key(p: subprocess.Popen[bytes]) -> ProcKey:
    start = procfs.read_start_time(p.pid)
    assert start is not None
    return ProcKey(p.pid, start)


def _pidfds(pid: int) -> int:
    """How many pidfds of ``pid`` this process holds."""
    n = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[pidfd]":
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                if f"Pid:\t{pid}\n" in f.read():
                    n += 1
        except OSError:
            pass
    return n


def _with_sleeper(body: Callable[[Ledger, subprocess.Popen[bytes]], Awaitable[None]],
                  unwatched_max: int = UNWATCHED_MAX) -> None:
    """``body`` on the loop, with a ledger attached to it and a sleeper it may watch."""
    async def go() -> None:
        ledger = Ledger(unwatched_max=unwatched_max)
        ledger.attach()
        p = _sleeper()
        try:
            await body(ledger, p)
        finally:
            p.kill()
            p.wait()

    asyncio.run(go())


def test_exit_callbacks_read_the_slots_then_the_record_goes() -> None:
    async def body(ledger: Ledger, p: subprocess.Popen[bytes]) -> None:
        key = _key(p)
        ledger.put(key, NAME, "rank 0")
        seen: list[tuple[int, str | None]] = []
        done = asyncio.Event()

        def gone(pid: int) -> None:
            seen.append((pid, ledger.get(pid, NAME)))
            done.set()

        assert ledger.watch(p.pid, key.start, "a", gone)
        assert ledger.watch(p.pid, key.start, "b", lambda pid: None)
        assert _pidfds(p.pid) == 1  # two watchers, one pidfd
        assert ledger.count(NAME) == 1 and ledger.pidfds_opened == 1
        p.kill()
        p.wait()
        await asyncio.wait_for(done.wait(), 5)
        assert seen == [(p.pid, "rank 0")]
        assert ledger.get(p.pid, NAME) is None and ledger.count(NAME) == 0
        assert len(ledger) == 0 and _pidfds(p.pid) == 0

    _with_sleeper(body)


def test_a_pidfd_handed_over_from_another_thread_is_the_one_kept() -> None:
    async def body(ledger: Ledger, p: subprocess.Popen[bytes]) -> None:
        key = _key(p)
        fd = os.pidfd_open(p.pid)
        took: list[bool] = []
        t = threading.Thread(target=lambda: took.append(ledger.adopt_fd(key, fd)))
        t.start()
        t.join()
        assert took == [True]
        await asyncio.sleep(0.05)  # the loop registers the reader
        fired = asyncio.Event()
        assert ledger.watch(p.pid, key.start, "x", lambda pid: fired.set())
        assert ledger.pidfds_opened == 0 and _pidfds(p.pid) == 1
        fd2 = os.pidfd_open(p.pid)
        try:
            assert not ledger.adopt_fd(key, fd2)  # one pidfd: the second stays the caller's
        finally:
            os.close(fd2)
        assert not ledger.exited(p.pid)
        p.kill()
        p.wait()
        await asyncio.wait_for(fired.wait(), 5)
        assert _pidfds(p.pid) == 0

    _with_sleeper(body)


def test_a_watch_of_another_process_under_the_pid_is_refused() -> None:
    async def body(ledger: Ledger, p: subprocess.Popen[bytes]) -> None:
        key = _key(p)
        assert not ledger.watch(p.pid, key.start + 1, "x", lambda pid: None)
        assert ledger.get(p.pid, NAME, start=key.start + 1) is None
        ledger.put(key, NAME, "mine")
        assert ledger.get(p.pid, NAME, start=key.start) == "mine"
        assert ledger.get(p.pid, NAME, start=key.start + 1) is None
        # a record of a process that ended, its pid taken by another: the new one
        # replaces it (the old one's slots never read as the new one's)
        ledger.put(ProcKey(p.pid, key.start + 7), SEEN, 1)
        assert ledger.get(p.pid, NAME) is None and ledger.get(p.pid, SEEN) == 1
        assert ledger.count(NAME) == 0 and ledger.count(SEEN) == 1

    _with_sleeper(body)


def test_records_with_no_pidfd_are_bounded_and_live_ones_stay() -> None:
    async def body(ledger: Ledger, p: subprocess.Popen[bytes]) -> None:
        key = _key(p)
        assert ledger.watch(p.pid, key.start, "x", lambda pid: None)
        ledger.put(key, SEEN, -1)
        for i in range(1, 1000):  # caches of looks at processes long gone
            ledger.put(ProcKey(4_000_000 + i, i), SEEN, i)
        assert len(ledger) <= 100
        assert ledger.count(SEEN) == len(ledger)
        assert ledger.get(p.pid, SEEN) == -1  # the watched one was never dropped

    _with_sleeper(body, unwatched_max=100)
