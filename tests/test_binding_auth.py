"""Who may bind what: the real unprivileged user against the real daemon.

The peer's identity comes from SO_PEERCRED, so these tests talk to the daemon
from a forked child that really dropped to the test user (helpers.run_as).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import reap, snapshot, task_cpus, thread_child, user_thread_child
from tests.helpers import DaemonProc, run_as, write_policy
from tunerd.base.cpulist import parse_cpulist
from tunerd.base.errors import PermissionDenied, TunerdError
from tunerd.wire.client import Client
from tunerd.wire.protocol import ExitCode, exit_code

pytestmark = pytest.mark.root

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
ONE = str(max(ONLINE))


@pytest.fixture
def open_daemon() -> Iterator[DaemonProc]:
    """A daemon whose socket other users can reach (pytest's tmp dirs are root-only)."""
    base = Path(tempfile.mkdtemp(prefix="tunerd-bind-auth-", dir="/tmp"))
    os.chmod(base, 0o755)
    write_policy(base / "policies", "00.toml", '[policy]\nname = "t"\n')
    d = DaemonProc(tmp=base, policy_dir=base / "policies")
    try:
        yield d.start()
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def has_cap_sys_resource() -> bool:
    status = Path("/proc/self/status").read_text()
    cap_eff = next(x for x in status.splitlines() if x.startswith("CapEff:"))
    return bool(int(cap_eff.split()[1], 16) >> 24 & 1)


def call(sock: str, cmd: str, args: dict[str, Any] | None = None) -> Any:
    with Client(sock) as c:
        return c.call(cmd, **(args or {}))


def cli(sock: str, *argv: str) -> int:
    from tunerd.cli.main import main

    return main(["--socket", sock, *argv])


def test_user_binds_its_own_process(open_daemon: DaemonProc,
                                    unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    sock = str(open_daemon.socket)
    pid = user_thread_child(uid, gid, threads=8)
    try:
        before = snapshot(pid)
        r = run_as(uid, gid, call, sock, "bind", {"pid": pid, "cpus": ONE})
        assert r["pid"] == pid and r["uid"] == uid and r["threads"] == 9
        assert set(task_cpus(pid).values()) == {ONE}
        jobs = run_as(uid, gid, call, sock, "jobs")["jobs"]
        assert [j["pid"] for j in jobs] == [pid]
        st = run_as(uid, gid, call, sock, "status")
        assert st["services"]["jobs"]["bound"] == 1
        assert run_as(uid, gid, cli, sock, "unbind", str(pid)) == 0
        assert snapshot(pid) == before
    finally:
        reap(pid)


def test_user_may_not_bind_a_root_process(open_daemon: DaemonProc,
                                          unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    sock = str(open_daemon.socket)
    with thread_child(threads=8) as p:
        before = snapshot(p.pid)
        with pytest.raises(PermissionDenied) as exc:
            run_as(uid, gid, call, sock, "bind", {"pid": p.pid, "cpus": ONE})
        assert exit_code(exc.value) == ExitCode.PERMISSION
        assert f"process {p.pid} belongs to uid 0; uid {uid} may only act" in exc.value.message
        assert run_as(uid, gid, cli, sock, "bind", str(p.pid), "--cpus", ONE) == 4
        assert snapshot(p.pid) == before
        # nor unbind what root bound
        assert open_daemon.ctl("bind", str(p.pid), "--cpus", ONE).rc == 0
        assert run_as(uid, gid, cli, sock, "unbind", str(p.pid)) == 4
        assert set(task_cpus(p.pid).values()) == {ONE}


def test_nofile_on_another_users_process_is_a_clear_eperm(
        open_daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    """tunerd lacks CAP_SYS_RESOURCE here: prlimit on another uid fails, nothing changes."""
    if has_cap_sys_resource():
        pytest.skip("this root has CAP_SYS_RESOURCE: prlimit on other users works")
    uid, gid = unpriv_user
    sock = str(open_daemon.socket)
    pid = user_thread_child(uid, gid, threads=4)
    try:
        before = snapshot(pid)
        for peer in ("user", "root"):
            if peer == "user":
                with pytest.raises(PermissionDenied) as exc:
                    run_as(uid, gid, call, sock, "bind",
                           {"pid": pid, "cpus": ONE, "nofile": 4096})
                msg = exc.value.message
            else:
                r = open_daemon.ctl("bind", str(pid), "--cpus", ONE, "--nofile", "4096")
                assert r.rc == 4
                msg = r.err
            assert f"prlimit on pid {pid} (uid {uid}) failed: EPERM" in msg
            assert "CAP_SYS_RESOURCE" in msg
            assert snapshot(pid) == before  # the CPUs were not bound either
    finally:
        reap(pid)


def test_bind_cpus_passes_the_gate_of_exclusive_holds(open_daemon: DaemonProc,
                                                      unpriv_user: tuple[int, int]) -> None:
    """`bind --cpus LIST` onto CPUs root's exclusive lease holds: refused for a user
    (exit 1, naming the lease, nothing changed), done for root (its own lease); CPUs no
    one holds stay the user's to choose."""
    uid, gid = unpriv_user
    sock = str(open_daemon.socket)
    lease = open_daemon.ctl("--json", "alloc", "--cpus", f"{ONE}-{ONE}", "--exclusive")
    assert lease.rc == 0, lease.err
    pid = user_thread_child(uid, gid, threads=2)
    mine = thread_child(threads=2)
    try:
        before = snapshot(pid)
        with pytest.raises(TunerdError, match=rf"CPU {ONE} held exclusively by lease L\d+ "
                                              r"\(root") as err:
            run_as(uid, gid, call, sock, "bind", {"pid": pid, "cpus": ONE})
        assert exit_code(err.value) == ExitCode.FAILED
        assert snapshot(pid) == before
        others = sorted(ONLINE - {int(ONE)})
        if others:  # a CPU no lease holds: as asked
            run_as(uid, gid, call, sock, "bind", {"pid": pid, "cpus": str(others[0])})
            assert set(task_cpus(pid).values()) == {str(others[0])}
        with mine as p:  # root's process into root's own lease: as asked
            call(sock, "bind", {"pid": p.pid, "cpus": ONE})
            assert set(task_cpus(p.pid).values()) == {ONE}
    finally:
        reap(pid)
