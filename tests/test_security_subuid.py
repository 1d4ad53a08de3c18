"""Subordinate uids count as their user for per-user limits (issue 28, found 9).

With ``newuidmap`` installed (rootless containers), a user's processes in her own
user namespace run as her subordinate uids: 4 of them held 256 leases against the
64-lease limit. On the host such a process is simply a process of that uid, so the
test runs tunerctl as the subordinate uids themselves (what newuidmap gives her), with
``subuid_file`` pointing at a file that gives the test user a range.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, write_policy

pytestmark = pytest.mark.root

FIRST = 3_100_000  # far from any real uid here


def _ctl(uid: int, sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(sock),
                           *args], capture_output=True, text=True, timeout=60, cwd=REPO,
                          user=uid, group=uid, extra_groups=[])


def test_subordinate_uids_share_their_users_lease_limit(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    import pwd

    name = pwd.getpwuid(unpriv_user[0]).pw_name
    subuid = tmp_path / "subuid"
    subuid.write_text(f"# rootless containers\n{name}:{FIRST}:65536\nbogus line\n")
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'subuid_file = "{subuid}"\n')
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", '[policy]\nname = "t"\n[leases]\nmax_per_user = 2\n')
    d = daemon_factory(policy_dir=pol, args=["--config", str(cfg)]).start()
    got = []
    for uid in (FIRST + 1, FIRST + 2, FIRST + 3, unpriv_user[0]):
        r = _ctl(uid, d.socket, "--json", "alloc", "--ncpus", "1")
        got.append((uid, r.returncode, r.stderr.strip()))
    assert [rc for _, rc, _ in got] == [0, 0, 4, 4], got
    assert f"a subordinate uid of uid {unpriv_user[0]}" in got[2][2], got
    assert "max_per_user = 2" in got[3][2], got
    # another user's subordinate range is not hers: a uid outside it is its own user
    r = _ctl(FIRST + 70_000, d.socket, "--json", "alloc", "--ncpus", "1")
    assert r.returncode == 0, r.stderr
    leases = json.loads(d.ctl("--json", "leases").out)
    assert len(leases["leases"] if isinstance(leases, dict) else leases) == 3


def _connect(sock: str, n: int) -> tuple[list[Any], list[str]]:
    """Open ``n`` connections and ping on each: (the sockets, what each answered)."""
    import socket

    held, out = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sock)
        try:
            s.sendall(b'{"id":1,"cmd":"ping","args":{}}\n')
        except OSError:
            pass  # refused and closed already: its one line is still there to read
        line = s.makefile().readline()
        out.append("ok" if '"ok":true' in line.replace(" ", "") else line)
        held.append(s)
    return held, out


def _holder(conn: Any, sock: str, n: int) -> None:
    held, out = _connect(sock, n)
    conn.send(out)
    conn.recv()  # until the test is done
    for s in held:
        s.close()


def test_subordinate_uids_share_their_users_connection_limit(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    import pwd

    from tests.security_helpers import forked_as, recv

    name = pwd.getpwuid(unpriv_user[0]).pw_name
    subuid = tmp_path / "subuid"
    subuid.write_text(f"{name}:{FIRST}:65536\n")
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'subuid_file = "{subuid}"\nmax_connections_per_user = 3\n')
    d = daemon_factory(args=["--config", str(cfg)]).start()
    with forked_as(FIRST + 5, FIRST + 5, _holder, str(d.socket), 2) as a:
        assert recv(a) == ["ok", "ok"]
        with forked_as(FIRST + 6, FIRST + 6, _holder, str(d.socket), 2) as b:
            got = recv(b)
        assert got[0] == "ok" and "max_connections_per_user = 3" in got[1], got
        assert f"uid {FIRST + 6} (a subordinate uid of uid {unpriv_user[0]})" in got[1], got
    # another range's uid is its own user
    with forked_as(FIRST + 70_000, FIRST + 70_000, _holder, str(d.socket), 3) as c:
        assert recv(c) == ["ok", "ok", "ok"]
