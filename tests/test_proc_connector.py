"""The proc connector watcher against the real kernel: events for processes we spawn."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from tunerd.watch.proc_connector import (
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    ExecWatcher,
    ProcConnector,
    ProcEvent,
    QueueReader,
    build_filter,
    kernel_has_event_filter,
)

ROOT = pytest.mark.root  # subscribing to the proc connector needs CAP_NET_ADMIN


def drain(conn: ProcConnector, until: float = 0.3) -> list[ProcEvent]:
    out: list[ProcEvent] = []
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        out += conn.read()
        time.sleep(0.02)
    return out


def test_kernel_version_gate() -> None:
    assert kernel_has_event_filter("6.6.0")
    assert kernel_has_event_filter("6.18.44-fc-v857")
    assert not kernel_has_event_filter("6.5.13-generic")
    assert not kernel_has_event_filter("5.15.0")
    assert not kernel_has_event_filter("weird")


def test_filter_program_is_valid_bpf() -> None:
    for events in (PROC_EVENT_EXEC, PROC_EVENT_EXIT, PROC_EVENT_EXEC | PROC_EVENT_EXIT):
        prog = build_filter(events)
        assert len(prog) % 8 == 0 and 0 < len(prog) // 8 < 64


@ROOT
def test_exec_events_for_spawned_processes() -> None:
    conn = ProcConnector(PROC_EVENT_EXEC)
    conn.open()
    try:
        pids = []
        for _ in range(5):
            p = subprocess.Popen(["/bin/true"])
            p.wait()
            pids.append(p.pid)
        events = drain(conn)
    finally:
        conn.close()
    execs = [e for e in events if e.what == PROC_EVENT_EXEC]
    seen = {e.tgid for e in execs}
    assert set(pids) <= seen, f"missing exec events for {set(pids) - seen}"
    # the BPF filter passes nothing but exec events
    assert all(e.what == PROC_EVENT_EXEC for e in events)
    for pid in pids:
        assert sum(1 for e in execs if e.tgid == pid) == 1


@ROOT
def test_exit_events_only_for_thread_group_leaders() -> None:
    conn = ProcConnector(PROC_EVENT_EXEC | PROC_EVENT_EXIT)
    conn.open()
    try:
        # a process whose extra threads exit before it does
        code = ("import threading\n"
                "ts=[threading.Thread(target=lambda: None) for _ in range(4)]\n"
                "[t.start() for t in ts]; [t.join() for t in ts]\n")
        p = subprocess.Popen([sys.executable, "-c", code])
        p.wait()
        events = drain(conn)
    finally:
        conn.close()
    mine = [e for e in events if e.tgid == p.pid]
    assert [e.what for e in mine if e.what == PROC_EVENT_EXEC] == [PROC_EVENT_EXEC]
    exits = [e for e in mine if e.what == PROC_EVENT_EXIT]
    assert len(exits) == 1 and exits[0].pid == p.pid  # the 4 thread exits were dropped
    assert all(e.pid == e.tgid for e in events if e.what == PROC_EVENT_EXIT)


@ROOT
def test_exec_watcher_on_the_loop() -> None:
    seen: list[int] = []
    rescans: list[int] = []

    async def main() -> int:
        w = ExecWatcher(seen.append, lambda: rescans.append(1))
        w.start()
        assert w.mode == "proc-connector"
        p = await asyncio.create_subprocess_exec("/bin/true")
        await p.wait()
        for _ in range(100):
            if p.pid in seen:
                break
            await asyncio.sleep(0.01)
        w.stop()
        assert w.mode == "stopped"
        return p.pid

    pid = asyncio.run(main())
    assert pid in seen
    assert not rescans


def test_exec_watcher_fallback_scans_proc() -> None:
    rescans: list[float] = []

    async def main() -> str:
        w = ExecWatcher(lambda pid: None, lambda: rescans.append(time.monotonic()),
                        scan_interval=0.1, use_connector=False)
        w.start()
        await asyncio.sleep(0.35)
        mode = w.mode
        w.stop()
        return mode

    assert asyncio.run(main()) == "proc-scan"
    assert len(rescans) >= 2


@ROOT
def test_overrun_is_reported_and_triggers_one_rescan() -> None:
    conn = ProcConnector(PROC_EVENT_EXEC, rcvbuf=1)  # the kernel rounds up to its minimum
    conn.open()
    try:
        for _ in range(150):
            subprocess.Popen(["/bin/true"]).wait()
        with pytest.raises(OSError) as info:
            conn.read()
        assert type(info.value).__name__ == "Overrun"
    finally:
        conn.close()

    rescans: list[int] = []

    async def main() -> None:
        w = ExecWatcher(lambda pid: None, lambda: rescans.append(1), rcvbuf=1)
        w.start()
        # a burst while the loop is blocked and cannot read
        for _ in range(150):
            subprocess.Popen(["/bin/true"]).wait()
        for _ in range(50):
            if w.overruns:
                break
            await asyncio.sleep(0.02)
        w.stop()
        assert w.overruns >= 1

    asyncio.run(main())
    assert rescans


@ROOT
def test_bursts_are_read_in_batches() -> None:
    seen: set[int] = set()

    async def main() -> tuple[list[int], ExecWatcher]:
        w = ExecWatcher(seen.add, lambda: None)
        w.start()
        loop = asyncio.get_running_loop()

        def spawn_many() -> list[int]:
            pids = []
            for _ in range(200):
                p = subprocess.Popen(["/bin/true"])
                p.wait()
                pids.append(p.pid)
            return pids

        pids = await loop.run_in_executor(None, spawn_many)
        for _ in range(100):
            if set(pids) <= seen:
                break
            await asyncio.sleep(0.02)
        w.stop()
        return pids, w

    pids, w = asyncio.run(main())
    assert set(pids) <= seen  # nothing lost
    assert w.batches >= 1, w.status()  # the burst was let queue up and read in a row


@ROOT
def test_unprivileged_listener_is_refused_and_watcher_falls_back(unpriv_user) -> None:
    from tests.helpers import run_as
    from tunerd.watch.proc_connector import ConnectorUnavailable, listen_refusal

    assert listen_refusal() is None  # root, init namespaces: this test's own process

    def as_user() -> tuple[str, str, str | None]:
        try:
            ProcConnector().open()
            opened = "opened"
        except ConnectorUnavailable as err:
            opened = f"{err.errno}:{err.strerror}"

        async def main() -> tuple[str, str | None]:
            w = ExecWatcher(lambda pid: None, lambda: None, scan_interval=0.05)
            w.start()
            await asyncio.sleep(0.01)
            w.stop()
            return ("proc-scan" if w.scans else "none"), w.reason

        mode, reason = asyncio.run(main())
        return opened, mode, reason

    opened, mode, reason = run_as(*unpriv_user, as_user)
    assert opened.startswith("1:") and "CAP_NET_ADMIN" in opened  # EPERM
    assert mode == "proc-scan" and reason and "CAP_NET_ADMIN" in reason


@ROOT
@pytest.mark.skipif(not kernel_has_event_filter(), reason="kernel < 6.6: no proc_input filter")
def test_kernel_event_filter_works_without_bpf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ask the kernel for exec events only, with a BPF filter that would pass exits too."""
    import tunerd.watch.proc_connector as pc

    monkeypatch.setattr(pc, "build_filter",
                        lambda events: build_filter(PROC_EVENT_EXEC | PROC_EVENT_EXIT))
    conn = ProcConnector(PROC_EVENT_EXEC)
    conn.open()
    try:
        assert conn.kernel_filter
        p = subprocess.Popen(["/bin/true"])
        p.wait()
        events = drain(conn)
    finally:
        conn.close()
    assert any(e.tgid == p.pid and e.what == PROC_EVENT_EXEC for e in events)
    assert not [e for e in events if e.what == PROC_EVENT_EXIT]


