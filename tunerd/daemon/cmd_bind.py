"""Handlers: bind, unbind, jobs."""

from __future__ import annotations

import os
from typing import Any

from tunerd import procfs
from tunerd.allocation import read_allocation, scheduler_gpus
from tunerd.cpulist import CpuListError, format_cpulist, parse_cpulist
from tunerd.daemon.jobs import JobRegistry
from tunerd.daemon.leases import LeaseService
from tunerd.daemon.placer import Placer, PlaceRequest, Reservation
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import ProcVisibility
from tunerd.errors import Failed, NoSuchProcess, UsageError
from tunerd.placement import Placement
from tunerd.topology.visible import gpus_from_env, gpus_from_nvml, out_of_range_notes

NO_PLACEMENT = "no --cpus/--mems given and GPU placement is not available"


def ids_arg(req: Request, name: str) -> frozenset[int] | None:
    """A cpulist argument: "2-5" or a list of ints; None when absent."""
    v = req.args.get(name)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                   for x in v):
        return frozenset(v)
    if not isinstance(v, str):
        raise UsageError(f"{req.cmd}: argument {name!r} must be a cpulist string, got {v!r}")
    try:
        return parse_cpulist(v)
    except CpuListError as err:
        raise UsageError(f"--{name}: {err}") from err


class BindCommands:
    def __init__(self, jobs: JobRegistry, placer: Placer, leases: LeaseService) -> None:
        self.jobs = jobs
        self.placer = placer
        self.leases = leases
        self.gate = leases.gate
        jobs.on_exit(self._exited)

    def _exited(self, pid: int, rec: dict[str, Any]) -> None:
        self.placer.release(f"bind:{pid}")
        self.gate.drop(f"bind:{pid}")

    def register(self, router: Router) -> None:
        router.add("bind", self.bind)
        router.add("unbind", self.unbind)
        router.add("jobs", self.list_jobs)

    async def bind(self, req: Request) -> dict[str, Any]:
        pid = req.arg("pid", int)
        cpus, mems, gpus = ids_arg(req, "cpus"), ids_arg(req, "mems"), ids_arg(req, "gpus")
        nofile = req.arg("nofile", int, None)
        ncpus = req.arg("ncpus", int, None)
        exclusive = req.arg("exclusive", bool, False)
        notes: list[str] = []
        if exclusive:  # a reservation: the one gate of alloc and run (tunerd.daemon.gate)
            self.jobs.authorize(pid, req.peer)
            self.gate.admit(req.peer, exclusive=True, key=f"bind:{pid}")
        if not req.peer.is_root:
            nofile = self.gate.cap_nofile(req.peer.uid, pid, nofile, notes) or nofile
        placement: Placement | None
        if (cpus is None and mems is None) or gpus is not None:
            self.jobs.authorize(pid, req.peer)  # before anything is reserved
            placed = self._near_gpus(pid, tuple(sorted(gpus)) if gpus is not None else None,
                                     exclusive, ncpus, notes)
            if placed is None:  # the process uses no GPU (or is bound already)
                if nofile is None or gpus is not None:
                    raise UsageError("; ".join([NO_PLACEMENT, *notes]))
                notes.append("CPUs and memory nodes unchanged: " + NO_PLACEMENT)
                placement = None
            else:
                placement = Placement(
                    cpus=cpus if cpus is not None else placed.cpus,
                    mems=mems if mems is not None else placed.mems, gpus=placed.gpus,
                    explanation=placed.explanation)
                notes += [n for n in placed.notes if not n.startswith("topology replay")]
        else:
            placement = Placement.given(cpus, mems, explanation="as given on the command line")
        result = await self.jobs.bind(pid, peer=req.peer, placement=placement, nofile=nofile,
                                      origin="cli")
        if exclusive and placement is not None and placement.cpus and not result.get("dry_run"):
            self.placer.reserve(Reservation(
                key=f"bind:{pid}", holder=f"pid {pid} (tunerctl bind --exclusive)",
                gpus=placement.gpus, cpus=placement.cpus, exclusive=True, pid=pid))
            self.gate.hold(f"bind:{pid}", req.peer.uid)
        result["notes"] = [*notes, *result.get("notes", [])]
        return result

    def _near_gpus(self, pid: int, gpus: tuple[int, ...] | None, exclusive: bool,
                   ncpus: int | None, notes: list[str] | None = None) -> Placement | None:
        """Placement near the GPUs ``pid`` uses; None when it uses none tunerd can see.

        A process bound already keeps its place (None) unless --gpus names GPUs.
        """
        topo = self.placer.topo
        if gpus is None and self.jobs.is_bound(pid):
            return None
        env = procfs.read_environ(pid)
        if env is None:
            if not os.path.exists(os.path.join(procfs.PROC, str(pid))):
                raise NoSuchProcess(f"no process with pid {pid}", pid=pid)
            raise NoSuchProcess(f"cannot read the environment of process {pid}", pid=pid)
        if notes is not None:
            notes += out_of_range_notes(env)  # hostile numbers: ignored, said so
        how = "--gpus"
        if gpus is None:
            gpus = gpus_from_env(topo, env, allowed=scheduler_gpus(pid, topo, env))
            how = "its CUDA_VISIBLE_DEVICES/LOCAL_RANK"
            if not gpus:
                gpus = gpus_from_nvml(pid)
                how = "NVML (GPUs it has contexts on)"
        if not gpus:
            return None
        known = {g.index for g in topo.gpus}
        unknown = [g for g in gpus if g not in known]
        if unknown:
            raise UsageError(
                f"{NO_PLACEMENT} for GPU {','.join(map(str, unknown))}: not on this node "
                f"(GPUs: {','.join(map(str, sorted(known))) or 'none'})")
        alloc = read_allocation(pid, env, topo, online=self.placer.host.cpus)
        placed = self.placer.place(PlaceRequest(
            gpu_ids=tuple(gpus), exclusive=exclusive, allocation=alloc, ncpus=ncpus,
            ignore_busy_gpus=True, what=f"process {pid}"))
        if not placed.applicable:
            raise Failed(" ".join(placed.notes) + f" (process {pid}, GPUs from {how}: "
                         f"{','.join(map(str, gpus))}; would bind CPUs "
                         f"{format_cpulist(placed.cpus or frozenset())})",
                         pid=pid, applied=False)
        return Placement(cpus=placed.cpus, mems=self.placer.bindable_mems(placed.mems),
                         gpus=placed.gpus,
                         explanation=f"GPUs from {how}; {placed.explanation}",
                         notes=placed.notes)

    async def unbind(self, req: Request) -> dict[str, Any]:
        pid = req.arg("pid", int)
        out = await self.jobs.unbind(pid, peer=req.peer)
        self.placer.release(f"bind:{pid}")
        self.gate.drop(f"bind:{pid}")
        return out

    async def list_jobs(self, req: Request) -> dict[str, Any]:
        seen = ProcVisibility()  # hidepid: others' command lines stay hidden
        return {"jobs": seen.redact(req.peer, self.jobs.jobs()),
                "leases": seen.redact(req.peer, self.leases.list_leases())}
