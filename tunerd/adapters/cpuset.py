"""Cgroup cpusets: which CPUs and memory nodes a process may use, and child cpusets.

Slurm (task/cgroup), Kubernetes (the static CPU manager) and LSF confine jobs with
a cgroup cpuset; a binding must stay inside it, so the allowed CPUs are read from
the process's own cpuset cgroup:

- cgroup v1: ``/proc/PID/cgroup`` line ``N:cpuset:/path`` (or a combined
  ``cpu,cpuset`` hierarchy); files ``cpuset.effective_cpus`` / ``cpuset.effective_mems``
  (``cpuset.cpus``/``cpuset.mems`` on kernels before 4.x) under the v1 mount.
- cgroup v2: line ``0::/path``; ``cpuset.cpus.effective`` / ``cpuset.mems.effective``
  exist only where the cpuset controller is enabled, so the walk goes up to the
  nearest cgroup that has them.

There is no system call that sets *another* process's memory policy, so memory-node
confinement of a running process is done the way numad and LSF do it: a child
cpuset (v1 ``cpuset.memory_migrate=1``; v2 always migrates) nested under the
process's current cpuset cgroup, so the scheduler's hierarchy and accounting stay
intact. See Documentation/admin-guide/cgroup-v1/cpusets.rst ("memory_migrate") and
cgroup-v2.rst ("cpuset.mems").

Except under the kubelet: a cgroup anywhere below ``kubepods*`` (v1
``/kubepods/burstable/pod<uid>/<ctr>``, v2 ``/kubepods.slice/...``) is the kubelet's,
and tunerd creates no child and writes no file there. A child cpuset makes the
kubelet's own cpuset updates fail with EBUSY (kubernetes #66614, runc #1635), and a
leftover one made it retry the deletion every second (kubernetes #112151). There a
process's memory nodes are set by the process itself (``tunerctl run --mems``, the
``tunerd.torch`` helpers with set_mempolicy), and a bind says so.
"""

from __future__ import annotations

import errno
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from tunerd.adapters.procfs import read_text
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.jsontypes import JSONObject

__all__ = ["CHILD_PREFIX", "CpusetCgroup", "KubeletOwned", "child_name", "find_cpuset",
           "kubelet_owned", "read_ids", "tunerd_children"]

CHILD_PREFIX = "tunerd-"

# v1 mount points a cpuset hierarchy is found at (relative to SYS/fs/cgroup)
_V1_DIRS = ("cpuset", "cpu,cpuset", "cpuset,cpu")


class KubeletOwned(PermissionError):
    """A write tunerd refuses: the cgroup is under ``kubepods*`` (the kubelet's)."""


def kubelet_owned(path: str) -> bool:
    """Whether a cgroup path (as /proc/PID/cgroup prints it) is at or under ``kubepods*``:
    v1 ``/kubepods/...``, v2 with the systemd driver ``/kubepods.slice/...``, with the
    cgroupfs driver ``/kubepods/...`` (and a nested ``.../kubepods/...`` of a node
    whose kubelet runs under another cgroup root)."""
    return any(part.startswith("kubepods") for part in path.split("/"))


def read_ids(path: Path) -> frozenset[int]:
    """A cpulist file (cpuset.cpus, .../online); raises OSError (procfs.read_text)."""
    return parse_cpulist(read_text(path))


