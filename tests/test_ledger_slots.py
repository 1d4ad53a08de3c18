"""A process's entries in the rules' memory, the external holds and the scope's
verdicts are slots of its one record in the node's ledger, and go with it when it exits
(issue 33 item 6): nothing of it is left in any map once it has ended.

Real processes this test starts (a bash wrapper, a real torchrun whose rank pinned
itself through taskset, a process whose bind failed), read by the real intake and
matched by a real rule set, on the real services sharing one ledger; only the GPU
topology is a recording.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, wait_for
from tests.leases_helpers import autobind_status, descendants, kill, kill_tree
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.errorlog import ErrorLog
from tunerd.jobs.external import EXTERNAL, ExternalHolds
from tunerd.jobs.intake import Intake, Role
from tunerd.jobs.ledger import Ledger, Slot
from tunerd.jobs.placer import HostCapacity, Placer
from tunerd.jobs.rulememory import (
    FAILED,
    LEFT_ALONE,
    SELF_AFFINED,
    SETTLED,
    WRAPPED,
    WRAPPER,
    RuleMemory,
)
from tunerd.jobs.scope import IN_SCOPE, ProcessScope
from tunerd.topology import load_topology
from tunerd.watch.rules import JobRule, RuleSet

TWO_GPUS = Path(__file__).parent / "fixtures" / "topologies" / "this-machine-2gpus.json"
HOST_CPUS = frozenset(os.sched_getaffinity(0))
needs = pytest.mark.skipif(not {0, 1} <= HOST_CPUS or shutil.which("taskset") is None,
                           reason="needs CPUs 0-1 and taskset")
SLEEP = "import time; time.sleep(120)  # {token}"
SLOTS: tuple[Slot[Any], ...] = (LEFT_ALONE, SELF_AFFINED, SETTLED, FAILED, WRAPPED,
                                WRAPPER, EXTERNAL, IN_SCOPE)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _held(ledger: Ledger, pids: set[int]) -> list[str]:
    """Every slot entry of ``pids`` the ledger still has (none is the point)."""
    return [f"{slot.name}: pid {k.pid}" for slot in SLOTS for k, _ in ledger.each(slot)
            if k.pid in pids]


async def _gone(ledger: Ledger, pids: set[int], timeout: float = 15.0) -> None:
    """Wait on the loop (the ledger's exit callbacks run there) until no record of
    ``pids`` is left."""
    deadline = time.monotonic() + timeout
    while any(ledger.key(p) is not None for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = {p: ledger.key(p) for p in pids if ledger.key(p) is not None}
    assert not left, f"records left after exit: {left}; slots: {_held(ledger, pids)}"


def _torchrun(token: str, *wrap: str) -> subprocess.Popen[bytes]:
    """A real torchrun job of one rank on GPU 0, exec'd through ``wrap``."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "1", "--no-python", *wrap, sys.executable, "-c", SLEEP.format(token=token)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0", "TUNERD_TEST_TOKEN": token},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _rank_of(agent: subprocess.Popen[bytes], token: str) -> int:
    """The pid of torchrun's rank (once the wrapper exec'd python)."""
    def find() -> int | None:
        return next((p for p in descendants(agent.pid)
                     if f"# {token}" in (c := _cmdline(p)) and c.startswith(sys.executable)),
                    None)
    return wait_for(find, 60, "torchrun's rank")


@needs
def test_every_entry_of_a_process_goes_with_it() -> None:
    """A wrapper an explicit rule matched (left alone, its match remembered for what it
    runs), torchrun's agent (a launcher: left alone), its rank that pinned itself through
    taskset (left alone, self-affined, held as an external owner of CPU 1, saved in the
    runtime state) and a process whose bind failed: each listed while it runs; once they
    exit, no record of them is left in the ledger, none is listed as left alone, the
    external hold and its saved image are gone, and the failure's error is resolved."""
    token = secrets.token_hex(6)
    wrapper = subprocess.Popen(["bash", "-c", f"sleep 120; : {token}"])
    agent = _torchrun(token, "taskset", "-c", "1")
    failing = subprocess.Popen(["sleep", "120"])
    kids: list[int] = []
    try:
        kids = wait_for(lambda: descendants(wrapper.pid), 10, "the wrapper's sleep")
        rank = _rank_of(agent, token)
        kids += descendants(agent.pid)
        asyncio.run(_run(wrapper.pid, agent.pid, rank, failing.pid, kids[0], token))
    finally:
        for p in (wrapper, agent, failing):
            kill(p)
        for k in kids:
            try:
                os.kill(k, 9)
            except ProcessLookupError:
                pass


async def _run(wrapper: int, agent: int, rank: int, failing: int, wrapped_kid: int,
               token: str) -> None:
    ledger = Ledger()
    ledger.attach()
    topo = load_topology(TWO_GPUS)
    intake = Intake(topo, HOST_CPUS, bound=lambda pid: None, lease=lambda pid: None)
    errors = ErrorLog()
    memory = RuleMemory(ledger, errors)
    placer = Placer(topo, HostCapacity(HOST_CPUS), frozenset)
    state: dict[str, Any] = {}
    saves: list[int] = []
    external = ExternalHolds(placer, ledger, state, lambda: saves.append(1))
    scope = ProcessScope(os.getpid(), ledger=ledger)
    rules = RuleSet([JobRule(name="wrapped", cmdline=(f"*{token}*",))])
    roles = {wrapper: Role.WRAPPER, agent: Role.LAUNCHER, rank: Role.RANK}
    for pid, role in roles.items():  # as the rules' binder does with what it leaves alone
        m = rules.match(pid)
        assert m is not None and scope.admits(pid), pid
        ctx = intake.describe(pid)
        assert ctx.role == role, ctx
        memory.wrap(m, ctx)
        memory.leave_alone(ctx)
        memory.settle(ctx)
        if pid == rank:
            assert ctx.self_affined, ctx
            assert external.hold(ctx, memory.placed_by(ctx)) is not None
    memory.remember_failure(failing)
    errors.record("autobind", "bind failed", key=failing)

    listed = {a["pid"]: a["self_affined"] for a in memory.left_alone_now()}
    assert listed == {wrapper: False, agent: False, rank: True}
    assert memory.anyone_left_alone() and memory.is_settled(wrapper)
    assert memory.set_own_cpus(rank) and not memory.set_own_cpus(wrapper)
    assert memory.failed_before(failing) and memory.wrapping()
    got = memory.wrapped_match(wrapped_kid)  # what the wrapper runs is the rule's match
    assert got is not None and got.rule.name == "wrapped" and got.pid == wrapped_kid
    assert list(state) == [str(rank)] and [r.pid for r in placer.external_holds()] == [rank]
    assert scope.contains(wrapped_kid)

    pids = {wrapper, agent, rank, failing}
    for pid in pids:
        os.kill(pid, 9)
    await _gone(ledger, pids)
    assert _held(ledger, pids) == []
    assert memory.left_alone_now() == [] and not memory.anyone_left_alone()
    assert not memory.failed_before(failing) and not memory.is_settled(wrapper)
    assert state == {} and placer.external_holds() == [] and saves == [1, 1]
    assert errors.to_json()["open_count"] == 0  # the failure resolved itself at its exit


def _shown(d: DaemonProc, rank: int) -> dict[str, Any]:
    """What the daemon shows of ``rank``: listed as left alone, held as an external
    owner (``jobs``), saved in the runtime state."""
    r = d.ctl("--json", "jobs")
    assert r.rc == 0, r.err
    saved = json.loads((d.runtime_dir / "state.json").read_text()).get("external") or {}
    return {"left_alone": [a for a in autobind_status(d).get("left_alone", [])
                           if a["pid"] == rank],
            "external": [x for x in r.json().get("external") or [] if x["pid"] == rank],
            "saved": {k: v for k, v in saved.items() if k == str(rank)}}


@needs
@pytest.mark.skipif(shutil.which("numactl") is None or os.geteuid() != 0,
                    reason="needs root and numactl")
def test_the_daemon_forgets_a_self_pinned_rank_everywhere_at_its_exit(
        daemon_factory, tmp_path: Path) -> None:
    """The real daemon and its one ledger: torchrun's rank exec'd through ``numactl
    --physcpubind=1`` is listed as left alone, held as an external owner of CPU 1 and
    saved in the runtime state while it runs; once it exits, in none of these."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(TWO_GPUS)]).start()
    job = _torchrun(token, "numactl", "--physcpubind=1")
    try:
        rank = _rank_of(job, token)
        def everywhere() -> dict[str, Any] | None:
            now = _shown(d, rank)
            return now if all(now.values()) else None
        shown = wait_for(everywhere, 30, "the rank listed, held and saved", detail=d.log)
        assert shown["left_alone"][0]["self_affined"] is True, shown
        assert shown["external"][0]["placed_by"] == "numactl", shown
        assert shown["saved"][str(rank)]["cpus"] == "1", shown
        kids = descendants(job.pid)
        kill_tree(job)
        assert rank in kids
        wait_for(lambda: not any(_shown(d, rank).values()), 15,
                 "the rank forgotten at its exit",
                 detail=lambda: f"{_shown(d, rank)}\n{d.log()}")
    finally:
        kill_tree(job)
