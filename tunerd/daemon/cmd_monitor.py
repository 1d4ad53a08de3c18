"""Monitor commands: metrics, top, advise (read-only, any user) and report (training side)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import NoSuchProcess, PermissionDenied
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import HIDDEN, ProcVisibility
from tunerd.monitor.reports import parse_report
from tunerd.monitor.service import Monitor

ADVISE_WINDOW = 300  # newest samples the rules look at (5 min at the default 1 s)


MAPS_READ = 4 << 20  # /proc/PID/maps read for the libraries loaded (bounded)


def binding_findings(pid: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The ways a bound training process loses its binding (tunerd.diagnose.training_env), read
    from its /proc files: environment, loaded OpenMP runtime, its workers' masks."""
    import os

    from tunerd.diagnose.training_env import check_environment, check_workers, uses_intel_openmp
    from tunerd.diagnose.training_env import uses_torch as maps_torch

    env = procfs.read_environ(pid)
    try:
        maps = procfs.read_maps(pid, MAPS_READ)
        mask = frozenset(os.sched_getaffinity(pid))
    except OSError:
        return []
    if env is None:
        return []
    intel = uses_intel_openmp(maps)
    found = check_environment(env, len(mask), torch=maps_torch(maps), intel_openmp=intel)
    workers: dict[int, frozenset[int]] = {}
    for w in job.get("worker_pids") or []:
        try:
            workers[int(w)] = frozenset(os.sched_getaffinity(int(w)))
        except OSError:
            continue
    found += check_workers(mask, workers, intel_openmp=intel)
    return [f.to_dict() for f in found]


