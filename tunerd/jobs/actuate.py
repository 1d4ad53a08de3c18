"""The one writer of another process's CPU masks, memory policy, cpusets and limits.

Every write goes to a target pinned by a pidfd (``Target``): before each step and each
thread write the pidfd is polled, so a process that exited, and a PID reused since, is
never touched. Nothing else in tunerd calls ``sched_setaffinity`` on another process,
``prlimit`` with a new limit, or ``migrate_pages`` (docs/layers.md, rule "One writer";
tests/test_layering.py checks it). The bind pipeline (``tunerd.jobs.pipeline``) calls
the ``Actuator``; the exclusive mover and the binds-in-flight journal call
``set_threads``.

Pure mechanism: no daemon, no policy. Roots (``/proc``, ``/sys``) are arguments.

Identity. A PID alone may be reused, so a target is pinned with a pidfd plus the
start time (field 22 of /proc/PID/stat). The pidfd turns readable when the process
exits; while it is not readable the PID cannot have been reused. Before each step
(and before each thread write) the pidfd is polled, and the start time is read
again before each step, so a reused PID is never touched.

CPUs. ``sched_setaffinity`` works per thread, so every /proc/PID/task/* is set;
passes repeat until one finds no new thread (threads created while binding), then
one verification pass re-reads every mask. Requested CPUs are intersected with the
process's cgroup cpuset (Slurm/Kubernetes), which the kernel would enforce anyway.

Memory nodes. There is no system call to set another process's mempolicy
(set_mempolicy/mbind act on the caller). What others do, and what is done here:
 - numad and LSF affinity jobs move a running process into a cpuset cgroup whose
   cpuset.mems is the target node(s), with memory_migrate set so already-touched
   pages follow; new allocations are confined by the kernel from then on.
 - Slurm task/cgroup nests job/step/task cpusets inside its own hierarchy; so the
   child cpuset is made *under the process's current cpuset cgroup*, keeping the
   scheduler's hierarchy and accounting intact (tunerd-PID-STARTTIME).
 - torchrun --numa-binding wraps the command in numactl: only at launch, not for
   a process already running, so not usable here.
 - Where no cpuset can be nested (cgroup v2 without the cpuset controller), only
   migrate_pages(2) is left: pages move, but new allocations are not confined, and
   the result says so.

Limits. RLIMIT_NOFILE via prlimit(2): soft = N, hard = max(hard, N) (the hard
limit is never lowered, so restore always works). Raising a hard limit, and
prlimit on another user's process, need CAP_SYS_RESOURCE.

Everything is validated first; steps then run in order (limits, cpuset, affinity,
migrate_pages) and a failing step rolls back the earlier ones.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from tunerd.adapters.cpuset import CpusetCgroup, child_name, find_cpuset, read_ids, tunerd_children
from tunerd.adapters.procfs import PF_KTHREAD, Process, Stat, read_start_time, read_text
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError, UsageError
from tunerd.base.syscalls import syscall_nr
from tunerd.jobs.binding import BindResult, Originals, Plan, Target
from tunerd.wire.protocol import PID_MAX_LIMIT

__all__ = ["Actuator", "Binder", "set_threads"]

CAP_SYS_RESOURCE = 24
MAX_PASSES = 50  # thread-listing passes before giving up on a process that forks threads


class RestoreSummary(TypedDict):
    """What ``Actuator.restore`` did (the unbind reply's base)."""

    pid: int
    threads: int
    notes: list[str]


class Actuator:
    """Pins processes and changes them: the mechanism of every bind, unbind and put-back."""

    def __init__(self, proc_root: Path | str = "/proc", sys_root: Path | str = "/sys") -> None:
        self.proc = Path(proc_root)
        self.sys = Path(sys_root)
        self._proc_s = str(self.proc)
        self._cap_sys_resource: bool | None = None

    def has_cap_sys_resource(self) -> bool:
        """Whether this process may raise hard limits and prlimit other users (cached)."""
        if self._cap_sys_resource is None:
            me = Process(os.getpid(), self._proc_s)
            self._cap_sys_resource = bool(me.cap_effective() >> CAP_SYS_RESOURCE & 1)
        return self._cap_sys_resource

    # -- reading (tunerd.adapters.procfs: its error boundary maps a vanished process to
    # NoSuchProcess, a zombie too where alive=True) ------------------------------
    def _stat(self, pid: int) -> Stat:
        return Process(pid, self._proc_s).stat(alive=True)

    def start_time(self, pid: int) -> int:
        """Field 22 of /proc/PID/stat: start time in clock ticks after boot."""
        return self._stat(pid).start_time

    def owner(self, pid: int) -> tuple[int, int]:
        """(real uid, effective uid) from /proc/PID/status."""
        return Process(pid, self._proc_s).uids()

    def tids(self, pid: int) -> list[int]:
        return Process(pid, self._proc_s).tids()

    def online_cpus(self) -> frozenset[int]:
        return read_ids(self.sys / "devices" / "system" / "cpu" / "online")

    def online_nodes(self) -> frozenset[int]:
        p = self.sys / "devices" / "system" / "node" / "online"
        return read_ids(p) if p.exists() else frozenset({0})  # no NUMA: one node 0

    def nr_open(self) -> int:
        return int(read_text(f"{self._proc_s}/sys/fs/nr_open"))

    def pages_per_node(self, pid: int) -> dict[int, int]:
        """Pages of ``pid`` per NUMA node, summed over /proc/PID/numa_maps (N<node>=<pages>);
        empty once the process is gone."""
        try:
            return Process(pid, self._proc_s).numa_pages()
        except NoSuchProcess:
            return {}

    # -- pinning ---------------------------------------------------------------
    def pin(self, pid: int) -> Target:
        """Open a pidfd on ``pid`` and record its start time (raises NoSuchProcess).

        The pidfd first, then one read of the stat: the start time read after it is
        that of the process the pidfd holds (a later check needs no read of /proc)."""
        if not 0 < pid <= PID_MAX_LIMIT:
            raise UsageError(f"pid {pid} is out of range: 1 to {PID_MAX_LIMIT} (the "
                             "kernel's PID_MAX_LIMIT)", pid=pid)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError as err:
            raise NoSuchProcess(f"no process with pid {pid}", pid=pid) from err
        except OSError as err:
            # a thread id, not a process: EINVAL on older kernels, ENOENT on newer ones
            tgid = self._tgid(pid)
            if tgid not in (str(pid), "?"):
                raise UsageError(f"pid {pid} is a thread of process {tgid}; bind the process",
                                 pid=pid) from err
            if err.errno in (errno.ENOENT, errno.ESRCH):
                raise NoSuchProcess(f"no process with pid {pid}", pid=pid) from err
            raise Failed(f"pidfd_open({pid}) failed: {err.strerror}", pid=pid) from err
        try:
            stat = self._stat(pid)
            if stat.flags & PF_KTHREAD:
                raise UsageError(f"pid {pid} is a kernel thread; tunerd binds user processes",
                                 pid=pid)
            uid, euid = self.owner(pid)
        except BaseException:
            os.close(fd)
            raise
        return Target(pid=pid, start_time=stat.start_time, pidfd=fd, uid=uid, euid=euid)

    @staticmethod
    def pin_fd(pid: int) -> Target:
        """A pidfd on ``pid`` and nothing read (the exec watcher's thread: the intake's
        read of /proc/PID/stat right after gives the start time, of the process the
        pidfd holds). NoSuchProcess when it is gone."""
        try:
            fd = os.pidfd_open(pid)
        except OSError as err:
            raise NoSuchProcess(f"no process with pid {pid}", pid=pid) from err
        return Target(pid=pid, start_time=0, pidfd=fd, uid=-1, euid=-1)

    def adopt(self, pid: int, start_time: int) -> Target | None:
        """Pin ``pid`` only if it is still the process that started at ``start_time``."""
        try:
            t = self.pin(pid)
        except (NoSuchProcess, UsageError):
            return None
        if t.start_time != start_time:
            t.close()
            return None
        return t

    def check(self, t: Target) -> None:
        """Raise NoSuchProcess unless ``t`` is still alive and still the same process.

        Its pidfd says both (one poll(2), no read of /proc): it refers to the process
        whose start time ``pin`` read, and becomes readable when that one exits (a pid
        reused since belongs to another process, which the pidfd never refers to)."""
        if t.exited():
            raise NoSuchProcess(f"process {t.pid} exited while being bound", pid=t.pid)

    def _tgid(self, tid: int) -> str:
        try:
            return str(Process(tid, self._proc_s).tgid())
        except TunerdError:
            return "?"

    # -- validation --------------------------------------------------------------
    def prepare(self, t: Target, *, cpus: frozenset[int] | None = None,
                mems: frozenset[int] | None = None, nofile: int | None = None,
                previous: Originals | None = None, partial: bool = False,
                originals: Originals | None = None) -> Plan:
        """Validate a bind and read the originals; changes nothing.

        ``previous``: the originals saved by an earlier bind of the same process
        (a re-bind keeps them, and stays inside the cpuset the process had first).
        ``partial``: a limit the daemon may not set (no CAP_SYS_RESOURCE) is left out
        with a note instead of failing the whole bind.
        ``originals``: masks read (``read_originals``) just before the CPUs were set
        already (a rule's fast bind in the exec watcher): kept as the first bind's.
        """
        notes: list[str] = []
        if cpus is None and mems is None and nofile is None:
            raise UsageError("nothing to bind: give cpus, mems or nofile")
        self.check(t)
        try:
            base = (previous.cpuset_base if previous and previous.cpuset_child
                    else find_cpuset(t.pid, self.proc, self.sys))
        except (FileNotFoundError, ProcessLookupError):
            raise NoSuchProcess(f"process {t.pid} exited while being bound", pid=t.pid) from None
        online = self.online_cpus()
        allowed = online & base.effective_cpus() if base else online
        if cpus is not None:
            cpus = _checked_cpus(t, cpus, online, allowed, base, notes)
        plan_cpuset, cpuset_cpus, migrate_from = self._plan_mems(
            t, cpus, mems, base, allowed, previous, notes)
        new_nofile: tuple[int, int] | None = None
        old_nofile: tuple[int, int] | None = None
        if nofile is not None:
            try:
                new_nofile, old_nofile = self._check_nofile(t, nofile)
            except PermissionDenied as err:
                if not partial or (cpus is None and mems is None):
                    raise
                notes.append(f"fd limit not set: {err.message}")
        if originals is not None and previous is None:
            orig = originals.copy()
            orig.nofile = old_nofile
        else:
            orig = self._originals(t, previous, old_nofile)
        if plan_cpuset is not None and orig.cpuset_child is None:
            orig.cpuset_base, orig.cpuset_child = base, plan_cpuset
        if cpus is not None or plan_cpuset is not None:
            orig.affinity_set = True
        return Plan(target=t, originals=orig, cpus=cpus, mems=mems, nofile=new_nofile,
                    cpuset=plan_cpuset, cpuset_cpus=cpuset_cpus, migrate_from=migrate_from,
                    notes=notes, first=previous is None, partial=partial)

    def _plan_mems(self, t: Target, cpus: frozenset[int] | None, mems: frozenset[int] | None,
                   base: CpusetCgroup | None, allowed: frozenset[int],
                   previous: Originals | None, notes: list[str]
                   ) -> tuple[CpusetCgroup | None, frozenset[int], frozenset[int] | None]:
        """(child cpuset, its CPUs, nodes to migrate pages from) for a memory binding."""
        if mems is None:
            if previous is not None and previous.cpuset_child is not None and cpus is not None:
                # a re-bind that changes CPUs must widen/narrow the child cpuset too
                return previous.cpuset_child, cpus, None
            return None, frozenset(), None
        if not mems:
            raise UsageError("empty memory-node list")
        nodes = self.online_nodes()
        bad = mems - nodes
        if bad:
            raise UsageError(f"NUMA node {format_cpulist(bad)} is not online (online: "
                             f"{format_cpulist(nodes)})", mems=format_cpulist(bad))
        if base is not None:
            allowed_mems = base.effective_mems()
            if not mems <= allowed_mems:
                raise UsageError(
                    f"NUMA nodes {format_cpulist(mems - allowed_mems)} are outside cgroup "
                    f"cpuset {base.path} of process {t.pid} (it allows mems "
                    f"{format_cpulist(allowed_mems)})")
        if base is not None and base.can_nest():
            child = (previous.cpuset_child if previous and previous.cpuset_child
                     else base.child(child_name(t.pid, t.start_time)))
            return child, cpus if cpus is not None else allowed, None
        why = ("cgroup v2 without the cpuset controller for this process"
               if base is not None else "no cpuset cgroup hierarchy is mounted")
        if base is not None and base.kubelet_owned:
            why = (f"cgroup {base.path} is the kubelet's (kubepods): tunerd makes no "
                   f"child cgroup there; start the job with `tunerctl run` (it sets its "
                   f"memory policy itself before the exec) to confine it")
        notes.append(f"new allocations not confined to nodes {format_cpulist(mems)}: "
                     f"{why}; existing pages moved with migrate_pages(2)")
        return None, frozenset(), nodes - mems

    def read_originals(self, t: Target, only: frozenset[int] | None = None) -> Originals:
        """Every thread's CPU mask now (before a bind changes them). ``only``: the mask
        of its one thread, read just now (a just-exec'd process whose stat said one
        thread): no more reads; a thread cloned since is found, and its mask read, by
        the first listing of the bind (``_set_masks``)."""
        if only is not None:
            return Originals(pid=t.pid, start_time=t.start_time, process_cpus=only,
                             threads={t.pid: only})
        return self._originals(t, None, None)

    def _originals(self, t: Target, previous: Originals | None,
                   old_nofile: tuple[int, int] | None) -> Originals:
        """What the process had before the first bind (kept from it on a re-bind)."""
        if previous is not None:
            orig = previous.copy()
            if orig.nofile is None:
                orig.nofile = old_nofile
            return orig
        orig = Originals(pid=t.pid, start_time=t.start_time,
                         process_cpus=self._affinity(t, t.pid), nofile=old_nofile)
        for tid in self.tids(t.pid):
            try:
                orig.threads[tid] = frozenset(os.sched_getaffinity(tid))
            except ProcessLookupError:
                pass
        return orig

    def _affinity(self, t: Target, tid: int) -> frozenset[int]:
        try:
            return frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            raise NoSuchProcess(f"process {t.pid} exited while being bound", pid=t.pid) from None

    def _check_nofile(self, t: Target, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
        nr_open = self.nr_open()
        if n < 1:
            raise UsageError(f"nofile must be at least 1, got {n}")
        if n > nr_open:
            raise UsageError(f"nofile {n} is above the kernel maximum fs.nr_open = {nr_open}",
                             nofile=n, nr_open=nr_open)
        try:  # the permission check of a read is the same as that of a write
            soft, hard = resource.prlimit(t.pid, resource.RLIMIT_NOFILE)
        except ProcessLookupError:
            raise NoSuchProcess(f"process {t.pid} exited while being bound", pid=t.pid) from None
        except PermissionError as err:
            # the kernel lets only a process of the same uid, or CAP_SYS_RESOURCE, read or
            # set another's limits, whatever the value: not a raise (4096 may be below
            # its hard limit), and not "another user's" to its owner asking
            raise PermissionDenied(
                f"prlimit on pid {t.pid} (uid {t.uid}) failed: EPERM — tunerd (uid "
                f"{os.geteuid()}) may change the fd limit of a process of another uid only "
                f"with CAP_SYS_RESOURCE, which it does not have; its owner may set it "
                f"within its hard limit: prlimit --pid {t.pid} --nofile={n}:",
                pid=t.pid) from err
        if n > hard and not self.has_cap_sys_resource():
            raise PermissionDenied(
                f"prlimit on pid {t.pid} (uid {t.uid}) would fail: EPERM — raising the hard "
                f"limit {hard} to {n} needs CAP_SYS_RESOURCE, which tunerd does not have",
                pid=t.pid)
        return (n, max(hard, n)), (soft, hard)

    def _prlimit_denied(self, t: Target, what: str) -> PermissionDenied:
        return PermissionDenied(
            f"prlimit on pid {t.pid} (uid {t.uid}) failed: EPERM — {what} needs "
            "CAP_SYS_RESOURCE", pid=t.pid)

    # -- applying ----------------------------------------------------------------
    def apply(self, plan: Plan) -> BindResult:
        """Carry out ``plan``; on failure undo the steps already done and re-raise."""
        t0 = time.perf_counter()
        t = plan.target
        undo: list[Callable[[], None]] = []
        pages_moved: int | None = None
        masks: dict[int, frozenset[int]] = {}  # tid -> mask before, filled by the affinity step
        try:
            nofile_old = self._nofile_step(plan, undo)
            # masks are put back after the cpuset undo: moving back resets every mask
            undo.append(lambda: _restore_masks(masks))
            if plan.cpuset is not None:
                pages_moved = self._cpuset_step(plan, undo)
            threads = self._apply_affinity(plan, masks)
            if plan.migrate_from is not None and plan.mems is not None:
                pages_moved = self._migrate_step(plan, pages_moved)
        except BaseException as err:
            for fn in reversed(undo):
                try:
                    fn()
                except Exception:  # best effort: report the first error, not the undo's
                    pass
            if isinstance(err, OSError):  # a cgroup write: name it, as a failure
                raise Failed(f"binding pid {t.pid} failed, nothing changed: {err}",
                             pid=t.pid) from err
            raise
        return BindResult(
            pid=t.pid, cpus=plan.cpus, mems=plan.mems, threads=threads,
            pages_moved=pages_moved, nofile_old=nofile_old,
            nofile_new=plan.nofile[0] if plan.nofile else None, notes=list(plan.notes),
            elapsed_ms=(time.perf_counter() - t0) * 1000)

    def _nofile_step(self, plan: Plan, undo: list[Callable[[], None]]) -> int | None:
        """The fd limit (the old soft limit; None: not set); under ``plan.partial`` a
        refusal leaves it out with a note."""
        t = plan.target
        if plan.nofile is None:
            return None
        self.check(t)
        try:
            old = resource.prlimit(t.pid, resource.RLIMIT_NOFILE, plan.nofile)
        except PermissionError as err:
            denied = self._prlimit_denied(t, "changing this limit")
            if not plan.partial:
                raise denied from err
            plan.notes.append(f"fd limit not set: {denied.message}")
            plan.nofile = None
            return None
        except ProcessLookupError:
            raise NoSuchProcess(f"process {t.pid} exited while being bound",
                                pid=t.pid) from None
        undo.append(lambda: self._set_nofile(t, old))
        return old[0]

    def _migrate_step(self, plan: Plan, pages_moved: int | None) -> int | None:
        assert plan.migrate_from is not None and plan.mems is not None
        try:
            return self._migrate_pages(plan.target, plan.migrate_from, plan.mems)
        except Failed as err:
            if not plan.partial:
                raise
            plan.notes.append(f"memory nodes not set: {err.message}")
            return pages_moved

    def _cpuset_step(self, plan: Plan, undo: list[Callable[[], None]]) -> int | None:
        """The memory-node step; under ``plan.partial`` a failure leaves it out with a note."""
        if not plan.partial:
            return self._apply_cpuset(plan, undo)
        mine: list[Callable[[], None]] = []
        try:
            moved = self._apply_cpuset(plan, mine)
        except (OSError, Failed, PermissionDenied) as err:
            for fn in reversed(mine):
                try:
                    fn()
                except Exception:
                    pass
            what = err.message if isinstance(err, TunerdError) else str(err)
            plan.notes.append(f"memory nodes {format_cpulist(plan.mems or frozenset())} not "
                              f"set (cpuset {plan.cpuset.path if plan.cpuset else '?'}): {what}")
            orig = plan.originals
            if orig.cpuset_child is not None and not orig.cpuset_child.dir.exists():
                # the undo removed the child cpuset: the originals must not name it, or a
                # later re-bind would update, and restore would leave, a cgroup that is gone
                orig.cpuset_base, orig.cpuset_child = None, None
                if plan.first and plan.cpus is None:
                    orig.affinity_set = False  # set only for the cpuset, which is left out
            plan.cpuset, plan.mems = None, None
            return None
        undo.extend(mine)
        return moved

    def _set_nofile(self, t: Target, value: tuple[int, int]) -> None:
        if not t.exited():
            resource.prlimit(t.pid, resource.RLIMIT_NOFILE, value)

    def _apply_cpuset(self, plan: Plan, undo: list[Callable[[], None]]) -> int | None:
        t, child = plan.target, plan.cpuset
        assert child is not None
        mems = plan.mems if plan.mems is not None else child.cpus_mems()[1]
        before = self.pages_per_node(t.pid)
        self.check(t)
        base = plan.originals.cpuset_base
        current = find_cpuset(t.pid, self.proc, self.sys)
        if child.dir.exists():
            old_cpus, old_mems = child.cpus_mems()
            child.set(plan.cpuset_cpus, mems)
            undo.append(lambda: child.set(old_cpus, old_mems))
        else:
            def remove_child() -> None:
                child.remove()

            # registered before the mkdir: a failing write after it leaves no empty child
            undo.append(remove_child)
            child.create(plan.cpuset_cpus, mems)
        if current is None or current.path != child.path:
            self.check(t)
            try:
                child.attach(t.pid)
            except ProcessLookupError:
                raise NoSuchProcess(f"process {t.pid} exited while being bound",
                                    pid=t.pid) from None
            back = current or base
            if back is not None:
                undo.append(lambda: back.attach(t.pid) if not t.exited() else None)
        after = self.pages_per_node(t.pid)
        outside = lambda d: sum(n for node, n in d.items() if node not in mems)  # noqa: E731
        return max(0, outside(before) - outside(after))

    def _apply_affinity(self, plan: Plan, done: dict[int, frozenset[int]]) -> int:
        """Set every thread's mask for ``plan``; returns the number of live threads bound.

        ``done`` collects tid -> mask before this bind (the caller's undo uses it).
        With no CPUs requested (mems only) each thread gets back the mask it had,
        which attaching to the child cpuset reset.
        """
        t, orig = plan.target, plan.originals
        if plan.cpus is None and plan.cpuset is None:
            return len(self.tids(t.pid))

        def want(tid: int) -> frozenset[int]:
            if plan.cpus is not None:
                return plan.cpus
            m = orig.threads.get(tid, orig.process_cpus) & plan.cpuset_cpus
            return m or plan.cpuset_cpus

        self.check(t)
        live = self._set_masks(t, want, done, known=orig.threads if plan.first else {},
                               record=orig.threads if plan.first else None,
                               after_main=plan.after_main)
        return len(set(live) & done.keys()) or len(done)

    def _set_masks(self, t: Target, want: Callable[[int], frozenset[int]],
                   done: dict[int, frozenset[int]], known: dict[int, frozenset[int]],
                   record: dict[int, frozenset[int]] | None,
                   after_main: Callable[[], None] | None = None) -> list[int]:
        """Give every thread of ``t`` the mask ``want(tid)``; returns the last tid listing.

        Passes repeat while they find threads that needed a change: a thread found
        later that already has its mask was created by a set thread (masks are
        inherited), so a process that keeps spawning threads still converges. A
        thread cloned while its parent was being set may have copied the old mask
        before it showed up in task/; it is new in a later listing, so its mask is
        read and fixed. ``known``: masks read just before (skips a getaffinity in the
        first pass); ``record``: where first-seen masks are kept as originals;
        ``after_main``: called once the main thread has its mask (``Plan.after_main``).
        """
        quiet = 0
        live: list[int] = []
        early = 0
        main = known.get(t.pid)
        if main is not None and len(known) == 1:
            # one thread when its mask was read, just now (a just-exec'd rank): the main
            # thread is set before task/ is listed, the passes then find any other
            w = want(t.pid)
            if main != w and self._set_one(t, t.pid, w):
                early = 1
            if after_main is not None:
                after_main()
                after_main = None
            done[t.pid] = main
            if record is not None:
                record.setdefault(t.pid, main)
        for n_pass in range(MAX_PASSES):
            changed, early = early, 0
            live = self.tids(t.pid)
            for tid in live:
                if tid in done:
                    continue
                w = want(tid)
                try:
                    before = (known[tid] if n_pass == 0 and tid in known
                              else frozenset(os.sched_getaffinity(tid)))
                except ProcessLookupError:
                    continue  # the thread exited: fine
                if before != w:
                    if not self._set_one(t, tid, w):
                        continue
                    changed += 1
                done[tid] = known.get(tid, before)
                if record is not None and (n_pass == 0 or before != w):
                    record.setdefault(tid, before)
            if after_main is not None:
                after_main()
                after_main = None
            # stop after two listings in a row that needed no write: the second one
            # catches a thread whose clone(2) was still in flight during the first
            quiet = 0 if changed else quiet + 1
            if quiet == 2:
                return live
        raise Failed(f"process {t.pid} keeps changing its threads' CPU masks; gave up "
                     f"after {MAX_PASSES} passes", pid=t.pid)

    @staticmethod
    def _set_one(t: Target, tid: int, w: frozenset[int]) -> bool:
        """sched_setaffinity(tid, w) for a thread of ``t``; False: the thread is gone."""
        if t.exited():  # before every write: never touch a reused tid
            raise NoSuchProcess(f"process {t.pid} exited while being bound", pid=t.pid)
        try:
            os.sched_setaffinity(tid, w)
        except ProcessLookupError:
            return False  # the thread exited: fine
        except PermissionError as err:  # another user's process, no CAP_SYS_NICE
            raise PermissionDenied(
                f"sched_setaffinity(thread {tid} of pid {t.pid}, {format_cpulist(w)}) "
                f"failed: EPERM — setting the CPUs of another user's process (uid "
                f"{t.uid}) needs CAP_SYS_NICE, which tunerd does not have",
                pid=t.pid) from err
        except OSError as err:
            raise Failed(f"sched_setaffinity(thread {tid} of pid {t.pid}, "
                         f"{format_cpulist(w)}) failed: "
                         f"{errno.errorcode.get(err.errno or 0, err.errno)} "
                         f"{err.strerror}", pid=t.pid) from err
        return True

    def _migrate_pages(self, t: Target, old: frozenset[int], new: frozenset[int]) -> int | None:
        if not old:
            return 0
        before = self.pages_per_node(t.pid)
        self.check(t)
        nr = syscall_nr("migrate_pages")
        if nr is None:
            raise Failed(f"migrate_pages: unknown syscall number on {platform.machine()}")
        maxnode = max(old | new) + 2
        words = (maxnode + 63) // 64
        mask_t = ctypes.c_ulong * words

        def mask(ids: frozenset[int]) -> ctypes.Array[ctypes.c_ulong]:
            m = mask_t()
            for i in ids:
                m[i // 64] |= 1 << (i % 64)
            return m

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(ctypes.c_long(nr), ctypes.c_long(t.pid), ctypes.c_ulong(maxnode),
                          mask(old), mask(new))
        if rc < 0:
            e = ctypes.get_errno()
            why = (" — moving the pages of another user's process needs CAP_SYS_NICE, "
                   "which tunerd does not have" if e == errno.EPERM else "")
            raise Failed(f"migrate_pages(pid {t.pid}, {format_cpulist(old)} -> "
                         f"{format_cpulist(new)}) failed: {os.strerror(e)}{why}", pid=t.pid)
        after = self.pages_per_node(t.pid)
        outside = sum(n for node, n in before.items() if node not in new)
        return max(0, outside - sum(n for node, n in after.items() if node not in new))

    # -- restoring -----------------------------------------------------------------
    def restore(self, t: Target, orig: Originals) -> RestoreSummary:
        """Put back what ``orig`` recorded: cpuset membership, per-thread masks, nofile.

        Threads that appeared since the bind get the process-level original mask.
        Returns a summary with notes on anything that could not be put back.
        """
        notes: list[str] = []
        self.check(t)
        if orig.nofile is not None:
            try:
                resource.prlimit(t.pid, resource.RLIMIT_NOFILE, orig.nofile)
            except PermissionError:
                notes.append(f"nofile not restored to {orig.nofile[0]}/{orig.nofile[1]}: "
                             "EPERM (raising a hard limit needs CAP_SYS_RESOURCE)")
            except ProcessLookupError:
                raise NoSuchProcess(f"process {t.pid} exited", pid=t.pid) from None
        allowed = self.online_cpus()
        if orig.cpuset_child is not None and orig.cpuset_base is not None:
            try:
                orig.cpuset_base.attach(t.pid)  # resets every mask to the base cpuset
            except ProcessLookupError:
                raise NoSuchProcess(f"process {t.pid} exited", pid=t.pid) from None
            except OSError as err:  # e.g. the scheduler removed the job's cgroup meanwhile
                notes.append(f"could not move pid {t.pid} back to cpuset "
                             f"{orig.cpuset_base.path} ({err}); it stays in "
                             f"{orig.cpuset_child.path}")
            else:
                if not orig.cpuset_child.remove():
                    notes.append(f"child cpuset {orig.cpuset_child.dir} still busy; "
                                 "left in place")
            notes.append("pages moved by --mems stay where they are")
        if not orig.affinity_set:
            return {"pid": t.pid, "threads": len(self.tids(t.pid)), "notes": notes}
        base = find_cpuset(t.pid, self.proc, self.sys)
        if base is not None:
            allowed &= base.effective_cpus()
        dropped: dict[int, frozenset[int]] = {}

        def want(tid: int) -> frozenset[int]:
            mask = orig.threads.get(tid, orig.process_cpus)
            eff = mask & allowed
            if eff != mask and len(dropped) < 20:
                dropped[tid] = mask - eff
            return eff or allowed

        done: dict[int, frozenset[int]] = {}
        live = self._set_masks(t, want, done, known={}, record=None)
        notes.extend(f"thread {tid}: CPUs {format_cpulist(m)} are no longer allowed; "
                     "restored the rest" for tid, m in dropped.items())
        return {"pid": t.pid, "threads": len(set(live) & done.keys()), "notes": notes}

    def sweep_stale_cpusets(self) -> list[Path]:
        """Remove child cpusets left by processes that exited while no daemon watched them.

        Only an empty one whose process (pid + start time, from its name) is gone is
        removed; one being set up for a live process is left alone.
        """
        removed: list[Path] = []
        for d, pid, st in tunerd_children(self.sys):
            try:
                alive = self.start_time(pid) == st
            except NoSuchProcess:
                alive = False
            if alive:
                continue
            try:
                d.rmdir()
            except OSError:
                continue  # still has tasks (or is gone already)
            removed.append(d)
        return removed

    def forget(self, orig: Originals) -> bool:
        """After the process exited: remove the child cpuset tunerd made (True when gone)."""
        if orig.cpuset_child is None:
            return True
        try:
            return orig.cpuset_child.remove()
        except OSError:
            return False


def _checked_cpus(t: Target, cpus: frozenset[int], online: frozenset[int],
                  allowed: frozenset[int], base: CpusetCgroup | None,
                  notes: list[str]) -> frozenset[int]:
    """``cpus`` inside what the process may use (online, its cgroup cpuset)."""
    where = f"cgroup cpuset {base.path}" if base else "online CPUs"
    if not cpus:
        raise UsageError("empty CPU list")
    offline = cpus - online
    if offline:
        raise UsageError(
            f"CPU {format_cpulist(offline)} is not online (online: "
            f"{format_cpulist(online)})", cpus=format_cpulist(offline))
    eff = cpus & allowed
    if not eff:
        raise UsageError(
            f"CPUs {format_cpulist(cpus)} are outside what process {t.pid} may use: "
            f"{where} allows {format_cpulist(allowed)}")
    if eff != cpus:
        notes.append(f"CPUs {format_cpulist(cpus - eff)} dropped: {where} allows "
                     f"{format_cpulist(allowed)}")
    return eff


Binder = Actuator  # its name before the one writer had its own module


def _restore_masks(masks: Mapping[int, frozenset[int]]) -> None:
    """The undo of an affinity step: each thread's mask from before (best effort)."""
    for tid, mask in masks.items():
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:
            pass


# (the mask a thread must have now, None: any; the mask it gets)
ThreadSwap = tuple["frozenset[int] | None", "frozenset[int]"]


@dataclass
class ThreadsSet:
    """What ``set_threads`` did: the threads set, and the one refused (EPERM)."""

    done: list[int] = field(default_factory=list)
    denied: tuple[int, str] | None = None  # (tid, strerror): the rest were not tried
    failed: dict[int, str] = field(default_factory=dict)  # tid -> other errors


def set_threads(pid: int, swaps: Mapping[int, ThreadSwap] | None = None, *,
                every: ThreadSwap | None = None, start_time: int | None = None,
                thread_starts: Mapping[int, int] | None = None,
                proc: str = "/proc") -> ThreadsSet:
    """Masks of threads of another process, pinned by a pidfd on ``pid`` (the
    exclusive mover's moves and their undo, the journal's put-back).

    ``swaps``: tid -> (expected, new): a thread gets ``new`` only while it still has
    ``expected`` (a mask someone changed since is theirs); ``every``: the same for
    every thread listed once the pidfd is open. ``start_time``: the process's, read
    after the pidfd is open (another process with the pid: nothing is set);
    ``thread_starts``: each thread's, likewise (a reused tid is skipped). The pidfd
    is polled before every write: an exit stops it."""
    out = ThreadsSet()
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return out
    t = Target(pid=pid, start_time=start_time or 0, pidfd=fd, uid=-1, euid=-1)
    try:
        if start_time is not None and read_start_time(pid, proc) != start_time:
            return out
        if every is not None:
            swaps = {tid: every for tid in Process(pid, proc).tids()}
        for tid, (expect, new) in (swaps or {}).items():
            if t.exited():  # its tids may be another's soon
                break
            if thread_starts is not None and \
                    read_start_time(tid, proc) != thread_starts.get(tid):
                continue
            if not _swap_one(tid, expect, new, out):
                break
        return out
    finally:
        t.close()


def _swap_one(tid: int, expect: frozenset[int] | None, new: frozenset[int],
              out: ThreadsSet) -> bool:
    """One thread of ``set_threads``; False: refused (EPERM), stop there."""
    try:
        if expect is not None and frozenset(os.sched_getaffinity(tid)) != expect:
            return True
        os.sched_setaffinity(tid, new)
    except PermissionError as err:
        out.denied = (tid, err.strerror or "EPERM")
        return False
    except OSError as err:
        out.failed[tid] = str(err)
        return True
    out.done.append(tid)
    return True
