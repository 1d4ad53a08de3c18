"""tunerd next to the kubelet: never a write in a kubepods cgroup, binds inside the
container's cpuset, and re-binds within 1 s when the kubelet rewrites that cpuset.

Real cgroup v1 cpusets named as the kubelet names them (tests/kubepods_helpers.py),
real processes in them, a real daemon; inotify on the tree counts every write.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import task_cpus, thread_child
from tests.helpers import wait_for
from tests.kubepods_helpers import TreeWatch, kubepods_tree
from tunerd.adapters.cpuset import CpusetCgroup, KubeletOwned, kubelet_owned

pytestmark = pytest.mark.root


@pytest.mark.parametrize(("path", "owned"), [
    ("/kubepods/burstable/pod0b1e/3f9a", True),  # v1, cgroupfs driver
    ("/kubepods/pod0b1e/3f9a", True),  # v1 Guaranteed
    ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b1e.slice/"
     "cri-containerd-3f9a.scope", True),  # v2, systemd driver
    ("/system.slice/kubelet.service/kubepods/besteffort/pod1/c", True),  # nested root
    ("/slurm/uid_0/job_12/step_0", False),
    ("/user.slice/user-1000.slice/session-2.scope", False),
    ("/", False),
])
def test_kubelet_owned_paths(path: str, owned: bool) -> None:
    assert kubelet_owned(path) is owned
    assert CpusetCgroup(2, Path("/sys/fs/cgroup"), path).can_nest() is (
        False if owned else CpusetCgroup(2, Path("/sys/fs/cgroup"), path).can_nest())


def test_no_cgroup_write_is_possible_under_kubepods(tmp_path: Path) -> None:
    """Even a caller that asks: the write is refused before the file is opened."""
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "cpuset.cpus").write_text("0-1\n")
    cg = CpusetCgroup(1, tmp_path, "/kubepods/pod1")
    for call in (lambda: cg.set(frozenset({0}), frozenset({0})), lambda: cg.attach(1),
                 lambda: cg.child("tunerd-1-2").create(frozenset({0}), frozenset({0}))):
        with pytest.raises(KubeletOwned, match="belongs to the kubelet"):
            call()
    assert (tmp_path / "kubepods" / "pod1" / "cpuset.cpus").read_text() == "0-1\n"
    assert [p.name for p in (tmp_path / "kubepods" / "pod1").iterdir()] == ["cpuset.cpus"]


def test_bind_with_mems_in_a_kubepods_cpuset_writes_nothing_there(daemon: Any) -> None:
    with kubepods_tree(cpus="1") as tree, thread_child(threads=4, cgroup=tree.ctr) as p:
        watch = TreeWatch(tree)
        try:
            r = daemon.ctl("--json", "bind", str(p.pid), "--cpus", "0-1", "--mems", "0")
            assert r.rc == 0, r.out + r.err
            out = r.json()
            notes = " ".join(out["notes"])
            # never outside the container's cpuset.cpus.effective
            assert "CPUs 0 dropped" in notes, notes
            assert set(task_cpus(p.pid).values()) == {"1"}
            # --mems there: not possible from outside, and the reply says why
            assert "is the kubelet's (kubepods)" in notes and "tunerctl run" in notes, notes
            assert watch.events() == []  # 0 writes, 0 mkdirs anywhere in the tree
            assert not [d for d in tree.ctr.iterdir() if d.is_dir()]
            assert Path(f"/proc/{p.pid}/cpuset").read_text().strip() == tree.cgroup_path()
            # outside the container's set entirely: refused, nothing changed
            r = daemon.ctl("bind", str(p.pid), "--cpus", "0")
            assert r.rc == 2 and "outside what process" in r.err, r.out + r.err
            assert daemon.ctl("unbind", str(p.pid)).rc == 0
            assert watch.events() == []
        finally:
            watch.close()


def _masks(pid: int) -> set[str]:
    return set(task_cpus(pid).values())


def _record_cpus(daemon: Any, pid: int) -> str | None:
    for j in daemon.ctl("--json", "jobs").json()["jobs"]:
        if j["pid"] == pid:
            return str(j["cpus"])
    return None


def _old_kernel_reset(pid: int, cpus: set[int]) -> None:
    """What RHEL 8/9 and Ubuntu 20.04/22.04 kernels do on a cpuset grow: every task's
    mask becomes the whole cpuset. Set before the grow (the kernel clamps it to the
    current set and keeps it as the task's request, which the grow then gives back),
    so that the grow's write is the last thing the watcher sees, as on those kernels."""
    for tid in task_cpus(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass


def test_rebind_within_1s_after_kubelet_rewrites_the_cpuset(daemon: Any) -> None:
    """A script acting as the kubelet shrinks the container's cpuset below the binding,
    grows it back (kernel >= 6.2 behaviour: the task's own request comes back; and the
    older behaviour: the whole cpuset), and moves it; the mask is right again each time
    within 1 s (p99), and tunerd writes nothing in the kubepods tree."""
    with kubepods_tree(cpus="0-1") as tree, thread_child(threads=4, cgroup=tree.ctr) as p:
        r = daemon.ctl("bind", str(p.pid), "--cpus", "1")
        assert r.rc == 0, r.out + r.err
        watch = TreeWatch(tree)
        events: list[str] = []
        writes = 0
        lat: list[float] = []

        def kubelet(cpus: str, grow: bool) -> float:
            nonlocal writes
            events.extend(watch.events())  # drained per step: inotify merges repeats
            tree.set_cpus(cpus, grow=grow)
            writes += 3
            return time.monotonic()

        def settled(t0: float, pred: Any, what: str) -> None:
            wait_for(pred, 2.0, what, interval=0.002, detail=daemon.log)
            lat.append(time.monotonic() - t0)

        def watched() -> bool:
            st = daemon.ctl("--json", "status").json()["services"]["cpusetwatch"]
            return tree.cgroup_path() in st["cgroups"]

        try:
            wait_for(watched, 5.0, "the watcher to follow the bound process")
            for i in range(8):
                # shrink below the binding: the kernel leaves it the whole smaller set,
                # and tunerd places it anew inside it
                kubelet("0", grow=False)
                wait_for(lambda: _record_cpus(daemon, p.pid) == "0", 2.0,
                         "re-placed inside cpuset 0", detail=daemon.log)
                assert _masks(p.pid) == {"0"}
                # grow back: the CPUs it was bound to, on either kernel behaviour
                if i % 2:
                    _old_kernel_reset(p.pid, {0, 1})
                t0 = kubelet("0-1", grow=True)
                settled(t0, lambda: _masks(p.pid) == {"1"}, "mask back to CPU 1")
            # move: the container's CPU changes from 1 to 0 (parents widened first,
            # narrowed last: a v1 cpuset may not be wider than its parent)
            kubelet("1", grow=False)
            events.extend(watch.events())
            for d in tree.levels[1:3]:
                (d / "cpuset.cpus").write_text("0-1")
            (tree.ctr / "cpuset.cpus").write_text("0")
            for d in reversed(tree.levels[1:3]):
                (d / "cpuset.cpus").write_text("0")
            writes += 5
            wait_for(lambda: _record_cpus(daemon, p.pid) == "0", 2.0, "moved to CPU 0")
            t0 = kubelet("0-1", grow=True)
            settled(t0, lambda: _masks(p.pid) == {"1"}, "mask back to CPU 1 after the move")
            events.extend(watch.events())
        finally:
            watch.close()
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"re-bind after a cpuset change: median {lat[len(lat) // 2] * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms over {len(lat)} changes")
        assert p99 <= 1.0
        # every write in the tree is the kubelet script's; tunerd made none
        assert all(e.endswith("cpuset.cpus: [<flags.MODIFY: 2>]") for e in events), events
        assert len(events) == writes, events
        assert not [d for d in tree.ctr.iterdir() if d.is_dir()]
        st = daemon.ctl("--json", "status").json()["services"]["cpusetwatch"]
        assert st["rebinds_total"] >= len(lat) and st["inotify"] is True


def test_poll_alone_rebinds_within_1s() -> None:
    """Where cgroupfs gives no inotify events, the 0.25 s poll of the watched cgroups'
    effective CPUs re-binds in time too (the watcher in process, its re-bind call a
    plain sched_setaffinity of every thread)."""
    import asyncio

    from tunerd.base.cpulist import format_cpulist
    from tunerd.jobs.cpusetwatch import CpusetWatch

    with kubepods_tree(cpus="0-1") as tree, thread_child(threads=2, cgroup=tree.ctr) as p:
        st = int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        record = {"pid": p.pid, "start_time": st, "cpus": "1"}

        async def rebind(pid: int, cpus: frozenset[int]) -> dict[str, Any]:
            for tid in task_cpus(pid):
                os.sched_setaffinity(tid, cpus)
            record["cpus"] = format_cpulist(cpus)
            return dict(record)

        async def scenario() -> list[float]:
            w = CpusetWatch(lambda pid: (st, str(record["cpus"])) if pid == p.pid else None,
                            rebind, bound=lambda: [p.pid], inotify=False)
            await w.start()
            try:
                await rebind(p.pid, frozenset({1}))
                await asyncio.sleep(0.3)  # tracked
                lat = []
                for _ in range(3):
                    tree.set_cpus("0", grow=False)
                    await asyncio.sleep(0.6)
                    assert record["cpus"] == "0"
                    tree.set_cpus("0-1", grow=True)
                    t0 = time.monotonic()
                    while _masks(p.pid) != {"1"}:
                        assert time.monotonic() - t0 < 1.0, "not re-bound within 1 s"
                        await asyncio.sleep(0.005)
                    lat.append(time.monotonic() - t0)
                assert w.status()["inotify"] is False
                return lat
            finally:
                await w.stop()

        lat = asyncio.run(scenario())
        assert max(lat) <= 1.0 and len(lat) == 3