def _self_affined(entry: dict[str, Any],
                  more: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The advice for a rank a rule matched that set its own CPUs (numactl, taskset,
    torchrun --numa-binding): tunerd left it as it is, and says so."""
    pid = int(entry["pid"])
    try:
        mask: str | None = format_cpulist(frozenset(os.sched_getaffinity(pid)))
    except OSError:
        mask = None
    finding = {
        "id": "self-affined", "severity": "info",
        "title": "the rank set its own CPU affinity; tunerd left it as it is",
        "evidence": {"cpus": mask, "why": entry.get("why")},
        "why": "A rank started through numactl/taskset (torchrun --numa-binding) chose its "
               "CPUs before tunerd saw it; re-binding it could undo the launcher's choice or "
               "break the launch, so a [[job]] rule leaves it alone.",
        "fix": "Nothing to do if those CPUs are the ones you want. To have tunerd place the "
               "rank near its GPU (and split the allocation between ranks), start it "
               "without numactl/taskset or --numa-binding.",
        "docs": []}
    return {"pid": pid, "name": entry.get("comm"), "samples": 0,
            "findings": [finding, *(more or [])]}


class MonitorCommands:
    def __init__(self, monitor: Monitor,
                 settings_for: Callable[[int], dict[str, Any]] | None = None,
                 left_alone: Callable[[], list[dict[str, Any]]] = list,
                 gpu_nics: Callable[[], dict[str, Any]] | None = None,
                 self_pinned: Callable[[int], list[dict[str, Any]]] | None = None) -> None:
        self.monitor = monitor
        # a self-pinned rank's findings (outside its GPU's slice, remote memory)
        self.self_pinned = self_pinned or (lambda pid: [])
        # each GPU's NIC as JSON (tunerd.topology.iopath.pairing_json): the nic-far rule
        self.gpu_nics = gpu_nics or (lambda: {})
        # processes a rule matched and left as they are (AutoBinder.left_alone_now)
        self.left_alone = left_alone
        # the `torch` settings of the [[job]] rule that bound a pid ({} when none)
        self.settings_for = settings_for or (lambda pid: {})

    def register(self, router: Router) -> None:
        router.add("metrics", self.metrics)
        router.add("top", self.top)
        router.add("advise", self.advise)
        router.add("report", self.report)

    async def metrics(self, req: Request) -> dict[str, Any]:
        """The Prometheus exposition text, as /metrics would serve it to the caller
        (past hidepid, another user's process names hidden)."""
        seen = ProcVisibility()
        if seen.sees_all(req.peer)[0]:
            return {"text": self.monitor.exposition()}
        return {"text": self.monitor.exposition_for(req.peer.uid, lambda uid: False)}

    async def top(self, req: Request) -> dict[str, Any]:
        """The latest sample and the bound jobs, for `tunerctl top`."""
        m = self.monitor
        m.watched()  # memory, disks, NICs sampled every cycle while top refreshes
        seen = ProcVisibility()  # hidepid: others' command lines stay hidden
        sample = m.latest
        records = m.job_records()
        sampled = {j.get("pid") for j in (sample or {}).get("jobs") or []}
        # bound since the last sample (up to one interval ago): listed at once, with what
        # the binding says (name, CPUs, GPUs) and no readings yet, never "No bound jobs"
        fresh = [{"pid": r["pid"], "name": r.get("name"), "cpus": r.get("cpus"),
                  "gpus": list(r.get("gpus") or []), "not_sampled_yet": True}
                 for r in records if r.get("pid") not in sampled]
        if fresh:
            sample = {**(sample or {}), "jobs": [*((sample or {}).get("jobs") or []), *fresh]}
        if sample and sample.get("jobs") and not seen.sees_all(req.peer)[0]:
            # a sample's job has no origin: its name is a cli/run job's comm or command
            origin = {r.get("pid"): r.get("origin") for r in records}
            jobs = seen.redact(req.peer, [{**j, "origin": origin.get(j.get("pid"), "cli")}
                                          for j in sample["jobs"]])
            sample = {**sample, "jobs": [{k: v for k, v in j.items() if k != "origin"}
                                         for j in jobs]}
        return {"sample": sample, "jobs": seen.redact(req.peer, records),
                "interval": m.interval}

    async def advise(self, req: Request) -> dict[str, Any]:
        from tunerd.diagnose.advise import advise as run_rules

        m = self.monitor
        pid = req.arg("pid", int, None)
        latest = {j["pid"]: j for j in (m.latest or {}).get("jobs") or [] if "error" not in j}
        # hidepid: another user's command name, and what its environment says (the
        # rank's why, the binding findings), stay hidden, as `tunerctl jobs` does
        seen = ProcVisibility()
        hidden = self._hidden_from(seen, req.peer)
        own = {a["pid"]: a for a in seen.redact(req.peer, [
            {**a, "uid": procfs.read_uid(a["pid"]), "comm": procfs.read_comm(a["pid"])}
            for a in self.left_alone() if a.get("self_affined")])}
        if pid is not None and pid not in latest and pid in own:
            return {"jobs": [_self_affined(own[pid], self.self_pinned(pid))],
                    "interval": m.interval}
        if pid is not None and pid not in latest:
            bound = ", ".join(str(p) for p in sorted(latest)) or "none"
            raise NoSuchProcess(f"process {pid} is not a bound job (bound jobs: {bound}); "
                                "advise reads the history of jobs bound with tunerctl "
                                "bind/run or by a [[job]] rule", pid=pid)
        records = {r.get("pid"): r for r in m.job_records()}
        origin = {pid_: r.get("origin") for pid_, r in records.items()}
        out = []
        for p, job in sorted(latest.items()):
            if pid is not None and p != pid:
                continue
            with m.lock:  # the sampler thread appends to the rings
                ring = m.history.job(p)
                cols = ring.columns(ADVISE_WINDOW) if ring is not None else {}
            nics = self.gpu_nics() if job.get("gpus") else {}
            # the placer's notes (a slice too small for the rank's workers) are the record's
            expl = (records.get(p) or {}).get("explanation")
            findings = [f.to_dict() for f in run_rules(
                {**job, "gpu_nics": nics, "explanation": expl,
                 "arch": platform.machine()}, cols)]
            name = job.get("name")
            if hidden(p, job.get("uid")):
                name = name if origin.get(p) in ("rule", "worker") else HIDDEN
            if req.peer.is_root or job.get("uid") == req.peer.uid:
                # its environ and maps: /proc shows them to their owner alone, hidepid
                # or not
                findings += binding_findings(p, job)
            out.append({"pid": p, "name": name,
                        "samples": len(cols.get("time", [])), "findings": findings})
        if pid is None:
            out += [_self_affined(a, self.self_pinned(p)) for p, a in sorted(own.items())
                    if p not in latest]
        return {"jobs": out, "interval": m.interval}

    @staticmethod
    def _hidden_from(seen: ProcVisibility, peer: Any) -> Callable[[int, Any], bool]:
        """``hidden(pid, uid)``: /proc hides that process's text from ``peer``."""
        if seen.sees_all(peer)[0]:
            return lambda pid, uid: False
        return lambda pid, uid: uid != peer.uid

    async def report(self, req: Request) -> dict[str, Any]:
        """A training process reports its steps and memory (tunerd.torch.StepReporter)."""
        pid = req.arg("pid", int)
        proc = procfs.Process(pid)
        try:
            st = proc.stat()
            uids = proc.uids()
        except NoSuchProcess:
            raise NoSuchProcess(f"no process with pid {pid}", pid=pid) from None
        if not req.peer.is_root and req.peer.uid not in uids:
            raise PermissionDenied(
                f"process {pid} belongs to uid {uids[0]}; uid {req.peer.uid} may only "
                "report for its own processes", pid=pid)
        rep = parse_report(req.args, pid=pid, start_time=st.start_time)
        self.monitor.reports.put(rep)
        return {"accepted": True, "settings": self.settings_for(pid)}
