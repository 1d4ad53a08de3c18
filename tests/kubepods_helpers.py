"""A real cgroup v1 cpuset tree named as the kubelet names it, and a kubelet stand-in.

``kubepods_tree()`` makes ``/sys/fs/cgroup/cpuset/kubepods/burstable/pod<uid>/<ctr>``
(real cpusets: the kernel enforces them and narrows or resets the masks of the tasks
in them when they change), and removes it afterwards. ``Kubelet`` rewrites a
container's cpuset the way the static CPU manager does: the container level, then its
pod (shrink), or the pod first (grow).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inotify_simple import INotify, flags

from tests.binding_helpers import CPUSET_ROOT, _rmdir
from tests.helpers import wait_for


@dataclass
class KubepodsTree:
    root: Path  # .../kubepods
    pod: Path  # .../kubepods/burstable/pod<uid>
    ctr: Path  # .../pod<uid>/<container id>

    @property
    def levels(self) -> list[Path]:
        return [self.root, self.root / "burstable", self.pod, self.ctr]

    def set_cpus(self, cpus: str, *, grow: bool) -> None:
        """What the kubelet writes for a new exclusive set: parents first when the set
        grows, the container first when it shrinks (a parent may not be narrower)."""
        order = self.levels[1:] if grow else list(reversed(self.levels[1:]))
        for d in order:
            (d / "cpuset.cpus").write_text(cpus)

    def cgroup_path(self) -> str:
        return "/" + str(self.ctr.relative_to(CPUSET_ROOT))


@contextlib.contextmanager
def kubepods_tree(cpus: str = "0-1", mems: str = "0") -> Iterator[KubepodsTree]:
    import pytest

    root = CPUSET_ROOT / "kubepods"
    if not (CPUSET_ROOT / "cpuset.cpus").exists():
        pytest.skip("no cgroup v1 cpuset hierarchy at /sys/fs/cgroup/cpuset")
    if root.exists():
        pytest.skip(f"{root} exists (a real kubelet, or a test run that left it)")
    pod = root / "burstable" / f"pod{uuid.uuid4()}"
    ctr = pod / (uuid.uuid4().hex + uuid.uuid4().hex)  # a 64-hex container id
    made: list[Path] = []
    try:
        for d in (root, root / "burstable", pod, ctr):
            d.mkdir()
            made.append(d)
            (d / "cpuset.cpus").write_text(cpus)
            (d / "cpuset.mems").write_text(mems)
        yield KubepodsTree(root, pod, ctr)
    finally:
        for d in reversed(made):
            for sub in d.iterdir():  # a child cpuset tunerd must never have made
                if sub.is_dir():
                    with contextlib.suppress(OSError):
                        sub.rmdir()
            wait_for(lambda d=d: _rmdir(d), 5.0, f"rmdir {d}")


class TreeWatch:
    """Every write and mkdir in the tree, as inotify reports it (IN_MODIFY, IN_CREATE)."""

    def __init__(self, tree: KubepodsTree) -> None:
        self.ino = INotify()
        self.dirs = {self.ino.add_watch(str(d), flags.MODIFY | flags.CREATE | flags.ATTRIB): d
                     for d in tree.levels}

    def events(self) -> list[str]:
        return [f"{self.dirs[e.wd]}/{e.name}: {flags.from_mask(e.mask)}"
                for e in self.ino.read(timeout=0)]

    def close(self) -> None:
        self.ino.close()
