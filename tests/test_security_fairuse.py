"""What one local user must not be able to do to everyone else (issue 9, found 2, 4, 5).

Each test replays an attack with the real test user: lease fair use ([leases]
user_exclusive, max_per_user, alloc_ttl), release of another user's tag, an
exclusive lease plus a bind that stripped a CPU for good. (The monitor's FIFO freeze,
found 5, is covered by tests/test_monitor_daemon.py: the daemon opens no file in a
directory a user may write, so there is nowhere left to plant one.)
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, run_as, wait_for, write_policy
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errors import TunerdError
from tunerd.wire.client import Client

pytestmark = pytest.mark.root

ONLINE = sorted(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))


def call(sock: str, cmd: str, args: dict[str, Any]) -> Any:
    with Client(sock, timeout=30) as c:
        return c.call(cmd, **args)


def try_call(sock: str, cmd: str, args: dict[str, Any]) -> tuple[bool, str]:
    try:
        call(sock, cmd, args)
    except TunerdError as err:
        return False, f"{type(err).__name__}: {err.message}"
    return True, ""


def test_user_cannot_take_every_cpu_exclusively(daemon: DaemonProc,
                                                unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    ok, user_why = run_as(uid, gid, try_call, str(daemon.socket), "alloc",
                          {"ncpus": len(ONLINE), "exclusive": True})
    root_ok, why = try_call(str(daemon.socket), "alloc", {"ncpus": 1})
    assert root_ok, f"root's alloc failed after a user's exclusive lease: {why}"
    assert not ok, "a non-root user took an exclusive lease the policy does not allow"
    # refused for the policy's reason, not for a malformed request
    assert user_why.startswith("PermissionDenied: ") and "user_exclusive" in user_why, user_why


def test_user_lease_count_is_limited(daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user

    def many(sock: str) -> tuple[int, str]:
        made = 0
        with Client(sock, timeout=30) as c:
            for _ in range(80):
                try:
                    c.call("alloc", ncpus=1)
                except TunerdError as err:
                    return made, err.message
                made += 1
        return made, ""

    made, why = run_as(uid, gid, many, str(daemon.socket))
    assert made == 64 and "64" in why, (made, why)


def test_release_of_another_users_tag_is_an_error(daemon: DaemonProc,
                                                  unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    call(str(daemon.socket), "alloc", {"ncpus": 1, "tag": "roots-job"})
    ok, why = run_as(uid, gid, try_call, str(daemon.socket), "release", {"tag": "roots-job"})
    assert len(call(str(daemon.socket), "leases", {})) == 1
    assert not ok and "roots-job" in why


def test_unheld_alloc_lease_expires(daemon_factory, tmp_path: Path) -> None:
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", '[policy]\nname = "t"\n[leases]\nalloc_ttl = 2\n')
    d: DaemonProc = daemon_factory(policy_dir=pol).start()
    lease = call(str(d.socket), "alloc", {"ncpus": 1})
    assert "expires" in d.ctl("leases").out
    # gone within 4 s (its 2 s TTL, and the expiry sweep after it)
    wait_for(lambda: lease["id"] not in [x["id"] for x in call(str(d.socket), "leases", {})],
             4, "the unheld lease to expire", interval=0.2)


@pytest.mark.skipif(len(ONLINE) < 2, reason="needs 2 CPUs")
def test_exclusive_lease_plus_bind_restores_the_cpus(daemon: DaemonProc) -> None:
    s = subprocess.Popen(["sleep", "300"])
    try:
        before = os.sched_getaffinity(s.pid)
        sock = str(daemon.socket)
        lease = call(sock, "alloc", {"ncpus": 1, "exclusive": True,
                                      "exclusive_scope": f"pid:{s.pid}"})
        assert os.sched_getaffinity(s.pid) != before  # moved off the lease's CPU
        call(sock, "bind", {"pid": s.pid, "cpus": format_cpulist(before)})
        call(sock, "release", {"lease": lease["id"]})
        call(sock, "unbind", {"pid": s.pid})
        assert os.sched_getaffinity(s.pid) == before
    finally:
        s.kill()
        s.wait()