@ROOT
def test_the_bpf_filter_can_be_changed_on_an_open_socket() -> None:
    """Subscribed to exits as well, passed through only after set_filter."""
    conn = ProcConnector(PROC_EVENT_EXEC | PROC_EVENT_EXIT, filter_events=PROC_EVENT_EXEC)
    conn.open()
    try:
        first = subprocess.Popen(["/bin/true"])
        first.wait()
        before = drain(conn)
        assert conn.set_filter(PROC_EVENT_EXEC | PROC_EVENT_EXIT)
        second = subprocess.Popen(["/bin/true"])
        second.wait()
        after = drain(conn)
    finally:
        conn.close()
    assert [e.what for e in before if e.tgid == first.pid] == [PROC_EVENT_EXEC]
    assert [e.what for e in after if e.tgid == second.pid] == [PROC_EVENT_EXEC,
                                                                 PROC_EVENT_EXIT]


@ROOT
def test_in_a_burst_only_execs_that_already_exited_go_unread() -> None:
    """skip_exited: a storm's commands that were gone before their batch was read are
    dropped; a process exec'd in the middle of the storm that still runs is taken."""
    seen: set[int] = set()

    async def main() -> tuple[list[int], int, ExecWatcher]:
        w = ExecWatcher(seen.add, lambda: None, skip_exited=True)
        w.start()
        loop = asyncio.get_running_loop()

        def storm() -> tuple[list[int], subprocess.Popen[bytes]]:
            pids = []
            for i in range(200):
                if i == 100:
                    live = subprocess.Popen(["/bin/sleep", "5"])
                p = subprocess.Popen(["/bin/true"])
                p.wait()
                pids.append(p.pid)
            return pids, live

        pids, live = await loop.run_in_executor(None, storm)
        try:
            for _ in range(100):  # every event handled: taken, or dropped unread
                if live.pid in seen and len(set(pids) - seen) <= w.exited_unread:
                    break
                await asyncio.sleep(0.02)
        finally:
            live.kill()
            live.wait()
        w.stop()
        return pids, live.pid, w

    pids, live, w = asyncio.run(main())
    assert live in seen, w.status()
    assert w.batches >= 1 and w.exited_unread >= 1, w.status()
    assert len(set(pids) - seen) <= w.exited_unread, w.status()  # none lost otherwise


