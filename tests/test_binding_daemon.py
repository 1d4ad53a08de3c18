"""tunerctl bind/unbind/jobs against the real daemon, on real multi-threaded children."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.binding_helpers import (
    cpuset_path,
    prlimit_nofile,
    scratch_cpuset,
    snapshot,
    start_time,
    task_cpus,
    thread_child,
)
from tests.helpers import DaemonProc, run_ctl, wait_for
from tunerd.base.cpulist import format_cpulist, parse_cpulist

pytestmark = pytest.mark.root

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
ALL = format_cpulist(ONLINE)
ONE = str(max(ONLINE))  # a single online CPU that is not "all of them" on 2+ CPU machines
OTHER = str(min(ONLINE))
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
needs_cpuset_v1 = pytest.mark.skipif(not (CPUSET_ROOT / "cpuset.cpus").exists(),
                                     reason="needs a cgroup v1 cpuset hierarchy")


def bind_json(d: DaemonProc, *args: str) -> dict:
    r = d.ctl("--json", "bind", *args)
    assert r.rc == 0, (r.out, r.err, d.log()[-2000:])
    return r.json()


def jobs_pids(d: DaemonProc) -> list[int]:
    r = d.ctl("--json", "jobs")
    assert r.rc == 0, r.err
    return [j["pid"] for j in r.json()["jobs"]]


@pytest.fixture
def daemon(module_daemon: DaemonProc) -> DaemonProc:
    """This module's tests share one real daemon (a start costs ~0.5 s): each binds only
    its own children, which are gone by its end; the next waits until the daemon has
    dropped their jobs, so that it finds the daemon as a fresh one would be."""
    wait_for(lambda: jobs_pids(module_daemon) == [], 10, "the last test's jobs to be dropped")
    return module_daemon


def test_bind_sets_every_thread_and_nofile_then_unbind_restores(daemon: DaemonProc) -> None:
    with thread_child(threads=40) as p:
        before = snapshot(p.pid)
        assert len(before["cpus"]) == 41
        r = bind_json(daemon, str(p.pid), "--cpus", ONE, "--nofile", "4096")
        assert r["threads"] == 41 and r["cpus"] == ONE and r["pid"] == p.pid
        assert r["nofile"] == {"old": 1024, "new": 4096}
        assert r["elapsed_ms"] > 0 and r["start_time"] == start_time(p.pid)
        cpus = task_cpus(p.pid)
        assert len(cpus) == 41 and set(cpus.values()) == {ONE}
        assert prlimit_nofile(p.pid) == (4096, before["nofile"][1])
        jobs = daemon.ctl("--json", "jobs").json()["jobs"]
        assert [(j["pid"], j["cpus"], j["nofile"], j["origin"]) for j in jobs] == [
            (p.pid, ONE, 4096, "cli")]
        # human output is one short line
        human = daemon.ctl("bind", str(p.pid), "--cpus", ONE)
        assert human.rc == 0
        assert human.out.strip() == f"bound pid {p.pid} (41 threads) to cpus {ONE}"

        u = daemon.ctl("unbind", str(p.pid))
        assert u.rc == 0, u.err
        assert u.out.strip() == f"unbound pid {p.pid}: restored 41 threads"
        assert snapshot(p.pid) == before
        assert jobs_pids(daemon) == []
        assert daemon.ctl("jobs").out.strip() == "no bound processes"


def test_threads_created_during_bind_are_bound(daemon: DaemonProc) -> None:
    with thread_child(threads=32, churn=True) as p:
        for cpus in (ONE, OTHER, ONE):
            r = bind_json(daemon, str(p.pid), "--cpus", cpus)
            assert r["threads"] >= 33
            # threads that exist now were either bound or created by a bound thread
            seen = task_cpus(p.pid)
            assert len(seen) >= 33
            assert set(seen.values()) == {cpus}, seen
        assert daemon.ctl("unbind", str(p.pid)).rc == 0
        assert set(task_cpus(p.pid).values()) == {ALL}


def test_rebind_keeps_the_first_originals(daemon: DaemonProc) -> None:
    with thread_child(threads=32) as p:
        before = snapshot(p.pid)
        bind_json(daemon, str(p.pid), "--cpus", ONE, "--nofile", "2048")
        r = bind_json(daemon, str(p.pid), "--cpus", OTHER, "--nofile", "3000")
        assert r["rebind"] is True and r["nofile"] == {"old": 2048, "new": 3000}
        assert set(task_cpus(p.pid).values()) == {OTHER}
        # a re-bind without --cpus keeps the CPUs it had
        r = bind_json(daemon, str(p.pid), "--nofile", "2500")
        assert r["cpus"] == OTHER and set(task_cpus(p.pid).values()) == {OTHER}
        assert daemon.ctl("unbind", str(p.pid)).rc == 0
        assert snapshot(p.pid) == before


def _free_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    assert not Path(f"/proc/{p.pid}").exists()
    return p.pid


# above the largest fs.nr_open any kernel takes (INT_MAX rounded down to 64: 2147483584),
# not only above the default 1048576: a host may have raised it
NOFILE_ABOVE_ANY_NR_OPEN = "2147483647"


@pytest.mark.parametrize("args, rc, message", [
    (["--cpus", "9999"], 2, "CPU 9999 is not online (online: "),
    (["--cpus", "1-x"], 2, "malformed cpulist '1-x'"),
    (["--cpus", "3-1"], 2, "runs backwards"),
    (["--mems", "1"], 2, "NUMA node 1 is not online (online: 0)"),
    (["--nofile", NOFILE_ABOVE_ANY_NR_OPEN], 2, "is above the kernel maximum fs.nr_open = "),
    (["--nofile", "0"], 2, "0"),
    (["--cpus", ONE, "--nofile", NOFILE_ABOVE_ANY_NR_OPEN], 2, "fs.nr_open"),  # nothing half-set
    (["--cpus", ONE, "--mems", "5"], 2, "NUMA node 5 is not online"),
    ([], 2, "no --cpus/--mems given and GPU placement is not available"),
    (["--gpus", "0"], 2, "no --cpus/--mems given and GPU placement is not available"),
    (["--cpus", ONE, "--gpus", "0"], 2, "GPU placement is not available"),
])
def test_bad_input_changes_nothing(daemon: DaemonProc, args: list[str], rc: int,
                                   message: str) -> None:
    with thread_child(threads=32) as p:
        before = snapshot(p.pid)
        r = daemon.ctl("bind", str(p.pid), *args)
        assert r.rc == rc, (r.out, r.err)
        assert message in r.err
        assert r.out == ""
        assert snapshot(p.pid) == before
        assert jobs_pids(daemon) == []


def test_nonexistent_pid(daemon: DaemonProc) -> None:
    pid = _free_pid()
    r = daemon.ctl("bind", str(pid), "--cpus", ONE)
    assert r.rc == 1 and f"no process with pid {pid}" in r.err
    r = daemon.ctl("bind", str(pid), "--gpus", "0")  # near GPUs: read its environment first
    assert r.rc == 1 and f"no process with pid {pid}" in r.err, r.err
    r = daemon.ctl("unbind", str(pid))
    assert r.rc == 1 and str(pid) in r.err


def test_malformed_cpulist_fails_before_any_socket_traffic(tmp_path: Path) -> None:
    # no daemon at this socket: a client-side check exits 2, not 3 (unreachable)
    r = run_ctl("--socket", str(tmp_path / "none.sock"), "bind", "1", "--cpus", "0-")
    assert r.rc == 2 and "malformed cpulist" in r.err and "Traceback" not in r.err
    r = run_ctl("--socket", str(tmp_path / "none.sock"), "bind", "1", "--cpus", ONE)
    assert r.rc == 3


def test_unbind_of_unbound_process_fails(daemon: DaemonProc) -> None:
    with thread_child(threads=1) as p:
        before = snapshot(p.pid)
        r = daemon.ctl("unbind", str(p.pid))
        assert r.rc == 1 and f"process {p.pid} is not bound" in r.err
        assert snapshot(p.pid) == before


def test_exit_of_a_bound_process_drops_its_job(daemon: DaemonProc) -> None:
    with thread_child(threads=32) as p:
        bind_json(daemon, str(p.pid), "--cpus", ONE)
        assert jobs_pids(daemon) == [p.pid]
        p.kill()  # the pidfd turns readable; no reaping needed
        wait_for(lambda: jobs_pids(daemon) == [], 10, "the job to be dropped")

    def saved_bindings() -> object:
        return json.loads((daemon.runtime_dir / "state.json").read_text())["bindings"]

    # the record of a dead process goes to disk with the next coalesced save (<= 0.5 s)
    wait_for(lambda: saved_bindings() == {}, 5, "the dropped job to be saved")


@needs_cpuset_v1
def test_mems_makes_a_nested_child_cpuset_removed_by_unbind(daemon: DaemonProc) -> None:
    with scratch_cpuset(ALL) as parent, thread_child(threads=32, cgroup=parent) as p:
        base = cpuset_path(p.pid)
        assert base == "/" + parent.name
        before = snapshot(p.pid)
        r = bind_json(daemon, str(p.pid), "--cpus", ONE, "--mems", "0")
        assert r["mems"] == "0" and r["pages_moved"] == 0  # one node: nothing to move
        child = f"{base}/tunerd-{p.pid}-{start_time(p.pid)}"
        assert cpuset_path(p.pid) == child  # nested under the job's own cpuset
        cdir = CPUSET_ROOT / child.lstrip("/")
        assert (cdir / "cpuset.mems").read_text().strip() == "0"
        assert (cdir / "cpuset.cpus").read_text().strip() == ONE
        assert (cdir / "cpuset.memory_migrate").read_text().strip() == "1"
        assert set(task_cpus(p.pid).values()) == {ONE}
        assert daemon.ctl("unbind", str(p.pid)).rc == 0
        assert not cdir.exists()
        assert snapshot(p.pid) == before


@needs_cpuset_v1
def test_child_cpuset_removed_when_the_process_exits(daemon: DaemonProc) -> None:
    with thread_child(threads=4) as p:
        bind_json(daemon, str(p.pid), "--mems", "0")
        cdir = CPUSET_ROOT / cpuset_path(p.pid).lstrip("/")
        assert cdir.name.startswith(f"tunerd-{p.pid}-") and cdir.exists()
        # --mems alone leaves the CPU masks as they were
        assert set(task_cpus(p.pid).values()) == {ALL}
        p.kill()
        wait_for(lambda: not cdir.exists(), 10, f"{cdir} to be removed")
        wait_for(lambda: jobs_pids(daemon) == [], 10, "the job to be dropped")


@needs_cpuset_v1
@pytest.mark.skipif(len(ONLINE) < 2, reason="needs two online CPUs")
def test_cpus_are_intersected_with_the_process_cpuset(daemon: DaemonProc) -> None:
    with scratch_cpuset(ONE) as parent, thread_child(threads=8, cgroup=parent) as p:
        before = snapshot(p.pid)
        r = daemon.ctl("bind", str(p.pid), "--cpus", OTHER)
        assert r.rc == 2
        assert (f"CPUs {OTHER} are outside what process {p.pid} may use: cgroup cpuset "
                f"/{parent.name} allows {ONE}") in r.err
        assert snapshot(p.pid) == before
        r2 = bind_json(daemon, str(p.pid), "--cpus", ALL)
        assert r2["cpus"] == ONE
        assert any(f"dropped: cgroup cpuset /{parent.name} allows {ONE}" in n
                   for n in r2["notes"])
        assert daemon.ctl("unbind", str(p.pid)).rc == 0
        assert snapshot(p.pid) == before


def test_restart_readopts_live_bindings_and_drops_dead_ones(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory().start()
    with thread_child(threads=8) as live, thread_child(threads=8) as dying:
        before = snapshot(live.pid)
        bind_json(d, str(live.pid), "--cpus", ONE, "--nofile", "2048")
        with_mems = (CPUSET_ROOT / "cpuset.cpus").exists()
        bind_json(d, str(dying.pid), "--cpus", ONE, *(["--mems", "0"] if with_mems else []))
        child_cg = CPUSET_ROOT / cpuset_path(dying.pid).lstrip("/")
        d.kill9()  # a crash: the originals must already be on disk
        dying.kill()
        dying.wait()
        d.start()
        assert jobs_pids(d) == [live.pid]
        if with_mems:  # the dead process's child cpuset was cleaned up on start
            assert child_cg.name.startswith("tunerd-")
            wait_for(lambda: not child_cg.exists(), 10, f"{child_cg} to be removed")
        state = json.loads((d.runtime_dir / "state.json").read_text())
        assert list(state["bindings"]) == [str(live.pid)]
        # the re-adopted binding still restores exactly, and exits are still seen
        assert d.ctl("unbind", str(live.pid)).rc == 0
        assert snapshot(live.pid) == before
        bind_json(d, str(live.pid), "--cpus", ONE, "--exclusive")
        d.stop()
        d.start()
        assert jobs_pids(d) == [live.pid]

        def held() -> str:
            return str(d.ctl("--json", "status").json()["services"]["placer"]["exclusive_cpus"])

        assert held() == ONE  # an exclusive bind holds its CPUs again after a restart
        live.kill()
        wait_for(lambda: jobs_pids(d) == [], 10, "the re-adopted job to be dropped")
        assert held() == ""  # ... until its process ends


def test_status_counts_bound_processes(daemon: DaemonProc) -> None:
    with thread_child(threads=2) as p:
        bind_json(daemon, str(p.pid), "--cpus", ONE)
        st = daemon.ctl("--json", "status").json()
        assert st["services"]["jobs"]["bound"] == 1
        assert "jobs: 1 process bound" in daemon.ctl("status").out
        header, row = daemon.ctl("jobs").out.splitlines()
        assert header.split()[:4] == ["PID", "NAME", "RULE", "CPUS"]
        comm = Path(f"/proc/{p.pid}/comm").read_text().strip()
        assert row.split()[:4] == [str(p.pid), comm, "-", ONE]


def test_thread_id_is_refused(daemon: DaemonProc) -> None:
    with thread_child(threads=2) as p:
        tid = max(t for t in task_cpus(p.pid) if t != p.pid)
        r = daemon.ctl("bind", str(tid), "--cpus", ONE)
        assert r.rc == 2 and f"pid {tid} is a thread of process {p.pid}" in r.err
        assert os.path.exists(f"/proc/{p.pid}")


@needs_cpuset_v1
def test_start_sweeps_child_cpusets_of_processes_that_died_unwatched(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    first: DaemonProc = daemon_factory(name="first").start()
    with thread_child(threads=2) as p:
        bind_json(first, str(p.pid), "--mems", "0")
        cdir = CPUSET_ROOT / cpuset_path(p.pid).lstrip("/")
        first.stop()  # bindings outlive the daemon ...
        assert cdir.exists()
    # ... and the process exits while no daemon watches it; a daemon with another
    # state directory (no record of it) still removes the empty child cpuset
    second: DaemonProc = daemon_factory(name="second").start()
    wait_for(lambda: not cdir.exists(), 10, f"{cdir} to be swept")
    assert jobs_pids(second) == []


def test_a_cli_bind_writes_the_state_once(daemon: DaemonProc) -> None:
    """Issue 15: `tunerctl bind` rewrites the runtime state (the whole file, 277 KiB with
    620 bindings) once, before the process is changed, with its originals and its hold;
    no deferred second write follows (that is only for what a bind learns from the
    change itself). A write is a new file renamed over state.json: a new inode."""
    state = daemon.runtime_dir / "state.json"

    def inode() -> int | None:
        return state.stat().st_ino if state.exists() else None

    def settled() -> bool:  # no write for 0.6 s (the last test's exits are saved deferred)
        before = inode()
        time.sleep(0.6)
        return inode() == before

    with thread_child(threads=4) as p:
        wait_for(settled, 10, "the runtime state to settle")
        ino = inode()
        bind_json(daemon, str(p.pid), "--cpus", ONE, "--exclusive")
        written = state.stat().st_ino
        assert written != ino  # saved before the reply, ...
        rec = json.loads(state.read_text())["bindings"][str(p.pid)]
        assert len(rec["originals"]["threads"][ALL]) == 5 and rec["hold"]["exclusive"]
        time.sleep(1.2)  # ... and not again: a deferred save runs 0.5 s after the bind
        assert inode() == written
