"""Control-socket handlers: alloc, release, run, leases."""

from __future__ import annotations

from typing import Any

from tunerd.base.errors import UsageError
from tunerd.daemon.cmd_bind import ids_arg
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import ProcVisibility
from tunerd.jobs.leases import LeaseService
from tunerd.wire.protocol import MAX_TAG, bounded_command, bounded_str, check_int


def _tag(req: Request) -> str | None:
    tag = req.arg("tag", str, None)
    return None if tag is None else bounded_str(f"{req.cmd}: --tag", tag, MAX_TAG)


class LeaseCommands:
    def __init__(self, leases: LeaseService) -> None:
        self.leases = leases

    def register(self, router: Router) -> None:
        router.add("alloc", self.alloc)
        router.add("run", self.run)
        router.add("release", self.release)
        router.add("leases", self.list_leases)

    @staticmethod
    def _common(req: Request) -> dict[str, Any]:
        ncpus = req.arg("ncpus", int, None)
        cpus_arg = req.args.get("cpus")
        cpus: frozenset[int] | None = None
        if isinstance(cpus_arg, int) and not isinstance(cpus_arg, bool):
            if ncpus is not None:  # legacy: a count from an older tunerctl (one release)
                raise UsageError(f"{req.cmd}: give 'ncpus' or a count in 'cpus', not both")
            ncpus = check_int(req.cmd, "ncpus", cpus_arg)
        elif cpus_arg is not None:
            cpus = ids_arg(req, "cpus")
            if not cpus:
                raise UsageError(f"{req.cmd}: --cpus selects no CPU")
        workers = req.arg("workers", int, 0)
        if workers < 0:
            raise UsageError(f"{req.cmd}: workers must be 0 or more, got {workers}")
        return {
            "gpus": req.arg("gpus", int, 0),
            "ncpus": ncpus,
            "cpus": cpus,
            "exclusive": req.arg("exclusive", bool, False),
            "scope": req.arg("exclusive_scope", str, None),
            "tag": _tag(req),
            "workers": workers,
        }

    async def alloc(self, req: Request) -> dict[str, Any]:
        """Reserve GPUs and CPUs for the caller's uid; returns the lease and its env."""
        return await self.leases.alloc(req.peer, **self._common(req))

    async def run(self, req: Request) -> dict[str, Any]:
        """Lease for the calling process itself (SO_PEERCRED pid), bound before it execs."""
        cmd = req.arg("command", list, [])
        if not all(isinstance(c, str) for c in cmd):
            raise UsageError("run: 'command' must be a list of strings")
        bounded_command(cmd)  # a record for jobs/leases: bounded (docs/security-limits.md)
        return await self.leases.run(req.peer, cmd=cmd, **self._common(req))

    async def release(self, req: Request) -> dict[str, Any]:
        """Release one lease (``lease``) or every lease with ``tag`` the caller may release."""
        tag = _tag(req)
        if tag is not None:
            return await self.leases.release_tagged(req.peer, tag)
        return await self.leases.release(req.peer, req.arg("lease", str))

    async def list_leases(self, req: Request) -> list[dict[str, Any]]:
        return ProcVisibility().redact(req.peer, self.leases.list_leases())  # hidepid
