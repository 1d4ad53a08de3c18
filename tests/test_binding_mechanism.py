"""Binder on real processes, without the daemon: rollback, identity, migrate_pages."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.binding_helpers import CPUSET_ROOT, scratch_cpuset, snapshot, task_cpus, thread_child
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errors import Failed, NoSuchProcess
from tunerd.jobs.actuate import Binder
from tunerd.jobs.binding import Originals

pytestmark = pytest.mark.root

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
ONE = frozenset({max(ONLINE)})


def test_a_failing_step_rolls_back_the_earlier_ones() -> None:
    b = Binder()
    with thread_child(threads=32) as p:
        before = snapshot(p.pid)
        t = b.pin(p.pid)
        plan = b.prepare(t, cpus=ONE, nofile=2048)
        plan.cpus = frozenset({4000})  # no such CPU: sched_setaffinity fails with EINVAL
        with pytest.raises(Failed, match=f"sched_setaffinity\\(thread \\d+ of pid {p.pid}"):
            b.apply(plan)
        assert snapshot(p.pid) == before  # nofile put back too
        t.close()


@pytest.mark.skipif(not (CPUSET_ROOT / "cpuset.cpus").exists(), reason="needs cgroup v1")
def test_rollback_leaves_the_cgroup_as_it_was() -> None:
    b = Binder()
    with thread_child(threads=8) as p:
        before = snapshot(p.pid)
        t = b.pin(p.pid)
        plan = b.prepare(t, cpus=ONE, mems=frozenset({0}))
        assert plan.cpuset is not None
        child_dir = plan.cpuset.dir
        plan.cpus = frozenset({4000})
        with pytest.raises(Failed):
            b.apply(plan)
        assert not child_dir.exists()
        assert snapshot(p.pid) == before
        t.close()


@pytest.mark.skipif(not (CPUSET_ROOT / "cpuset.cpus").exists(), reason="needs cgroup v1")
def test_a_memory_node_step_left_out_leaves_no_child_cpuset_in_the_originals() -> None:
    """Partial bind whose child cpuset write fails right after its mkdir: the directory
    is removed, the originals no longer name it, and a later plain re-bind and the
    restore work from those originals."""
    b = Binder()
    with scratch_cpuset(format_cpulist(ONLINE)) as parent, \
            thread_child(threads=8, cgroup=parent) as p:
        base = snapshot(p.pid)["cpuset"]
        t = b.pin(p.pid)
        plan = b.prepare(t, cpus=ONE, mems=frozenset({0}), partial=True)
        assert plan.cpuset is not None and plan.originals.cpuset_child is not None
        child_dir = plan.cpuset.dir
        plan.cpuset_cpus = frozenset({4000})  # no such CPU: the cpuset.cpus write fails
        r = b.apply(plan)
        assert r.cpus == ONE and r.mems is None
        assert any(n.startswith("memory nodes 0 not set") for n in r.notes), r.notes
        assert not child_dir.exists()  # the mkdir was undone too
        assert snapshot(p.pid)["cpuset"] == base
        assert set(task_cpus(p.pid).values()) == {format_cpulist(ONE)}
        orig = plan.originals
        assert orig.cpuset_child is None and orig.cpuset_base is None
        # a plain re-bind from the saved originals does not look for the removed cpuset
        again = b.prepare(t, cpus=ONE, previous=Originals.from_json(orig.to_json()))
        assert again.cpuset is None
        b.apply(again)
        summary = b.restore(t, orig)
        assert summary["notes"] == []  # no cpuset to move back from, no note about pages
        t.close()


def test_an_exited_target_is_never_touched() -> None:
    b = Binder()
    with thread_child(threads=2) as p:
        t = b.pin(p.pid)
        plan = b.prepare(t, cpus=ONE)
        p.kill()
        p.wait()  # reaped: the PID may now be reused by anyone
    with pytest.raises(NoSuchProcess, match=f"process {p.pid} exited while being bound"):
        b.apply(plan)
    with pytest.raises(NoSuchProcess, match=str(p.pid)):
        b.check(t)
    t.close()


def test_adopt_refuses_a_different_start_time() -> None:
    b = Binder()
    with thread_child(threads=1) as p:
        t = b.pin(p.pid)
        assert b.adopt(p.pid, t.start_time - 1) is None
        again = b.adopt(p.pid, t.start_time)
        assert again is not None and again.start_time == t.start_time
        again.close()
        t.close()


def test_migrate_pages_fallback_without_cpusets(tmp_path: Path) -> None:
    """No cpuset hierarchy: pages move with migrate_pages(2) and the reply says
    new allocations are not confined (a sys tree without fs/cgroup stands in)."""
    sys = tmp_path / "sys"
    (sys / "devices/system/cpu").mkdir(parents=True)
    shutil.copy("/sys/devices/system/cpu/online", sys / "devices/system/cpu/online")
    (sys / "devices/system/node").mkdir(parents=True)
    (sys / "devices/system/node/online").write_text("0-1\n")  # pretend node 1 exists
    b = Binder("/proc", sys)
    with thread_child(threads=4) as p:
        before = task_cpus(p.pid)
        t = b.pin(p.pid)
        plan = b.prepare(t, mems=frozenset({0}))
        assert plan.cpuset is None and plan.migrate_from == frozenset({1})
        r = b.apply(plan)  # the real syscall: node 1 holds nothing, so 0 pages move
        assert r.pages_moved == 0
        assert any("new allocations not confined to nodes 0" in n for n in r.notes)
        assert task_cpus(p.pid) == before
        assert Path(f"/proc/{p.pid}/cpuset").read_text().strip() == snapshot(p.pid)["cpuset"]
        t.close()


def test_restore_only_touches_what_bind_changed() -> None:
    b = Binder()
    with thread_child(threads=4) as p:
        t = b.pin(p.pid)
        plan = b.prepare(t, nofile=3000)
        b.apply(plan)
        # the process changes its own masks after a limits-only bind ...
        for tid in task_cpus(p.pid):
            os.sched_setaffinity(tid, ONE)
        b.restore(t, plan.originals)
        # ... and unbind leaves them alone
        assert set(task_cpus(p.pid).values()) == {format_cpulist(ONE)}
        assert snapshot(p.pid)["nofile"][0] == 1024
        t.close()


def test_after_main_runs_once_the_main_thread_has_its_cpus_and_the_others_follow() -> None:
    """Plan.after_main (the exec watcher lowers its priority there): called once, when
    the main thread's mask is set already; every thread is bound all the same."""
    b = Binder()
    with thread_child(threads=8) as p:
        t = b.pin(p.pid)
        plan = b.prepare(t, cpus=ONE)
        at_call: list[dict[int, str]] = []
        plan.after_main = lambda: at_call.append(task_cpus(p.pid))
        b.apply(plan)
        assert len(at_call) == 1
        assert at_call[0][p.pid] == format_cpulist(ONE)
        assert set(task_cpus(p.pid).values()) == {format_cpulist(ONE)}
        t.close()
