"""tunerd next to the kubelet: never a write in a kubepods cgroup, binds inside the
container's cpuset, and re-binds within 1 s when the kubelet rewrites that cpuset.

Real cgroup v1 cpusets named as the kubelet names them (tests/kubepods_helpers.py),
real processes in them, a real daemon; inotify on the tree counts every write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import task_cpus, thread_child
from tests.kubepods_helpers import TreeWatch, kubepods_tree
from tunerd.cpuset import CpusetCgroup, KubeletOwned, kubelet_owned

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
