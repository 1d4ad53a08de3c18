"""JobRegistry and the bind handler in-process, built as the composition root builds them.

The registry runs on a real asyncio loop with real pidfds and real child
processes, with its real collaborators: a Binder, a Ledger, an ErrorLog, a
state file, and for `bind` without flags the real Placer on a recorded topology.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import CPUSET_ROOT, scratch_cpuset, snapshot, task_cpus, thread_child
from tests.leases_helpers import snapshot_with_gpus_here
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import UsageError
from tunerd.daemon.cmd_bind import BindCommands, bind_reply
from tunerd.daemon.router import Peer, Request
from tunerd.daemon.state import RuntimeStore
from tunerd.jobs.actuate import Binder
from tunerd.jobs.binding import Plan, Target
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.gate import ReservationGate
from tunerd.jobs.intake import Intake
from tunerd.jobs.leases import LeaseLimits, LeaseService
from tunerd.jobs.ledger import Ledger
from tunerd.jobs.pipeline import BindPipeline, BindRequest, BindSource
from tunerd.jobs.placement import Placement
from tunerd.jobs.placer import HostCapacity, Placer
from tunerd.jobs.records import Binding
from tunerd.jobs.registry import JobRegistry
from tunerd.topology import load_topology

pytestmark = pytest.mark.root

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
ONE = frozenset({max(ONLINE)})
ROOT = Peer(pid=1, uid=0, gid=0)


class Parts:
    """The registry and what the composition root gives it (tunerd.daemon.wiring)."""

    def __init__(self, tmp: Path, dry_run: bool = False, topology: Path | None = None,
                 binder: Binder | None = None) -> None:
        self.state = RuntimeStore(tmp / "state.json")
        self.state.load()
        self.errors = ErrorLog()
        self.ledger = Ledger()
        section: dict[str, Any] = self.state.section("leases")
        section.setdefault("moved", {})
        self.mover = ExclusiveMover(section["moved"], self.state.save)
        self.jobs = JobRegistry(binder or Binder(), self.state.section("bindings"), self.state.save,
                                self.ledger, self.errors, dry_run=dry_run, mover=self.mover)
        topo = load_topology(topology)
        self.placer = Placer(topo, HostCapacity.read(), frozenset, dry_run=dry_run)
        self.intake = Intake(topo, self.placer.host.cpus, bound=self.jobs.rank_cpus,
                             lease=self.placer.lease_of)
        self.pipeline = BindPipeline(self.jobs, self.placer, ReservationGate(LeaseLimits),
                                     self.intake, self.jobs.binder)
        self.leases = LeaseService(self.pipeline, self.ledger, self.mover, section,
                                   self.state.save, self.errors,
                                   limits=LeaseLimits, default_nofile=lambda: None)
        self.bind_cmds = BindCommands(self.pipeline, self.leases)

    async def bind(self, pid: int, placement: Placement, *,
                   source: BindSource = BindSource.CLI, **kw: Any) -> dict[str, Any]:
        """A bind as its handler replies it, through the pipeline."""
        out = await self.pipeline.bind(BindRequest(pid, ROOT, source, placement=placement,
                                                   **kw))
        return bind_reply(out)

    def saved(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.state.path.read_text())
        return data


def test_on_exit_is_called_after_the_record_is_dropped(tmp_path: Path) -> None:
    async def scenario() -> None:
        parts = Parts(tmp_path)
        reg = parts.jobs
        await reg.start()
        seen: list[tuple[int, Binding, list[dict[str, Any]]]] = []
        done = asyncio.Event()

        def on_exit(pid: int, rec: Binding) -> None:
            seen.append((pid, rec, reg.jobs()))
            done.set()

        reg.on_exit(on_exit)
        with thread_child(threads=4) as p:
            rec = await parts.bind(p.pid, Placement(cpus=ONE, mems=None, gpus=(0,)),
                                   source=BindSource.LEASE, name="rank0", lease="L1")
            assert (rec["origin"], rec["lease"], rec["gpus"], rec["name"]) == (
                "run", "L1", [0], "rank0")
            # saved (with the originals) before the process was touched
            assert str(p.pid) in parts.saved()["bindings"]
            live = reg.jobs()
            assert [j["pid"] for j in live] == [p.pid] and live[0]["threads"] == 5
            p.kill()
            await asyncio.wait_for(done.wait(), 10)
        pid, rec, jobs_then = seen[0]
        assert pid == p.pid and rec.lease == "L1" and jobs_then == []
        assert parts.state.data["bindings"] == {}
        await reg.stop()
        assert parts.saved()["bindings"] == {}

    asyncio.run(scenario())


def test_ledger_calls_every_key_once_and_refuses_another_start_time() -> None:
    async def scenario() -> None:
        from tunerd.adapters.procfs import read_start_time

        watch = Ledger()
        called: list[str] = []
        done = asyncio.Event()

        def cb(key: str) -> Any:
            def fire(pid: int) -> None:
                called.append(key)
                done.set()
            return fire

        with thread_child(threads=1) as p:
            start = read_start_time(p.pid)
            assert start is not None
            assert watch.watch(p.pid, start, "a", cb("a"))
            assert watch.watch(p.pid, start, "b", cb("b"))  # the same process: no new fd
            assert watch.watch(p.pid, None, "c", cb("c"))
            assert not watch.watch(p.pid, start + 1, "d", cb("d"))  # another process
            watch.unwatch(p.pid, "c")
            p.kill()
            await asyncio.wait_for(done.wait(), 10)
            await asyncio.sleep(0.05)
            assert sorted(called) == ["a", "b"]
            p.wait()
            assert not watch.watch(p.pid, start, "e", cb("e"))  # gone

    asyncio.run(scenario())


def test_bind_without_flags_places_near_the_gpu_it_uses(tmp_path: Path) -> None:
    snap, _lo, hi = snapshot_with_gpus_here(tmp_path / "snap.json")

    async def scenario() -> None:
        parts = Parts(tmp_path, topology=snap)
        await parts.jobs.start()
        with thread_child(threads=4) as p:
            before = snapshot(p.pid)
            # a process with no GPU in its environment and none given: a usage error
            with pytest.raises(UsageError, match="GPU placement is not available"):
                await parts.bind_cmds.bind(Request("bind", {"pid": p.pid}, ROOT))
            assert snapshot(p.pid) == before
            # an unknown GPU is named
            with pytest.raises(UsageError, match="GPU 7: not on this node"):
                await parts.bind_cmds.bind(Request("bind", {"pid": p.pid, "gpus": "7"}, ROOT))
            r = await parts.bind_cmds.bind(Request("bind", {"pid": p.pid, "gpus": "1"}, ROOT))
            assert r["gpus"] == [1] and r["cpus"] == str(hi)
            assert r["mems"] is None  # every memory node of the machine: no binding
            assert set(task_cpus(p.pid).values()) == {str(hi)}
            assert "GPUs from --gpus" in str(getattr(parts.jobs.record(p.pid), "explanation", ""))
        await parts.jobs.stop()

    asyncio.run(scenario())


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        parts = Parts(tmp_path, dry_run=True)
        reg = parts.jobs
        await reg.start()
        with thread_child(threads=4) as p:
            before = snapshot(p.pid)
            r = await parts.bind(p.pid, Placement(cpus=ONE, mems=None), nofile=2000)
            assert r["dry_run"] is True and "dry run: nothing was changed" in r["notes"]
            assert snapshot(p.pid) == before and reg.jobs() == []
        await reg.stop()

    asyncio.run(scenario())


def test_partial_bind_keeps_the_cpus_when_the_fd_limit_cannot_be_set(tmp_path: Path) -> None:
    """Without CAP_SYS_RESOURCE a hard limit cannot be raised: the CPUs are bound anyway."""
    if Binder().has_cap_sys_resource():
        pytest.skip("this daemon may raise hard limits: nothing to leave out")

    async def scenario() -> None:
        parts = Parts(tmp_path)
        reg = parts.jobs
        await reg.start()
        with thread_child(threads=4) as p:
            import resource

            hard = resource.prlimit(p.pid, resource.RLIMIT_NOFILE)[1]
            # all or nothing for an explicit request...
            with pytest.raises(Exception, match="CAP_SYS_RESOURCE"):
                await parts.bind(p.pid, Placement(cpus=ONE, mems=None), nofile=hard + 1)
            assert reg.jobs() == []
            # ...partial for rule and lease binds: CPUs bound, the limit left out, a note
            r = await parts.bind(p.pid, Placement(cpus=ONE, mems=None), nofile=hard + 1,
                                 source=BindSource.WORKER)
            assert r["cpus"] == format_cpulist(ONE)
            assert set(task_cpus(p.pid).values()) == {format_cpulist(ONE)}
            assert any("fd limit not set" in n and "CAP_SYS_RESOURCE" in n for n in r["notes"])
            assert resource.prlimit(p.pid, resource.RLIMIT_NOFILE)[1] == hard
        await reg.stop()

    asyncio.run(scenario())


@pytest.mark.skipif(not (CPUSET_ROOT / "cpuset.cpus").exists(), reason="needs cgroup v1")
def test_a_memory_node_step_left_out_is_not_kept_in_the_saved_originals(
        tmp_path: Path) -> None:
    """A partial bind whose child cpuset cannot be made saves originals without it, so
    a later plain re-bind and the unbind do not look for the removed cgroup."""

    class FailingCpuset(Binder):
        """Asks the kernel for a child cpuset on a CPU that does not exist (EINVAL)."""

        def prepare(self, t: Target, **kw: Any) -> Plan:
            plan = super().prepare(t, **kw)
            if plan.cpuset is not None:
                plan.cpuset_cpus = frozenset({4000})
            return plan

    async def scenario() -> None:
        parts = Parts(tmp_path, binder=FailingCpuset())
        reg = parts.jobs
        await reg.start()
        with scratch_cpuset(format_cpulist(ONLINE)) as parent, \
                thread_child(threads=4, cgroup=parent) as p:
            r = await parts.bind(p.pid, Placement(cpus=ONE, mems=frozenset({0})),
                                 source=BindSource.WORKER)
            assert r["mems"] is None
            assert any(n.startswith("memory nodes 0 not set") for n in r["notes"])
            saved = parts.state.data["bindings"][str(p.pid)]["originals"]  # saved soon
            assert saved["cpuset_child"] is None and saved["cpuset_base"] is None
            assert [d for d in parent.iterdir() if d.is_dir()] == []
            r = await parts.bind(p.pid, Placement(cpus=ONE, mems=None))
            assert r["rebind"] is True and r["cpus"] == format_cpulist(ONE)
            out = await reg.unbind(p.pid, peer=ROOT)
            assert not any("pages moved by --mems" in n for n in out["notes"]), out
        await reg.stop()

    asyncio.run(scenario())


def test_status(tmp_path: Path) -> None:
    parts = Parts(tmp_path)
    assert parts.jobs.status() == {"summary": "0 processes bound", "bound": 0, "pids": [],
                                   "ledger": {"records": 0, "pidfds": 0, "pidfds_opened": 0,
                                              "slots": {}}}
