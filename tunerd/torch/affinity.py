"""The CPUs of a rank, DataLoader worker pinning, and surviving the ways a binding is lost.

A rank's CPUs are its affinity mask. Whether other ranks of the node share them is
told by its launcher: torchrun (or ``tunerctl run``) holds the job's CPUs; a rank
that tunerd (or gpu_affinity, or Slurm) bound on its own has a strict subset of its
launcher's CPUs, while ranks that were not bound apart have the same set and share
it ``LOCAL_WORLD_SIZE`` ways.

Worker pinning gives each DataLoader worker one CPU of the rank's set, workers from
the end of the set and the rank's main process unpinned inside the whole set (the
scheduler keeps it off the busy worker CPUs). Ranks that share a set take
different workers' CPUs by their local rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tunerd.adapters.procfs import Process
from tunerd.base.errors import TunerdError
from tunerd.diagnose.training_env import Finding, check_environment, uses_intel_openmp
from tunerd.torch.settings import log, record, warn_once

__all__ = [
    "Allocation",
    "WorkerPinner",
    "allocation",
    "check_process",
    "keep_affinity",
    "make_worker_init_fn",
    "worker_init_fn",
]


@dataclass(frozen=True)
class Allocation:
    """The CPUs this rank may use and how many ranks of the node share them."""

    cpus: tuple[int, ...]
    ranks_sharing: int = 1
    slot: int = 0  # this rank's index among the ranks that share the set
    reason: str = ""

    @property
    def share(self) -> float:
        """CPUs per rank."""
        return len(self.cpus) / max(1, self.ranks_sharing)


def _status(pid: int) -> dict[str, str] | None:
    """/proc/PID/status, or None if the process is gone or unreadable."""
    try:
        return Process(pid).status()
    except TunerdError:
        return None


def _cpus_in(status: dict[str, str] | None) -> frozenset[int] | None:
    """The Cpus_allowed_list of a status, or None if missing or unreadable."""
    from tunerd.base.cpulist import CpuListError, parse_cpulist

    text = status.get("Cpus_allowed_list") if status else None
    try:
        return parse_cpulist(text) if text else None
    except CpuListError:
        return None


def cpus_of(pid: int) -> frozenset[int] | None:
    """The CPUs process ``pid`` may run on (its main thread), or None if unreadable."""
    return _cpus_in(_status(pid))


def _env_int(env: Any, name: str) -> int | None:
    v = str(env.get(name, "")).strip()
    return int(v) if v.isdigit() else None


def allocation(cpus: Iterable[int] | None = None, *, local_world_size: int | None = None,
               local_rank: int | None = None, launcher_cpus: Iterable[int] | None = None,
               env: Any = None) -> Allocation:
    """This rank's CPUs (default: its affinity) and the ranks sharing them.

    ``local_world_size``/``local_rank`` default to LOCAL_WORLD_SIZE/LOCAL_RANK;
    ``launcher_cpus`` to the parent process's CPUs.
    """
    env = os.environ if env is None else env
    mine = tuple(sorted(os.sched_getaffinity(0) if cpus is None else set(cpus)))
    lws = local_world_size if local_world_size is not None else _env_int(env,
                                                                         "LOCAL_WORLD_SIZE")
    rank = local_rank if local_rank is not None else _env_int(env, "LOCAL_RANK")
    n = len(mine)
    if not lws or lws <= 1:
        return Allocation(mine, 1, 0, f"{n} CPU(s), one rank")
    launcher = cpus_of(os.getppid()) if launcher_cpus is None else frozenset(launcher_cpus)
    if launcher is not None and set(mine) < launcher:
        return Allocation(mine, 1, 0, f"{n} CPU(s) of its own (rank bound apart from the "
                                      f"{len(launcher)} CPU(s) of its launcher)")
    share = lws
    return Allocation(mine, share, (rank or 0) % share,
                      f"{n} CPU(s) shared by the node's {lws} ranks")


# -- surviving a lost binding ---------------------------------------------------------

@contextlib.contextmanager
def keep_affinity() -> Iterator[None]:
    """Put the CPU mask back if the body changed it: ``import torch`` inside it.

    With KMP_AFFINITY/OMP_PROC_BIND set, the OpenMP runtime pins the main thread to one
    CPU while torch loads (pytorch#91989); every DataLoader worker then inherits it.
    """
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        try:
            after = os.sched_getaffinity(0)
            if after != before:
                os.sched_setaffinity(0, before)
                log.warning("tunerd.torch: CPUs %s -> %s during the import; put back %s "
                            "(KMP_AFFINITY/OMP_PROC_BIND, pytorch#91989)",
                            _fmt(before), _fmt(after), _fmt(before))
        except OSError as err:
            warn_once("keep_affinity", "tunerd.torch: cannot restore the CPU mask: %s", err)


def _fmt(cpus: Iterable[int]) -> str:
    from tunerd.base.cpulist import format_cpulist

    return format_cpulist(cpus)


def _maps() -> str:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


_checked = False


def check_process(force: bool = False) -> list[Finding]:
    """Look for the known ways this process's binding is silently lost, warn once about
    each, and repair what can be repaired here:

    - more intra-op threads than CPUs (pytorch#82219): torch's thread count is lowered
      to the CPUs this process has;
    - the mask shrunk to one CPU by KMP_AFFINITY/OMP_PROC_BIND (pytorch#91989): put
      back to the lease's CPUs when ``tunerctl run`` started the job (TUNERD_CPUS);
      otherwise the warning names the fix (``keep_affinity()`` around the import).
    """
    global _checked
    if _checked and not force:
        return []
    _checked = True
    mask = os.sched_getaffinity(0)
    torch = sys.modules.get("torch")
    intel = uses_intel_openmp(_maps()) if torch is not None else None
    findings = check_environment(os.environ, len(mask), torch=True, intel_openmp=intel)
    for f in findings:
        warn_once(f"finding:{f.id}", "tunerd.torch: %s. %s Fix: %s (%s)", f.title, f.why,
                  f.fix, ", ".join(f.docs))
    ids = {f.id for f in findings}
    if torch is not None and "omp-threads-oversubscribe" in ids:
        try:
            if torch.get_num_threads() > len(mask):
                old = torch.get_num_threads()
                torch.set_num_threads(len(mask))
                log.warning("tunerd.torch: torch intra-op threads %d -> %d (the CPUs of this "
                            "process)", old, len(mask))
        except Exception as err:
            warn_once("set_num_threads", "tunerd.torch: cannot lower torch threads: %r", err)
    if "omp-binding-shrinks-mask" in ids and len(mask) == 1:
        _restore_lease_cpus(mask)
    return findings


def _restore_lease_cpus(mask: set[int]) -> None:
    from tunerd.base.cpulist import CpuListError, parse_cpulist

    try:
        lease = parse_cpulist(os.environ.get("TUNERD_CPUS", ""))
    except CpuListError:
        return
    if len(lease) > len(mask) and mask <= lease:
        try:
            os.sched_setaffinity(0, lease)
            log.warning("tunerd.torch: CPU mask %s put back to the lease's CPUs %s "
                        "(pytorch#91989)", _fmt(mask), _fmt(lease))
        except OSError as err:
            warn_once("restore-lease", "tunerd.torch: cannot restore CPUs %s: %s",
                      _fmt(lease), err)


# -- DataLoader worker pinning ----------------------------------------------------------

class WorkerPinner:
    """A DataLoader ``worker_init_fn`` that pins worker k to one CPU of ``cpus``.

    A plain class (not a closure) so that it pickles for the spawn start method. The
    user's own function, if any, runs after the pinning, so it may change the mask
    again and its OpenMP calls no longer reset ours.
    """

    def __init__(self, cpus: Iterable[int], num_workers: int, slot: int = 0,
                 ranks_sharing: int = 1, user_fn: Callable[[int], Any] | None = None) -> None:
        self.cpus = tuple(sorted(cpus))
        self.num_workers = max(1, int(num_workers))
        self.slot = int(slot)
        self.ranks_sharing = max(1, int(ranks_sharing))
        self.user_fn = user_fn

    def cpu_for(self, worker_id: int) -> int:
        """Workers take CPUs from the end of the set (rank by rank when ranks share it),
        leaving the start to the ranks' main processes; they wrap round when there are
        more workers than CPUs."""
        if not self.cpus:
            raise ValueError("no CPUs to pin to")
        g = self.slot * self.num_workers + worker_id
        return self.cpus[len(self.cpus) - 1 - g % len(self.cpus)]

    def __call__(self, worker_id: int) -> None:
        try:
            self._pin(worker_id)
        except Exception as err:
            warn_once("worker-pin", "tunerd.torch: could not pin DataLoader worker %d: %r",
                      worker_id, err)
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def _pin(self, worker_id: int) -> None:
        torch = sys.modules.get("torch")
        if torch is not None:
            # the first OpenMP call of a forked child is where Intel's runtime resets the
            # mask (pytorch#28389, NVIDIA gpu_affinity notes): make it now, before pinning
            torch.get_num_threads()
        cpu = self.cpu_for(worker_id)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), {cpu})
            except ProcessLookupError:
                continue  # a thread that just ended
        # whatever this worker starts gets one thread per process too (pytorch#82219)
        os.environ["OMP_NUM_THREADS"] = "1"
        got = os.sched_getaffinity(0)
        if got != {cpu}:
            warn_once("worker-pin-lost", "tunerd.torch: DataLoader worker %d pinned to CPU %d "
                      "but runs on %s (set KMP_AFFINITY=disabled)", worker_id, cpu, _fmt(got))
        record("worker", {"worker_id": worker_id, "cpu": cpu, "cpus": sorted(got)})


def make_worker_init_fn(user_fn: Callable[[int], Any] | None = None, *,
                        num_workers: int | None = None,
                        alloc: Allocation | None = None) -> WorkerPinner:
    """A ``worker_init_fn`` pinning each worker to its own CPU of this rank's set, then
    calling ``user_fn(worker_id)``; make it in the rank's main process."""
    alloc = alloc or allocation()
    n = num_workers if num_workers is not None else max(1, int(alloc.share))
    return WorkerPinner(alloc.cpus, n, alloc.slot, alloc.ranks_sharing, user_fn)


def worker_init_fn(worker_id: int) -> None:
    """``DataLoader(..., worker_init_fn=tunerd.torch.worker_init_fn)``: pins each worker to
    its own CPU of the rank's set (read from the rank's /proc entry, since in a worker
    the own mask may already have been reset by Intel OpenMP)."""
    try:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        n = info.num_workers if info is not None else 1
        parent = _status(os.getppid())  # read once: its CPUs and its own parent
        cpus = _cpus_in(parent) or os.sched_getaffinity(0)
        ppid = parent.get("PPid", "") if parent else ""
        grand = int(ppid) if ppid.isdigit() else None
        launcher = cpus_of(grand) if grand else None
        alloc = allocation(cpus, launcher_cpus=launcher or cpus)
        pinner = WorkerPinner(alloc.cpus, n, alloc.slot, alloc.ranks_sharing)
    except Exception as err:
        warn_once("worker-pin", "tunerd.torch: could not pin DataLoader worker %d: %r",
                  worker_id, err)
        return
    pinner(worker_id)
