"""What the intake and the cpuset watcher keep of a process lives in its record of the
node's ledger, and goes when the process exits (issue 33 item 6): real processes started
here, a real pidfd read on a real asyncio loop. Each check fails if the entry outlives
its process (the maps these slots replaced kept it until an event or a bound).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tunerd.adapters import procfs
from tunerd.jobs.cpusetwatch import FOLLOWED, CpusetWatch
from tunerd.jobs.intake import CHAIN, LAUNCHER, PARENT, Intake
from tunerd.jobs.ledger import Ledger
from tunerd.topology import load_topology

HOST_CPUS = frozenset(os.sched_getaffinity(0))
# a parent (python) with one child (sleep); the child's pid on stdout
PARENT_CODE = ("import subprocess, sys, time\n"
               "p = subprocess.Popen(['sleep', '60'])\n"
               "print(p.pid, flush=True)\n"
               "time.sleep(60)\n")


async def until(pred: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s: {what}"
        await asyncio.sleep(0.01)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def test_a_parents_kept_ancestry_and_its_pidfd_go_when_it_execs_or_exits() -> None:
    """A quick look keeps the parent's ancestry in the parent's record, which holds the
    parent's one pidfd: released when the parent execs, and with its whole record
    (ancestry, command line and environment, launcher verdict) when it exits."""

    async def scenario() -> None:
        ledger = Ledger()
        ledger.attach()
        it = Intake(load_topology(None), HOST_CPUS, bound=lambda pid: None,
                    lease=lambda pid: None, ledger=ledger)
        parent = subprocess.Popen([sys.executable, "-c", PARENT_CODE], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "LOCAL_RANK": "0"})
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        try:
            await until(lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(
                b"sleep\0"), "the child's exec of sleep")  # its own argv and environment
            it.describe(child, quick=True)
            kept = ledger.get(parent.pid, CHAIN)
            assert kept is not None and kept.ups[0][0] == parent.pid and kept.watched
            assert ledger.pidfd(parent.pid) >= 0
            # a rank's child (LOCAL_RANK inherited): its parent's command line and
            # environment, and the parent's launcher verdict (a Python process: none)
            assert ledger.get(parent.pid, PARENT) is not None
            assert ledger.get(parent.pid, LAUNCHER) == ""
            it.exec_seen(parent.pid)  # what was read of it is stale: its pidfd goes too
            assert ledger.get(parent.pid, CHAIN) is None and ledger.pidfd(parent.pid) == -1
            assert ledger.get(parent.pid, PARENT) is None
            it.describe(child, quick=True)  # kept again, watched again
            assert ledger.get(parent.pid, CHAIN) is not None
            assert ledger.pidfd(parent.pid) >= 0
            parent.kill()
            parent.wait()
            await until(lambda: ledger.key(parent.pid) is None,
                        "the parent's record gone with it")
            assert ledger.get(parent.pid, CHAIN) is None
            assert ledger.get(parent.pid, LAUNCHER) is None
            assert ledger.get(parent.pid, PARENT) is None
            assert ledger.pidfd(parent.pid) == -1
        finally:
            _kill(child)
            parent.kill()
            parent.wait()

    asyncio.run(scenario())


def test_a_followed_process_leaves_its_cgroup_when_it_exits_untold() -> None:
    """The cpuset watcher follows a bound process in a slot of its record and watches its
    cgroup; the process exits and nobody tells the watcher (no registry here): its slot,
    and its cgroup's watch, go all the same."""
    p = subprocess.Popen(["sleep", "60"])
    start = procfs.read_start_time(p.pid)
    assert start is not None

    async def rebind(pid: int, cpus: frozenset[int]) -> object:
        raise AssertionError(f"no re-bind expected (pid {pid}, CPUs {sorted(cpus)})")

    async def scenario() -> None:
        ledger = Ledger()
        w = CpusetWatch(lambda pid: (start, ",".join(map(str, sorted(HOST_CPUS))))
                        if pid == p.pid else None, rebind, inotify=False,
                        sys_root=Path("/sys"), ledger=ledger)
        await w.start()
        try:
            w.changed(p.pid)
            await until(lambda: ledger.get(p.pid, FOLLOWED) is not None, "followed")
            followed = ledger.get(p.pid, FOLLOWED)
            assert followed is not None and followed.wanted == HOST_CPUS
            if followed.where is not None:  # a cpuset cgroup holds it: watched
                assert w.status()["cgroups"] != []
            assert ledger.pidfd(p.pid) >= 0
            p.kill()
            p.wait()
            await until(lambda: ledger.key(p.pid) is None, "the record gone with it")
            assert ledger.get(p.pid, FOLLOWED) is None
            assert w.status()["cgroups"] == []  # nothing left to watch
        finally:
            await w.stop()

    try:
        asyncio.run(scenario())
    finally:
        p.kill()
        p.wait()
