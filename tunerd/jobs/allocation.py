"""What a scheduler gave a process: the CPUs, GPUs and CPU count tunerd must stay inside.

Placement starts from the caller's allocation, never from the whole node: a
Slurm step, a Kubernetes pod with the static CPU manager, or a `tunerctl run`
lease above the process already decided which CPUs and GPUs are the job's.
tunerd only refines where inside them the job's CPUs lie (near its GPUs, whole
cores, away from its siblings); it never takes CPUs or GPUs from outside and
never shrinks what the scheduler granted.

Sources, most trusted first:

- CPUs: the process's cgroup cpuset (the kernel enforces it; Slurm task/cgroup,
  the kubelet's static CPU manager) and its current affinity mask (Slurm
  task/affinity binds each task inside the step's cpuset).
- CPU count: ``SLURM_CPUS_PER_TASK`` (``srun -c``), else the size of the mask the
  scheduler bound the task to.
- GPUs: ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS`` (global indices) inside a Slurm job;
  a job without gres has no GPU at all. ``CUDA_VISIBLE_DEVICES`` narrows them
  (Slurm with ConstrainDevices renumbers it from 0 inside the job's devices).
  In a Kubernetes pod: the devices the kubelet's PodResources ``List`` gives its pod
  (tunerd.jobs.podresources, registered with ``add_gpu_source``).

The environment of a process is its owner's to write: it can only narrow what
the cgroup allows, never widen it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tunerd.adapters.cpuset import CHILD_PREFIX, CpusetCgroup, find_cpuset
from tunerd.adapters.procfs import _read_once
from tunerd.base.cpulist import format_cpulist
from tunerd.base.text import bounded_int
from tunerd.topology.model import Topology
from tunerd.topology.visible import parse_gpu_list, resolve_cvd, visible_gpus

__all__ = ["Allocation", "add_gpu_source", "cvd_names", "read_allocation",
           "scheduler_gpus", "slurm_gpus"]

# Slurm's cgroup paths: /slurm/uid_0/job_12/step_0 (v1), /system.slice/slurmstepd.scope/
# job_12/step_0 (v2), /slurm_NODE/uid_0/job_12/step_batch (multiple-slurmd)
_SLURM_CGROUP = re.compile(
    r"slurm[^/]*/(?:.*/)?job_(\d{1,12})(?:/step_([^/]{1,32}))?(?:/task_(\d{1,6}))?")


@dataclass(frozen=True)
class Allocation:
    """The part of the node a process may use, as its scheduler decided."""

    cpus: frozenset[int] | None = None  # cgroup cpuset; None: not confined
    current: frozenset[int] | None = None  # its affinity mask now, where narrower than that
    mask: frozenset[int] | None = None  # its affinity mask now
    gpus: tuple[int, ...] | None = None  # GPUs it may use; None: not restricted
    ncpus: int | None = None  # CPUs granted per task (SLURM_CPUS_PER_TASK)
    scheduler: str | None = None  # "Slurm job 12 step 0", ... for explanations
    cgroup_dir: str | None = None  # the scheduler's cpuset cgroup directory (job ends: gone)
    slurm_job: str | None = None  # Slurm job id: from the cgroup path where it says
    slurm_step: str | None = None  # step id ("0", "batch", "extern")
    slurm_task: int | None = None  # task id, from a .../task_N cgroup where Slurm makes one
    job_from_cgroup: bool = False  # the Slurm ids come from the cgroup (not the user's env)
    # the scheduler's GPU grant before CUDA_VISIBLE_DEVICES narrows it (scheduler_gpus)
    granted: tuple[int, ...] | None = field(default=None, compare=False)
    # what ``cpus`` is, for messages: the cgroup's "cpuset", or a "CPU mask" (a lease's,
    # a launcher's or the process's own affinity, which narrowed it: intake.request)
    cpus_what: str = field(default="cpuset", compare=False)

    @property
    def confined(self) -> bool:
        return self.cpus is not None or self.gpus is not None or self.ncpus is not None

    @property
    def slurm(self) -> bool:
        return bool(self.scheduler and self.scheduler.startswith("Slurm"))

    def describe(self) -> str:
        parts = []
        if self.cpus is not None:
            parts.append(f"{self.cpus_what} {format_cpulist(self.cpus)}")
        if self.gpus is not None:
            parts.append(f"GPUs {format_cpulist(self.gpus) or 'none'}")
        if self.ncpus is not None:
            parts.append(f"{self.ncpus} CPUs per task")
        where = self.scheduler or "allocation"
        return f"{where} ({', '.join(parts)})" if parts else where


def slurm_gpus(topo: Topology, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The GPUs of the Slurm job/step ``env`` belongs to; None outside Slurm.

    Inside a job without GPU gres the answer is ``()``: its processes have no GPU,
    whatever else is on the node.
    """
    if not env.get("SLURM_JOB_ID"):
        return None
    known = {g.index for g in topo.gpus}
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        text = env.get(var)
        if text is not None:
            ids = parse_gpu_list(text)
            if ids is not None:
                return tuple(i for i in ids if i in known)
    return ()


