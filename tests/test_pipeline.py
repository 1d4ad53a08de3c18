"""The bind pipeline (tunerd.jobs.pipeline): its order, run for real, and its one door.

In-process, on a real loop, with real child processes and the real collaborators the
composition root gives it (registry, placer, gate, intake, actuator, state file):

- the record is on disk before the process is changed (persist, then apply);
- a bind the gate refuses holds nothing, writes nothing, changes nothing;
- nothing outside pipeline.py calls the stages' entry points (hold, prepare, persist,
  apply, record): every caller goes through ``BindPipeline``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import task_cpus
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import PermissionDenied, PlacementError
from tunerd.daemon.state import RuntimeStore
from tunerd.jobs.actuate import Actuator
from tunerd.jobs.binding import BindResult, Plan
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.gate import LeaseLimits, ReservationGate
from tunerd.jobs.intake import Intake
from tunerd.jobs.ledger import Ledger
from tunerd.jobs.peer import Peer
from tunerd.jobs.pipeline import BindPipeline, BindRequest, BindSource, Verdict
from tunerd.jobs.placer import HostCapacity, Placer, Reservation, ReservationKey
from tunerd.jobs.registry import JobRegistry
from tunerd.topology import load_topology

pytestmark = pytest.mark.root

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
ONE = frozenset({max(ONLINE)})
ROOT = Peer(pid=1, uid=0, gid=0)
NOBODY = 65534
PKG = Path(__file__).resolve().parent.parent / "tunerd"


class WatchedActuator(Actuator):
    """The real actuator; it notes what the state file held when the change began."""

    def __init__(self, state: Path) -> None:
        super().__init__()
        self.state = state
        self.on_disk_at_apply: list[dict[str, Any]] = []

    def apply(self, plan: Plan) -> BindResult:
        self.on_disk_at_apply.append(json.loads(self.state.read_text())
                                     if self.state.exists() else {})
        return super().apply(plan)


def pipeline(tmp: Path, limits: LeaseLimits | None = None
             ) -> tuple[BindPipeline, RuntimeStore, WatchedActuator]:
    state = RuntimeStore(tmp / "state.json")
    state.load()
    section: dict[str, Any] = state.section("leases")
    mover = ExclusiveMover(section.setdefault("moved", {}), state.save)
    act = WatchedActuator(state.path)
    jobs = JobRegistry(act, state.section("bindings"), state.save, Ledger(), ErrorLog(),
                       mover=mover)
    topo = load_topology(None)
    placer = Placer(topo, HostCapacity.read(), frozenset)
    intake = Intake(topo, placer.host.cpus, bound=jobs.rank_cpus, lease=placer.lease_of)
    gate = ReservationGate(lambda: limits or LeaseLimits())
    return BindPipeline(jobs, placer, gate, intake, act), state, act


def spawn(uid: int | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"],
                            preexec_fn=(lambda: os.setuid(uid)) if uid is not None else None)


def test_the_record_is_on_disk_before_the_process_is_changed(tmp_path: Path) -> None:
    async def scenario() -> None:
        pipe, _state, act = pipeline(tmp_path)
        p = spawn()
        try:
            out = await pipe.bind(BindRequest(p.pid, ROOT, BindSource.CLI, cpus=ONE))
            assert out.verdict is Verdict.BOUND and out.record is not None
            seen = act.on_disk_at_apply[0].get("bindings", {}).get(str(p.pid))
            assert seen is not None, "applied before its record was saved"
            assert seen["originals"]["process_cpus"] == format_cpulist(ONLINE)
            assert set(task_cpus(p.pid).values()) == {format_cpulist(ONE)}
        finally:
            p.kill()
            p.wait()

    asyncio.run(scenario())


def _nothing_left(pipe: BindPipeline, state: RuntimeStore, pid: int,
                  reservations: list[Reservation]) -> None:
    assert pipe.placer.reservations() == reservations  # nothing held, nothing dropped
    saved = json.loads(state.path.read_text()) if state.path.exists() else {}
    assert str(pid) not in saved.get("bindings", {})  # nothing written
    assert not pipe.jobs.is_bound(pid)
    assert set(task_cpus(pid).values()) == {format_cpulist(ONLINE)}  # nothing changed


def test_cpus_held_by_another_user_are_refused_and_nothing_is_held(tmp_path: Path) -> None:
    async def scenario() -> None:
        pipe, state, act = pipeline(tmp_path, LeaseLimits(user_exclusive=True))
        theirs = Reservation(key=ReservationKey.lease("L1"), holder="lease L1 (root)",
                             gpus=(), cpus=ONE, exclusive=True, uid=0)
        pipe.hold(theirs)
        p = spawn(NOBODY)
        try:
            peer = Peer(pid=1, uid=NOBODY, gid=NOBODY)
            with pytest.raises(PlacementError, match="held exclusively by lease L1"):
                await pipe.bind(BindRequest(p.pid, peer, BindSource.CLI, cpus=ONE,
                                            exclusive=True))
            _nothing_left(pipe, state, p.pid, [theirs])
            assert act.on_disk_at_apply == []  # never got to the change
        finally:
            p.kill()
            p.wait()

    asyncio.run(scenario())


def test_an_exclusive_bind_the_policy_refuses_holds_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        pipe, state, act = pipeline(tmp_path, LeaseLimits(user_exclusive=False))
        p = spawn(NOBODY)
        try:
            peer = Peer(pid=1, uid=NOBODY, gid=NOBODY)
            with pytest.raises(PermissionDenied, match="user_exclusive is false"):
                await pipe.bind(BindRequest(p.pid, peer, BindSource.CLI, cpus=ONE,
                                            exclusive=True))
            _nothing_left(pipe, state, p.pid, [])
            assert act.on_disk_at_apply == []
        finally:
            p.kill()
            p.wait()

    asyncio.run(scenario())


def test_a_failed_change_gives_its_hold_back(tmp_path: Path) -> None:
    """The hold is made before the change; the change fails (the process exits
    while being bound): the ledger is as it was."""
    async def scenario() -> None:
        pipe, _state, act = pipeline(tmp_path)
        p = spawn()

        def gone(plan: Plan) -> BindResult:
            p.kill()
            p.wait()
            return Actuator.apply(act, plan)

        act.apply = gone  # type: ignore[method-assign]
        with pytest.raises(Exception, match="exited"):
            await pipe.bind(BindRequest(p.pid, ROOT, BindSource.CLI, cpus=ONE,
                                        exclusive=True))
        assert pipe.placer.reservations() == []
        assert not pipe.jobs.is_bound(p.pid)

    asyncio.run(scenario())


# -- one door -------------------------------------------------------------------------
# the stages' entry points: only the pipeline calls them (the placer's hold, the
# registry's record keeping, the actuator's plan and change)
STAGE_CALLS = {"reserve", "persist", "keep", "new_record", "unpersist", "prepare",
               "read_originals"}
APPLY_OWNERS = ("actuator", "binder")  # `.apply(` on these: the change itself
DOOR = "tunerd/jobs/pipeline.py"


def stage_calls(sources: dict[str, str]) -> list[str]:
    """Calls of the stages' entry points outside the pipeline (in tunerd/jobs, daemon)."""
    out = []
    for rel, text in sorted(sources.items()):
        if rel == DOOR or not rel.startswith(("tunerd/jobs/", "tunerd/daemon/")):
            continue
        for node in ast.walk(ast.parse(text, filename=rel)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, owner = node.func.attr, ast.unparse(node.func.value).lower()
            if name in STAGE_CALLS or (name == "apply" and owner.endswith(APPLY_OWNERS)):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node.func)}(...) outside "
                           f"{DOOR}: go through BindPipeline")
    return out


SOURCES = {str(p.relative_to(PKG.parent)): p.read_text() for p in PKG.rglob("*.py")}


def test_every_bind_goes_through_the_pipeline() -> None:
    assert stage_calls(SOURCES) == []
    assert stage_calls({"tunerd/jobs/x.py": SOURCES[DOOR]})  # the check sees the calls


@pytest.mark.parametrize("planted", [
    "def f(self, res):\n    self.placer.reserve(res)\n",
    "def f(self, t, rec):\n    self.jobs.persist(rec, None, False)\n",
    "def f(self, plan):\n    self.jobs.binder.apply(plan)\n",
    "def f(self, t):\n    self.actuator.prepare(t, cpus=None)\n",
])
def test_a_bind_around_the_pipeline_is_caught(planted: str) -> None:
    assert stage_calls({"tunerd/jobs/autobind.py": planted})
    assert stage_calls({"tunerd/daemon/cmd_bind.py": planted})