@dataclass(frozen=True)
class CpusetCgroup:
    """The cpuset cgroup a process is in: hierarchy version, mount and path in it."""

    version: int  # 1 or 2
    mount: Path  # root directory of the hierarchy (under SYS/fs/cgroup)
    path: str  # "/slurm/uid_0/job_12/step_0" as /proc/PID/cgroup prints it

    @property
    def dir(self) -> Path:
        return self.mount / self.path.lstrip("/")

    @property
    def kubelet_owned(self) -> bool:
        """Under ``kubepods*``: no child cgroup and no cgroup write, ever."""
        return kubelet_owned(self.path)

    def _file(self, v1: str, v1_old: str, v2: str) -> Path:
        if self.version == 1:
            p = self.dir / v1
            return p if p.exists() else self.dir / v1_old
        # v2: the files exist only where the controller is enabled; walk up.
        d = self.dir
        while True:
            p = d / v2
            if p.exists() or d == self.mount or d == d.parent:
                return p
            d = d.parent

    def effective_cpus_file(self) -> Path:
        """The file :meth:`effective_cpus` reads (where the hierarchy has it)."""
        return self._file("cpuset.effective_cpus", "cpuset.cpus", "cpuset.cpus.effective")

    def effective_cpus(self) -> frozenset[int]:
        return read_ids(self.effective_cpus_file())

    def effective_mems(self) -> frozenset[int]:
        return read_ids(self._file("cpuset.effective_mems", "cpuset.mems",
                                   "cpuset.mems.effective"))

    def can_nest(self) -> bool:
        """Whether a child cpuset can be created under this cgroup.

        v1: always. v2: only where ``cpuset`` is in this cgroup's
        cgroup.subtree_control — otherwise enabling it would need this cgroup to
        hold no processes ("no internal processes" rule), which a job's cgroup does.
        Never under ``kubepods*`` (the kubelet's).
        """
        if self.kubelet_owned:
            return False
        if self.version == 1:
            return (self.dir / "cpuset.cpus").exists()
        try:
            ctl = read_text(self.dir / "cgroup.subtree_control").split()
        except OSError:
            return False
        return "cpuset" in ctl

    def child(self, name: str) -> CpusetCgroup:
        return CpusetCgroup(self.version, self.mount, f"{self.path.rstrip('/')}/{name}")

    # -- writes (child cpusets only) ------------------------------------------
    def create(self, cpus: frozenset[int], mems: frozenset[int]) -> None:
        """mkdir this (child) cgroup and give it cpus/mems; an existing one is reused."""
        self._refuse_kubelet("create a child cgroup")
        try:
            self.dir.mkdir()
        except FileExistsError:
            pass
        self.set(cpus, mems)
        if self.version == 1:
            # move already-touched pages when a task is attached or mems change
            self._write("cpuset.memory_migrate", "1")

    def set(self, cpus: frozenset[int], mems: frozenset[int]) -> None:
        self._write("cpuset.cpus", format_cpulist(cpus))
        self._write("cpuset.mems", format_cpulist(mems))

    def cpus_mems(self) -> tuple[frozenset[int], frozenset[int]]:
        return read_ids(self.dir / "cpuset.cpus"), read_ids(self.dir / "cpuset.mems")

    def attach(self, pid: int) -> None:
        """Move every thread of process ``pid`` into this cgroup (cgroup.procs)."""
        self._write("cgroup.procs", str(pid))

    def remove(self) -> bool:
        """rmdir; False if it is still in use (EBUSY), True if gone."""
        try:
            self.dir.rmdir()
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise
        return True

    def _refuse_kubelet(self, what: str) -> None:
        if self.kubelet_owned:
            raise KubeletOwned(f"refusing to {what} in {self.dir}: cgroup {self.path} belongs "
                               f"to the kubelet (kubepods)")

    def _write(self, name: str, value: str) -> None:
        path = self.dir / name
        self._refuse_kubelet(f"write {value!r} to {name}")
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        except OSError as err:
            raise OSError(err.errno, f"writing {value!r} to {path}: {err.strerror}") from err
        finally:
            os.close(fd)

    def to_json(self) -> JSONObject:
        return {"version": self.version, "mount": str(self.mount), "path": self.path}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> CpusetCgroup:
        return cls(int(str(d["version"])), Path(str(d["mount"])), str(d["path"]))


def child_name(pid: int, start_time: int) -> str:
    """Name of the child cpuset made for one process: pid and start time identify it."""
    return f"{CHILD_PREFIX}{pid}-{start_time}"


def tunerd_children(sys_root: Path = Path("/sys")) -> list[tuple[Path, int, int]]:
    """Every child cpuset tunerd made, anywhere in the cpuset hierarchies: (dir, pid, start).

    Used to sweep the ones left behind by processes that exited while no daemon was
    running to remove them.
    """
    roots = [sys_root / "fs" / "cgroup" / n for n in _V1_DIRS]
    v2 = v2_mount(sys_root)
    if v2 is not None:
        roots.append(v2)
    found: list[tuple[Path, int, int]] = []
    stack = [r for r in roots if (r / "cgroup.procs").exists()]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                continue
            if e.name.startswith(CHILD_PREFIX):
                pid_s, _, st_s = e.name[len(CHILD_PREFIX):].partition("-")
                if pid_s.isdigit() and st_s.isdigit():
                    found.append((Path(e.path), int(pid_s), int(st_s)))
                    continue
            stack.append(Path(e.path))
    return found


def v2_mount(sys_root: Path) -> Path | None:
    """The unified hierarchy: SYS/fs/cgroup (pure v2) or SYS/fs/cgroup/unified (hybrid)."""
    base = sys_root / "fs" / "cgroup"
    for d in (base, base / "unified"):
        if (d / "cgroup.controllers").exists():
            return d
    return None


@functools.lru_cache(maxsize=8)
def _v1_mount(base: str) -> Path | None:
    """Where the v1 cpuset hierarchy is mounted (looked up once: on every bind's path)."""
    for name in _V1_DIRS:
        mount = Path(base) / name
        if (mount / "cpuset.cpus").exists():
            return mount
    return None


def find_cpuset(pid: int, proc_root: Path = Path("/proc"),
                sys_root: Path = Path("/sys")) -> CpusetCgroup | None:
    """The cpuset cgroup of ``pid``, or None where no cpuset controller is mounted.

    Raises FileNotFoundError / ProcessLookupError if the process is gone.
    """
    lines = read_text(proc_root / str(pid) / "cgroup").splitlines()
    base = sys_root / "fs" / "cgroup"
    unified: str | None = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            unified = path
            continue
        if "cpuset" in controllers.split(","):
            mount = _v1_mount(str(base))
            if mount is None:
                return None  # a v1 cpuset hierarchy the daemon cannot see
            cg = CpusetCgroup(1, mount, path)
            # not in this mount's view (another cgroup namespace): unknown
            return cg if cg.dir.is_dir() else None
    if unified is not None:
        v2 = v2_mount(sys_root)
        if v2 is not None:
            ctrls = read_text(v2 / "cgroup.controllers").split()
            if "cpuset" in ctrls:
                cg = CpusetCgroup(2, v2, unified)
                return cg if cg.dir.is_dir() else None
    return None