@ROOT
@pytest.mark.parametrize("mmsg", [True, False], ids=["recvmmsg", "recv"])
def test_the_queue_reader_returns_every_queued_event(mmsg: bool) -> None:
    conn = ProcConnector(PROC_EVENT_EXEC)
    conn.open()
    try:
        reader = QueueReader(conn.sock())
        assert (reader._mmsg is not None) or not mmsg  # glibc has recvmmsg
        if not mmsg:
            reader._mmsg = None
        pids = []
        for _ in range(150):  # more than one recvmmsg call's 64 slots
            p = subprocess.Popen(["/bin/true"])
            p.wait()
            pids.append(p.pid)
        got = reader.read()
        assert reader.read() == []  # nothing left, and no blocking
    finally:
        conn.close()
    assert set(pids) <= {tgid for what, tgid in got if what == PROC_EVENT_EXEC}


@ROOT
def test_the_watcher_thread_is_real_time_while_sparse_and_normal_in_a_storm() -> None:
    """rt_priority: a lone exec is taken at SCHED_FIFO (nice -10 kept beneath it), the
    execs of a storm at SCHED_OTHER, and the next lone one at SCHED_FIFO again."""
    policies: dict[int, int] = {}

    def select(pid: int) -> int:
        policies[pid] = os.sched_getscheduler(0)  # the watcher thread's own
        return pid

    async def main() -> tuple[int, list[int], int, ExecWatcher[int]]:
        w = ExecWatcher(lambda pid: None, lambda: None, select=select, rt_priority=1,
                        nice=-10)
        w.start()
        loop = asyncio.get_running_loop()

        def run() -> tuple[int, list[int], int]:
            def one() -> int:
                p = subprocess.Popen(["/bin/true"])
                p.wait()
                return p.pid
            first = one()
            time.sleep(0.2)
            storm = [one() for _ in range(100)]
            time.sleep(0.5)  # the burst is over
            return first, storm, one()

        first, storm, last = await loop.run_in_executor(None, run)
        await asyncio.sleep(0.2)
        w.stop()
        return first, storm, last, w

    first, storm, last, w = asyncio.run(main())
    assert w.thread_policy == "SCHED_FIFO 1 while execs are sparse, nice -10", w.status()
    assert policies.get(first) == os.SCHED_FIFO, policies
    assert policies.get(last) == os.SCHED_FIFO, policies
    assert w.batches >= 1, w.status()
    in_storm = [policies[p] for p in storm if p in policies]
    assert os.SCHED_OTHER in in_storm, in_storm  # those read in batches


@ROOT
def test_the_watcher_runs_the_rest_of_an_event_at_a_normal_priority_once_lowered() -> None:
    """lower_for_rest, from ``select`` (the exec watcher binds the main thread first,
    then lowers): the rest of that event runs at SCHED_OTHER, the next event starts at
    SCHED_FIFO again; called from another thread it changes nothing."""
    seen: dict[int, tuple[int, int]] = {}
    holder: list[ExecWatcher[int]] = []

    def select(pid: int) -> int:
        before = os.sched_getscheduler(0)
        holder[0].lower_for_rest()
        seen[pid] = (before, os.sched_getscheduler(0))
        return pid

    async def main() -> list[int]:
        w = ExecWatcher(lambda pid: None, lambda: None, select=select, rt_priority=1,
                        nice=-10)
        holder.append(w)
        w.start()
        loop = asyncio.get_running_loop()

        def run() -> list[int]:
            pids = []
            for _ in range(3):
                p = subprocess.Popen(["/bin/true"])
                p.wait()
                pids.append(p.pid)
                time.sleep(0.1)  # sparse: each read on its own, at SCHED_FIFO
            return pids

        pids = await loop.run_in_executor(None, run)
        await asyncio.sleep(0.2)
        w.lower_for_rest()  # not the watcher's thread: no effect on it, nor on this one
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert w._rt and not w._lowered
        w.stop()
        return pids

    pids = asyncio.run(main())
    assert all(seen.get(p) == (os.SCHED_FIFO, os.SCHED_OTHER) for p in pids), (pids, seen)
