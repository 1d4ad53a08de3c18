"""JobRegistry in-process (the API other areas use): on_exit, placer, re-adoption.

The registry runs on a real asyncio loop with real pidfds and real child
processes; only the Daemon around it is reduced to the attributes it reads.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.binding_helpers import snapshot, task_cpus, thread_child
from tunerd.cpulist import parse_cpulist
from tunerd.daemon.cmd_bind import bind as bind_handler
from tunerd.daemon.jobs import JobRegistry
from tunerd.daemon.registry import Peer, Request
from tunerd.daemon.state import StateStore
from tunerd.errors import UsageError

pytestmark = pytest.mark.root

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
ONE = frozenset({max(ONLINE)})
ROOT = Peer(pid=1, uid=0, gid=0)


def make_daemon(tmp_path: Path, dry_run: bool = False) -> Any:
    state = StateStore(tmp_path / "state.json")
    state.load()
    errors: list[str] = []
    return SimpleNamespace(state=state, cfg=SimpleNamespace(dry_run=dry_run), jobs=None,
                           leases=None, errors=errors,
                           record_error=lambda src, msg: errors.append(f"{src}: {msg}"))


def test_on_exit_is_called_after_the_record_is_dropped(tmp_path: Path) -> None:
    async def scenario() -> None:
        d = make_daemon(tmp_path)
        reg = JobRegistry(d)
        assert d.jobs is reg
        await reg.start()
        seen: list[tuple[int, dict[str, Any], list[dict[str, Any]]]] = []
        done = asyncio.Event()

        def on_exit(pid: int, rec: dict[str, Any]) -> None:
            seen.append((pid, rec, reg.jobs()))
            done.set()

        reg.on_exit(on_exit)
        with thread_child(threads=4) as p:
            rec = await reg.bind(p.pid, peer=ROOT, cpus=ONE, gpus=(0,), origin="lease",
                                 name="rank0", lease="L1")
            assert (rec["origin"], rec["lease"], rec["gpus"], rec["name"]) == (
                "lease", "L1", [0], "rank0")
            assert [j["pid"] for j in reg.jobs()] == [p.pid]
            p.kill()
            await asyncio.wait_for(done.wait(), 10)
        pid, rec, jobs_then = seen[0]
        assert pid == p.pid and rec["lease"] == "L1" and jobs_then == []
        assert d.state.data["bindings"] == {}
        await reg.stop()

    asyncio.run(scenario())


def test_placer_supplies_cpus_when_no_flags_are_given(tmp_path: Path) -> None:
    async def scenario() -> None:
        d = make_daemon(tmp_path)
        reg = JobRegistry(d)
        await reg.start()
        calls: list[dict[str, Any]] = []

        async def placer(**kw: Any) -> dict[str, Any]:
            calls.append(kw)
            return {"cpus": frozenset(), "mems": frozenset(), "gpus": (3,)}

        with thread_child(threads=4) as p:
            req = Request(cmd="bind", args={"pid": p.pid}, peer=ROOT)
            with pytest.raises(UsageError, match="GPU placement is not available"):
                await bind_handler(d, req)
            reg.placer = placer
            # a placement without CPUs is an error naming it, and nothing changes
            before = snapshot(p.pid)
            with pytest.raises(UsageError, match="GPU placement gave no CPUs"):
                await bind_handler(d, Request(cmd="bind", args={"pid": p.pid, "gpus": "3",
                                                                "exclusive": True}, peer=ROOT))
            assert snapshot(p.pid) == before
            assert calls == [{"pid": p.pid, "peer": ROOT, "gpus": (3,), "exclusive": True}]

            async def good_placer(**kw: Any) -> dict[str, Any]:
                calls.append(kw)
                return {"cpus": ONE, "mems": frozenset(), "gpus": (3,)}

            reg.placer = good_placer
            r = await bind_handler(d, Request(cmd="bind", args={"pid": p.pid}, peer=ROOT))
            assert calls[-1]["gpus"] is None
            assert r["gpus"] == [3] and r["cpus"] == ",".join(map(str, sorted(ONE)))
            assert r["mems"] is None  # an empty mems from the placer: memory left alone
            assert set(task_cpus(p.pid).values()) == {r["cpus"]}
        await reg.stop()

    asyncio.run(scenario())


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        d = make_daemon(tmp_path, dry_run=True)
        reg = JobRegistry(d)
        await reg.start()
        with thread_child(threads=4) as p:
            before = snapshot(p.pid)
            r = await reg.bind(p.pid, peer=ROOT, cpus=ONE, nofile=2000)
            assert r["dry_run"] is True and "dry run: nothing was changed" in r["notes"]
            assert snapshot(p.pid) == before and reg.jobs() == []
        await reg.stop()

    asyncio.run(scenario())


def test_status_and_default_nofile(tmp_path: Path) -> None:
    d = make_daemon(tmp_path)
    d.policy = SimpleNamespace(data={"limits": {"nofile": 65536}})
    reg = JobRegistry(d)
    assert reg.status() == {"summary": "0 processes bound", "bound": 0, "pids": []}
    assert reg.default_nofile() == 65536
    d.policy = SimpleNamespace(data={"limits": {}})
    assert reg.default_nofile() is None