def cvd_names(topo: Topology, env: Mapping[str, str]) -> dict[int, str]:
    """GPU index -> how the process's own CUDA_VISIBLE_DEVICES names it.

    A lease printed for a job inside Slurm (ConstrainDevices renumbers the job's
    GPUs from 0) must name its GPUs the way the job sees them.
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None or cvd.strip() in ("", "NoDevFiles"):
        return {}
    items = [x.strip() for x in cvd.split(",") if x.strip()]
    job = slurm_gpus(topo, env)
    if job is not None and all(x.isdigit() for x in items):
        ids = resolve_cvd(topo, cvd, job)
        if len(ids) == len(items):
            return dict(zip(ids, items, strict=True))
        return {}
    out: dict[int, str] = {}
    for item in items:
        hit = visible_gpus(topo, item)
        if len(hit) == 1:
            out[hit[0]] = item
    return out


def read_allocation(pid: int, env: Mapping[str, str] | None, topo: Topology, *,
                    proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
                    online: frozenset[int] | None = None, quick: bool = False) -> Allocation:
    """The allocation process ``pid`` lives in (its cgroup, mask and environment).

    A process that tunerd itself moved into a child cpuset counts from the
    cpuset it was in before (the scheduler's). ``online``: this machine's online CPUs
    when the caller knows them (saves two reads on the bind path). ``quick``: the
    cgroup's cpuset as read for another process of it within CPUSET_TTL_S will do (a
    rule's bind in the exec watcher).
    """
    env = env or {}
    host_online = online if online is not None else _host_online(sys_root)
    cpus: frozenset[int] | None = None
    cg, eff, cg_text, cg_dir = _cpuset_of(pid, proc_root, sys_root,
                                          CPUSET_TTL_S if quick else 0.0)
    if cg is not None:
        here = topo.online_cpus() if not topo.replayed else host_online
        if eff and eff != here:
            cpus = eff
    current: frozenset[int] | None = None
    try:
        mask = frozenset(os.sched_getaffinity(pid))
    except OSError:
        mask = frozenset()
    if mask and mask != (cpus if cpus is not None else host_online):
        current = mask
    gpus = slurm_gpus(topo, env)
    # a pod's cgroup path names kubepods: no need to ask the pod source otherwise
    in_pod = cg_text is None or "kubepods" in cg_text
    pod = _pod_gpus(pid, topo) if gpus is None and in_pod else None
    if pod is not None:
        gpus = pod[0]
    granted = gpus
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None and cvd is not None and cvd.strip() not in ("", "NoDevFiles"):
        gpus = resolve_cvd(topo, cvd, gpus)
    ncpus: int | None = None
    per_task = bounded_int(env.get("SLURM_CPUS_PER_TASK"), 1, 1 << 20)
    if env.get("SLURM_JOB_ID") and per_task is not None:
        ncpus = per_task
    scheduler = None
    m = _SLURM_CGROUP.search(cg.path) if cg is not None else None
    job, step, task = _slurm_ids(env, m)
    if job is not None:
        scheduler = f"Slurm job {job}" + (f" step {step}" if step else "")
    elif pod is not None:
        scheduler = pod[1]
    elif env.get("KUBERNETES_SERVICE_HOST") or (cg is not None and "kubepods" in cg.path):
        scheduler = "Kubernetes pod"
    elif cpus is not None:
        scheduler = f"cgroup {cg.path if cg else '?'}"
    return Allocation(cpus=cpus, current=current, mask=mask or None, gpus=gpus, ncpus=ncpus,
                      scheduler=scheduler, cgroup_dir=cg_dir,
                      slurm_job=job, slurm_step=step, slurm_task=task,
                      job_from_cgroup=m is not None, granted=granted)


def _slurm_ids(env: Mapping[str, str],
               m: re.Match[str] | None) -> tuple[str | None, str | None, int | None]:
    """(job, step, task) ids: from the cgroup path Slurm made where there is one (the
    environment is the job owner's to write), else from SLURM_JOB_ID / SLURM_STEP_ID /
    SLURM_LOCALID (bounded: an id longer than 12 digits is no id)."""
    if m is not None:
        return m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None
    job = env.get("SLURM_JOB_ID", "").strip()
    if not (job.isdigit() and len(job) <= 12):
        return None, None, None
    step = env.get("SLURM_STEP_ID", "").strip()
    task = env.get("SLURM_LOCALID", "").strip()
    return (job, step if step and len(step) <= 32 else None,
            int(task) if task.isdigit() and len(task) <= 6 else None)


# One more source of GPUs, registered by the daemon: the kubelet's PodResources
# (tunerd.jobs.podresources). pid, topology -> (the pod's GPUs, "Kubernetes pod ns/name").
GpuSource = Callable[[int, Topology], "tuple[tuple[int, ...], str] | None"]
_gpu_sources: list[GpuSource] = []


def add_gpu_source(source: GpuSource) -> None:
    _gpu_sources.append(source)


def scheduler_gpus(pid: int, topo: Topology, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The GPUs the scheduler gave ``pid``: Slurm's, else its pod's; None: not restricted."""
    gpus = slurm_gpus(topo, env)
    if gpus is None:
        pod = _pod_gpus(pid, topo)
        gpus = pod[0] if pod is not None else None
    return gpus


def _pod_gpus(pid: int, topo: Topology) -> tuple[tuple[int, ...], str] | None:
    for source in _gpu_sources:
        got = source(pid, topo)
        if got is not None:
            return got
    return None


# /proc/PID/cgroup text -> (when, the scheduler's cpuset, its effective CPUs), for a
# short while: the ranks of one job (and the bursts of one launcher) live in one cgroup,
# whose cpuset files are then read once, not per exec. The kernel still confines a mask
# to the cgroup as it is, should a scheduler change it within CPUSET_TTL_S.
CPUSET_TTL_S = 1.0
_cpusets: dict[tuple[str, str, bytes],
               tuple[float, CpusetCgroup | None, frozenset[int], str | None, str | None]] = {}
_cpusets_lock = threading.Lock()


def _cpuset_of(pid: int, proc_root: Path, sys_root: Path, ttl: float
               ) -> tuple[CpusetCgroup | None, frozenset[int], str | None, str | None]:
    """The scheduler's cpuset of ``pid``, its effective CPUs (empty: unreadable) and its
    directory, from the cache where read less than ``ttl`` seconds ago; and
    /proc/PID/cgroup's text where read (``ttl`` > 0: one open and one read, keyed by the
    bytes as read)."""
    if ttl <= 0:
        cg = _scheduler_cpuset(pid, proc_root, sys_root)
        cg_dir = str(cg.dir) if cg is not None else None
        try:
            return cg, cg.effective_cpus() if cg is not None else frozenset(), None, cg_dir
        except OSError:
            return cg, frozenset(), None, cg_dir
    proc_s, sys_s = str(proc_root), str(sys_root)
    try:
        raw = _read_once(f"{proc_s}/{pid}/cgroup", 8192)
    except OSError:
        return None, frozenset(), None, None
    key = (proc_s, sys_s, raw)
    now = time.monotonic()
    hit = _cpusets.get(key)
    if hit is not None and now - hit[0] < ttl:
        return hit[1], hit[2], hit[3], hit[4]
    text = raw.decode(errors="replace")
    cg = _scheduler_cpuset(pid, proc_root, sys_root)
    try:
        eff = cg.effective_cpus() if cg is not None else frozenset()
    except OSError:
        eff = frozenset()
    cg_dir = str(cg.dir) if cg is not None else None
    with _cpusets_lock:
        if len(_cpusets) > 256:
            _cpusets.clear()
        _cpusets[key] = (now, cg, eff, text, cg_dir)
    return cg, eff, text, cg_dir


def _scheduler_cpuset(pid: int, proc_root: Path, sys_root: Path) -> CpusetCgroup | None:
    try:
        cg = find_cpuset(pid, proc_root, sys_root)
    except OSError:
        return None
    if cg is None:
        return None
    parts = cg.path.rstrip("/").split("/")
    if parts and parts[-1].startswith(CHILD_PREFIX):  # our own child: the parent counts
        return CpusetCgroup(cg.version, cg.mount, "/".join(parts[:-1]) or "/")
    return cg


def _host_online(sys_root: Path) -> frozenset[int]:
    from tunerd.adapters.cpuset import read_ids

    try:
        return read_ids(sys_root / "devices" / "system" / "cpu" / "online")
    except OSError:
        return frozenset(os.sched_getaffinity(0))
