"""The lower items of issue 28 (found 10): bounded reads and views."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.leases_helpers import kill

pytestmark = pytest.mark.root


def test_a_parents_environment_is_read_as_capped_as_the_ranks_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The watcher read a rank's parent's environment up to 1 MiB at real-time priority
    (64 KiB for the rank's own)."""
    from tunerd.adapters import procfs
    from tunerd.jobs import intake as intake_mod
    from tunerd.topology import load_topology
    from tunerd.watch.rules import ENVIRON_MATCH_BYTES

    big = {**os.environ, "LOCAL_RANK": "0", **{f"PAD{i}": "x" * (90 << 10) for i in range(10)}}
    parent = subprocess.Popen(["sh", "-c", 'LOCAL_RANK=0 sleep 300 & wait'], env=big)
    try:
        import time

        for _ in range(100):
            kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            if kids:
                break
            time.sleep(0.05)
        child = int(kids[0])
        asked: list[tuple[int, int]] = []
        real = procfs.read_environ_view

        def spy(pid: int, proc: str = procfs.PROC, limit: int = procfs.ARG_READ_MAX
                ) -> Any:
            asked.append((pid, limit))
            return real(pid, proc, limit)

        monkeypatch.setattr(procfs, "read_environ_view", spy)
        it = intake_mod.Intake(load_topology(None), frozenset(os.sched_getaffinity(0)),
                               bound=lambda pid: None, lease=lambda pid: None)
        it.describe(child, quick=True)
        parents = [lim for pid, lim in asked if pid == parent.pid]
        assert parents and max(parents) <= ENVIRON_MATCH_BYTES, asked
    finally:
        kill(parent)


def test_ordinary_binds_have_a_per_user_cap(daemon_factory, tmp_path: Path,
                                            unpriv_user: tuple[int, int]) -> None:
    """6,000 binds of one user made a 2.5 MB state file at ~11 ms per bind: no count."""
    from tests.security_helpers import ctl_as, spawn_as

    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("max_binds_per_user = 3\n")
    d = daemon_factory(args=["--config", str(cfg)]).start()
    procs = [spawn_as(unpriv_user, ["sleep", "300"]) for _ in range(5)]
    try:
        rcs = [ctl_as(unpriv_user, d.socket, "bind", str(p.pid), "--cpus", "0")
               for p in procs[:4]]
        assert [r.returncode for r in rcs] == [0, 0, 0, 4], [(r.returncode, r.stderr)
                                                             for r in rcs]
        assert "max_binds_per_user = 3" in rcs[3].stderr
        # a re-bind replaces its record; after an unbind there is room again
        assert ctl_as(unpriv_user, d.socket, "bind", str(procs[0].pid), "--cpus",
                      "0").returncode == 0
        assert ctl_as(unpriv_user, d.socket, "unbind", str(procs[1].pid)).returncode == 0
        assert ctl_as(unpriv_user, d.socket, "bind", str(procs[4].pid), "--cpus",
                      "0").returncode == 0
        assert d.ctl("bind", str(procs[3].pid), "--cpus", "0").rc == 0  # root: no cap
    finally:
        for p in procs:
            kill(p)


def test_status_gives_rank_pids_and_exec_times_to_their_owner_only(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    """`status` gave every user other users' rank PIDs with their exec times to the
    nanosecond (services.autobind.bound, timeline_ns)."""
    import json

    from tests.helpers import wait_for, write_policy
    from tests.leases_helpers import open_path_for_others, unique_sleeper
    from tests.security_helpers import ctl_as, spawn_as

    exe = unique_sleeper(tmp_path, f"rank_pid_{os.getpid()}")
    open_path_for_others(tmp_path)
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", f'[policy]\nname = "t"\n[[job]]\nname = "r"\n'
                                 f'match.cmdline = ["*{exe.name}*"]\ncpus = "0"\n')
    d = daemon_factory(policy_dir=pol).start()
    roots = subprocess.Popen([str(exe), "300"])
    hers = spawn_as(unpriv_user, [str(exe), "301"])
    try:
        def bound() -> list[Any]:
            return d.ctl("--json", "status").json()["services"]["autobind"]["bound"]

        wait_for(lambda: len(bound()) == 2, 15, "both bound", detail=d.log)
        assert {b["pid"] for b in bound()} == {roots.pid, hers.pid}  # root sees all
        r = ctl_as(unpriv_user, d.socket, "--json", "status")
        assert r.returncode in (0, 1), r.stderr
        auto = json.loads(r.stdout)["services"]["autobind"]
        assert {b["pid"] for b in auto["bound"]} == {hers.pid, None}, auto["bound"]
        assert all(t[0] == hers.pid for t in auto["timeline_ns"]), auto["timeline_ns"]
        assert str(roots.pid) not in json.dumps(auto)
    finally:
        kill(roots)
        kill(hers)


def _pb(num: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    def varint(n: int) -> bytes:
        out = b""
        while True:
            b, n = n & 0x7F, n >> 7
            out += bytes([b | (0x80 if n else 0)])
            if not n:
                return out
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def test_a_hostile_kubelet_answer_is_capped_before_it_costs() -> None:
    """A kubelet answer under gRPC's 4 MiB cost 6.6-9.7 s of decoding and ~120 MB in the
    exec watcher's real-time thread."""
    import time

    from tunerd.jobs.podresources import MAX_ANSWER, DecodeError, decode_list

    packed = bytes(range(1, 128)) * 33_000  # ~4 MiB of one-byte CPU ids
    container = _pb(1, b"c") + _pb(3, packed)
    huge = _pb(1, _pb(1, b"pod") + _pb(2, b"ns") + _pb(3, container))
    t0 = time.monotonic()
    with pytest.raises(DecodeError, match="more than"):
        decode_list(huge)
    assert time.monotonic() - t0 < 0.05
    # within the size cap, many tiny pods or too many ids are refused as they are read
    many = _pb(1, _pb(1, b"p")) * (MAX_ANSWER // 5)
    t0 = time.monotonic()
    with pytest.raises(DecodeError, match="more than"):
        decode_list(many)
    ids = _pb(1, _pb(1, b"p") + _pb(3, _pb(1, b"c") + _pb(3, bytes([5]) * (MAX_ANSWER - 64))))
    with pytest.raises(DecodeError, match="more than"):
        decode_list(ids)
    assert time.monotonic() - t0 < 2.0
    # a real answer still decodes
    ok = _pb(1, _pb(1, b"train-0") + _pb(2, b"default")
             + _pb(3, _pb(1, b"main") + _pb(3, bytes(range(0, 64)))))
    [pod] = decode_list(ok)
    assert pod.name == "train-0" and pod.containers[0].cpu_ids == frozenset(range(64))


def test_the_kubelet_is_asked_below_real_time_priority(tmp_path: Path) -> None:
    """The watcher's thread (SCHED_FIFO) decoded the kubelet's answer at real-time
    priority: a List is waited for and decoded at SCHED_OTHER, then FIFO again."""
    import threading

    from tunerd.jobs.podresources import PodResourcesSource

    seen: list[int] = []
    after: list[int] = []
    src = PodResourcesSource(tmp_path / "none.sock")

    def call(method: str) -> bytes:
        seen.append(os.sched_getscheduler(0))
        return b""

    src._call = call  # type: ignore[method-assign]

    def rt() -> None:  # this test's own thread, for a moment
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        try:
            src._list()
            after.append(os.sched_getscheduler(0))
        finally:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))

    t = threading.Thread(target=rt)
    t.start()
    t.join(10)
    assert seen == [os.SCHED_OTHER], seen
    assert after == [os.SCHED_FIFO]
