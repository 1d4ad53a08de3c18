"""Work the daemon does not do while nobody reads it (issue 15's whole-daemon CPU budget).

Its threads sleep in the kernel without a timeout where nothing needs a timer (read
back from /proc/self/task/TID/syscall: the system call a thread is blocked in and its
arguments, not timed); facts only a reader uses are read when a reader asks."""

from __future__ import annotations

import asyncio
import platform
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from tests.helpers import ask_child, wait_for
from tests.test_monitor_service import make_monitor
from tunerd.monitor.facts import FleetFacts
from tunerd.monitor.http import serve_metrics

X86_64_POLL = 7  # poll(2) on x86_64
NO_TIMEOUT = 0xFFFFFFFF  # poll's timeout, an int: -1 in the low 32 bits of its register


def _syscall(tid: int) -> list[str]:
    """``NR arg1 ... arg6 sp pc`` of the call thread ``tid`` is blocked in ("running"
    while it runs)."""
    return Path(f"/proc/self/task/{tid}/syscall").read_text().split()


def _in_poll_forever(tid: int) -> bool:
    f = _syscall(tid)
    return len(f) > 3 and f[0] == str(X86_64_POLL) and int(f[3], 16) & NO_TIMEOUT == NO_TIMEOUT


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86_64 syscall numbers")
def test_the_metrics_server_sleeps_without_a_timeout_between_scrapes() -> None:
    """socketserver's loop polls every 0.5 s for a shutdown request; the metrics
    server's waits in poll(2) with no timeout, serves scrapes, and still stops."""
    reg = CollectorRegistry(auto_describe=False)
    Gauge("tunerd_test_value", "a value", registry=reg).set(3)
    server, thread = serve_metrics("127.0.0.1", 0, reg)
    try:
        assert thread.native_id is not None
        tid = thread.native_id
        wait_for(lambda: _in_poll_forever(tid), 10.0, "the metrics thread blocked in poll(-1)",
                 detail=lambda: " ".join(_syscall(tid)))
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        for _ in range(2):
            with urllib.request.urlopen(url, timeout=10) as r:
                assert b"tunerd_test_value 3.0" in r.read()
            wait_for(lambda: _in_poll_forever(tid), 10.0, "back in poll(-1) after a scrape",
                     detail=lambda: " ".join(_syscall(tid)))
        stopper = threading.Thread(target=server.shutdown, daemon=True)
        stopper.start()
        stopper.join(10.0)
        thread.join(10.0)
        assert not stopper.is_alive() and not thread.is_alive()
    finally:
        server.server_close()


def test_fleet_facts_are_read_by_a_scrape_not_by_sampling_cycles(tmp_path: Path) -> None:
    """NICs, nccl.conf and PCIe links: never read by a sampling cycle; read by the
    first scrape, not again by one within LIVE_EVERY, and again by the first scrape
    after a policy change (whose NCCL settings it then shows)."""
    reads: list[int] = []
    settings = {"NCCL_IB_HCA": "mlx5_0"}

    def nccl_conf() -> tuple[dict[str, str], str | None]:
        reads.append(1)
        return dict(settings), None

    mon = make_monitor(tmp_path)
    mon.fleet = FleetFacts(nccl_conf=nccl_conf, python=None)

    async def go() -> list[str]:
        await mon.start()
        for _ in range(3):
            await mon.cycle()
        texts = [] if reads else [mon.exposition()]  # none read by the cycles
        texts.append(mon.exposition())
        settings["NCCL_IB_HCA"] = "mlx5_1"
        texts.append(mon.exposition())  # within LIVE_EVERY: the facts read before
        mon.fleet.policy_changed(("base",), [], {"policy": {"name": "base"}})
        texts.append(mon.exposition())
        await mon.stop()
        return texts

    texts = asyncio.run(go())
    assert len(texts) == 4 and len(reads) == 2
    line = 'tunerd_nccl_setting_info{key="NCCL_IB_HCA",value="%s"} 1.0'
    assert all(line % "mlx5_0" in t for t in texts[:3])
    assert line % "mlx5_1" in texts[3]


@pytest.mark.root
def test_the_cpuset_backstop_poll_runs_on_the_ticker_thread_not_the_loop() -> None:
    """With inotify and a ticker (the monitor's sampling thread), the watcher arms no
    timer of its own; a cpuset change inotify did not deliver (its reader taken off the
    loop here) is found by ``poll_elsewhere`` from another thread, and re-bound."""
    import os
    import time

    from tests.binding_helpers import task_cpus, thread_child
    from tests.kubepods_helpers import kubepods_tree
    from tunerd.base.cpulist import format_cpulist
    from tunerd.jobs.cpusetwatch import CpusetWatch

    with kubepods_tree(cpus="0-1") as tree, thread_child(threads=2, cgroup=tree.ctr) as p:
        st = int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        record = {"pid": p.pid, "start_time": st, "cpus": "1"}
        rebinds: list[str] = []

        async def rebind(pid: int, cpus: frozenset[int]) -> dict[str, object]:
            for tid in task_cpus(pid):
                os.sched_setaffinity(tid, cpus)
            record["cpus"] = format_cpulist(cpus)
            rebinds.append(format_cpulist(cpus))
            return dict(record)

        def masks() -> set[str]:
            return set(task_cpus(p.pid).values())

        async def until(pred: object, what: str) -> None:
            deadline = time.monotonic() + 10.0
            while not pred():  # type: ignore[operator]
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.01)

        async def scenario() -> None:
            w = CpusetWatch(lambda pid: (st, str(record["cpus"])) if pid == p.pid else None,
                            rebind, bound=lambda: [p.pid], ticker=1.0)
            await w.start()
            loop = asyncio.get_running_loop()
            try:
                assert w.status()["inotify"] is True
                await rebind(p.pid, frozenset({1}))
                await until(lambda: tree.cgroup_path() in w.status()["cgroups"], "tracked")
                await until(lambda: w._expected, "the round's end (what a poll compares)")
                # the loop has no timer for the watcher: only the ticker polls
                assert not [h for h in loop._scheduled  # type: ignore[attr-defined]
                            if not h.cancelled()]
                loop.remove_reader(w._ino.fileno())  # inotify events no longer arrive
                n = len(rebinds)
                ticker = threading.Thread(target=w.poll_elsewhere)  # the sampler's thread
                ticker.start()
                ticker.join()
                await asyncio.sleep(0.05)
                assert len(rebinds) == n  # nothing changed: the loop was not woken
                tree.set_cpus("0", grow=False)  # shrinks the cpuset below the binding
                ticker = threading.Thread(target=w.poll_elsewhere)
                ticker.start()
                ticker.join()
                await until(lambda: record["cpus"] == "0" and masks() == {"0"},
                            "re-bound inside cpuset 0 after the ticker's poll")
                assert len(rebinds) > n
            finally:
                await w.stop()

        asyncio.run(scenario())


IDLER = """
import subprocess, sys, time
kids = []
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("spin"):
        t = time.process_time()
        while time.process_time() - t < 0.05:
            pass
    elif line.startswith("fork"):
        kids.append(subprocess.Popen(["sleep", "60"]))
    print("done", flush=True)
"""


def _settled(pid: int) -> None:
    """Wait until ``pid`` sleeps (blocked in its stdin read) with a stat that stays."""
    import time

    def still() -> bool:
        a = Path(f"/proc/{pid}/stat").read_bytes()
        time.sleep(0.05)
        b = Path(f"/proc/{pid}/stat").read_bytes()
        return a == b and a[a.rindex(b")") + 2:].startswith(b"S")

    wait_for(still, 10.0, f"pid {pid} asleep with an unchanging stat")


def test_an_unchanged_job_reuses_its_sample_and_a_change_is_read_in_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose stat did not change and that has no child: its io and fd count are
    not read again (for up to QUIET_EVERY - 1 cycles), and every sample is the one a
    full read gives; unwatched, every other cycle it is not read at all; CPU time or a
    child since makes the next cycle it is read a full read."""
    import subprocess
    import sys

    from tunerd.adapters.procfs import Process
    from tunerd.monitor import jobs as jobs_mod
    from tunerd.monitor.jobs import JobSampler

    p = subprocess.Popen([sys.executable, "-c", IDLER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None

    def ask(what: str) -> None:
        ask_child(p, what)

    reads: dict[str, list[str]] = {"quiet": [], "full": []}

    class Counted(jobs_mod._OpenFiles):
        __slots__ = ("log",)

        def read(self, name: str) -> bytes:
            self.log.append(name)
            return super().read(name)

    monkeypatch.setattr(jobs_mod, "_OpenFiles", Counted)

    def counting(name: str) -> JobSampler:
        js = JobSampler(slow_every=1 << 30)  # no slow read (its first is offset by pid)
        real = js._files

        def files(key: tuple[object, object], pid: int) -> Counted | None:
            f = real(key, pid)
            if isinstance(f, Counted) and not hasattr(f, "log"):
                f.log = reads[name]
            return f  # type: ignore[return-value]

        js._files = files  # type: ignore[method-assign]
        return js

    try:
        assert p.stdout.readline() == "ready\n"
        rec = {"pid": p.pid, "start_time": Process(p.pid).start_time(), "name": "idle",
               "cpus": "0"}
        _settled(p.pid)
        quiet, full = counting("quiet"), counting("full")
        full._quiet = lambda *a: None  # type: ignore[method-assign]
        host = {"cpus": [{"cpu": 0, "busy_ratio": 0.5}]}
        for js in (quiet, full):
            js.sample([rec], {}, host)
        for name in reads:
            reads[name].clear()
        cycles = 2 * jobs_mod.QUIET_EVERY
        for i in range(cycles):  # watched: every job read every cycle
            host = {"cpus": [{"cpu": 0, "busy_ratio": i / cycles}]}
            [a] = quiet.sample([rec], {}, host, watched=True)
            [b] = full.sample([rec], {}, host)
            assert a == b and a["cpus_busy_ratio"] == i / cycles and a["cpu_cores"] == 0.0
        assert reads["full"].count("io") == cycles
        assert reads["quiet"].count("io") == 2  # every QUIET_EVERY-th cycle
        assert reads["quiet"].count("stat") == cycles
        # not watched: every other cycle its last sample stands, unread; the full read
        # still comes every QUIET_EVERY-th cycle
        reads["quiet"].clear()
        prev = None
        for i in range(cycles):
            n = reads["quiet"].count("stat")
            host = {"cpus": [{"cpu": 0, "busy_ratio": i / cycles}]}
            [a] = quiet.sample([rec], {}, host)
            if reads["quiet"].count("stat") == n:
                assert a is prev
            else:
                assert a["cpus_busy_ratio"] == i / cycles
            prev = a
        assert cycles // 2 <= reads["quiet"].count("stat") < cycles
        assert reads["quiet"].count("io") == 2
        # it ran: read in full at once (watched) or at the next cycle, its CPU time
        # over the cycles since it was last seen
        for watched in (True, False):
            ask("spin")
            n = reads["quiet"].count("io")
            for _ in range(1 if watched else 2):
                [a] = quiet.sample([rec], {}, host, watched=watched)
                if reads["quiet"].count("io") > n:
                    break
            assert reads["quiet"].count("io") == n + 1 and a["cpu_cores"] > 0
            for _ in range(2):
                quiet.sample([rec], {}, host)
        ask("fork")  # a child: counted within two cycles, then read in full every cycle
        counts = [quiet.sample([rec], {}, host)[0]["workers"] for _ in range(2)]
        assert counts[-1] == 1
        n = reads["quiet"].count("io")
        for _ in range(3):
            [a] = quiet.sample([rec], {}, host)
            assert a["workers"] == 1
        assert reads["quiet"].count("io") == n + 3
    finally:
        p.kill()
        p.wait()


def test_a_slow_read_of_an_unchanged_job_lists_no_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow read of a job whose stat did not change since its last full read
    carries its threads' states and children and its context switches (none moves
    while no thread runs) and still reads the fd limit; after CPU time it lists them."""
    import subprocess
    import sys

    from tunerd.adapters.procfs import Process
    from tunerd.monitor import jobs as jobs_mod
    from tunerd.monitor.jobs import JobSampler

    listed: list[int] = []
    real = jobs_mod._threads

    def threads(proc: Process, states: bool) -> tuple[list[int], int | None]:
        listed.append(proc.pid)
        return real(proc, states)

    monkeypatch.setattr(jobs_mod, "_threads", threads)
    p = subprocess.Popen([sys.executable, "-c", IDLER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline() == "ready\n"
        rec = {"pid": p.pid, "start_time": Process(p.pid).start_time(), "name": "idle",
               "cpus": "0"}
        _settled(p.pid)
        js = JobSampler(slow_every=1)  # every read a slow one
        [first] = js.sample([rec], {})
        assert listed == [p.pid] and first["runnable_threads"] is not None
        nofile = js._state[(p.pid, rec["start_time"])].nofile
        for _ in range(3):
            [s] = js.sample([rec], {})
            assert s["voluntary_ctxt_switches_total"] == first["voluntary_ctxt_switches_total"]
            assert s["runnable_threads"] == first["runnable_threads"]
        assert listed == [p.pid]
        monkeypatch.setattr(Process, "nofile", lambda self: (7, 9))
        [s] = js.sample([rec], {})
        assert (s["nofile_soft"], s["nofile_hard"]) == (7, 9) != nofile
        p.stdin.write("spin\n")
        p.stdin.flush()
        assert p.stdout.readline() == "done\n"
        js.sample([rec], {})
        assert listed == [p.pid, p.pid]  # its slow read in full again
    finally:
        p.kill()
        p.wait()
