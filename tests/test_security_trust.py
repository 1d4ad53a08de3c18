"""Trusted policy and config files only, as sshd and sudo check theirs (issue 28, found 3, 5).

A policy dir writable by a group let a member drop in a file that gave her exclusive
leases (and a policy may set ``kernel.core_pattern``: writing that dir is root); a
symlink there to a root-only file showed its first line in ``tunerctl status``; a
user-owned, mode-0666 config file was accepted; the policy watcher read a 400 MB file
whole to hash it. Each is replayed here with the real test user.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import write_policy
from tests.leases_helpers import open_path_for_others
from tests.security_helpers import ctl_as, forked_as, recv

pytestmark = pytest.mark.root

GOOD = '[policy]\nname = "base"\n[limits]\nnofile = 65536\n'
EVIL = '[policy]\nname = "zz-evil"\n[leases]\nuser_exclusive = true\n'


def _drop_file(conn, path: str, text: str) -> None:  # type: ignore[no-untyped-def]
    with open(path, "w") as f:
        f.write(text)
    conn.send("written")
    conn.recv()


def test_group_writable_policy_dir_is_refused_at_start(daemon_factory, tmp_path: Path,
                                                       unpriv_user: tuple[int, int]) -> None:
    pol = write_policy(tmp_path / "pol", "00-base.toml", GOOD).parent
    os.chown(pol, 0, unpriv_user[1])
    pol.chmod(0o775)
    open_path_for_others(pol)
    with forked_as(*unpriv_user, _drop_file, str(pol / "50-evil.toml"), EVIL) as conn:
        assert recv(conn) == "written"  # a member of the group really wrote there
    d = daemon_factory(policy_dir=pol)
    d.start(wait=False)
    assert d.proc is not None
    rc = d.proc.wait(20)
    log = d.log()
    assert rc == 1, log
    assert f"policy directory {pol}: writable by its group" in log, log
    assert "Traceback" not in log


def test_untrusted_policy_on_reload_keeps_the_old_one(daemon_factory, tmp_path: Path,
                                                      unpriv_user: tuple[int, int]) -> None:
    pol = write_policy(tmp_path / "pol", "00-base.toml", GOOD).parent
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "shadow.toml"
    secret.write_text("SECRET-FIRST-LINE-4711 = = =\n")
    secret.chmod(0o600)
    open_path_for_others(pol)
    user_dir = Path(f"/tmp/tunerd-user-{os.getpid()}")
    user_dir.mkdir(mode=0o755)
    os.chown(user_dir, *unpriv_user)
    d = daemon_factory(policy_dir=pol).start()
    try:
        # a root-owned symlink to a root-only file that is not TOML: refused, and the
        # user never sees its text
        (pol / "10-link.toml").symlink_to(secret)
        r = d.ctl("reload")
        assert r.rc == 1, r
        st = ctl_as(unpriv_user, d.socket, "--json", "status")
        assert "SECRET-FIRST-LINE" not in st.stdout + st.stderr, st.stdout
        assert "10-link.toml" in st.stdout, st.stdout
        assert "SECRET-FIRST-LINE" in d.ctl("--json", "status").out  # root reads it
        (pol / "10-link.toml").unlink()
        assert d.ctl("reload").rc == 0
        # a symlink to a file the user owns (in her own dir): refused, old policy stays
        with forked_as(*unpriv_user, _drop_file, str(user_dir / "evil.toml"), EVIL) as conn:
            assert recv(conn) == "written"
        (pol / "50-evil.toml").symlink_to(user_dir / "evil.toml")
        r = d.ctl("reload")
        assert r.rc == 1 and "owned by uid" in r.out and "evil.toml" in r.out, r
        os.chown(user_dir / "evil.toml", 0, 0)  # root's now, but in a dir the user owns
        r = d.ctl("reload")
        assert r.rc == 1 and str(user_dir) in r.out and "owned by uid" in r.out, r
        (pol / "50-evil.toml").unlink()
        # a group-writable file in the trusted dir
        f = write_policy(pol, "60-gw.toml", EVIL)
        f.chmod(0o664)
        r = d.ctl("reload")
        assert r.rc == 1 and f"{f}: writable by its group" in r.out, r
        shown = d.ctl("--json", "policy", "show")
        assert shown.json()["leases"]["user_exclusive"] is False
        alloc = ctl_as(unpriv_user, d.socket, "alloc", "--ncpus", "1", "--exclusive")
        assert alloc.returncode == 4, alloc
    finally:
        for p in user_dir.iterdir():
            p.unlink()
        user_dir.rmdir()


def test_untrusted_config_file_is_refused(daemon_factory, tmp_path: Path,
                                          unpriv_user: tuple[int, int]) -> None:
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text('log_level = "info"\n')
    os.chown(cfg, *unpriv_user)
    cfg.chmod(0o666)
    d = daemon_factory(args=["--config", str(cfg)])
    d.start(wait=False)
    assert d.proc is not None
    rc = d.proc.wait(20)
    assert rc == 1, d.log()
    assert f"config file {cfg}: owned by uid {unpriv_user[0]}" in d.log(), d.log()
    os.chown(cfg, 0, 0)
    d.start(wait=False)
    assert d.proc.wait(20) == 1 and f"config file {cfg}: writable by group and others" \
        in d.log(), d.log()
    cfg.chmod(0o644)
    d.start()  # trusted now
    assert d.ctl("status").rc in (0, 1)


def test_the_watcher_never_reads_more_than_a_policy_file_may_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tunerd.daemon import policywatch
    from tunerd.policy.loader import MAX_FILE_BYTES

    pol = write_policy(tmp_path / "pol", "00-base.toml", GOOD).parent
    big = pol / "99-big.toml"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB that take no disk
    read = [0]
    real = os.read

    def counting(fd: int, n: int) -> bytes:
        b = real(fd, n)
        read[0] += len(b)
        return b

    monkeypatch.setattr(policywatch.os, "read", counting)
    h1 = policywatch.policy_dir_hash(pol)
    assert read[0] <= 2 * (MAX_FILE_BYTES + 1), read[0]
    with open(big, "r+b") as f:  # a change past the cap still changes the hash
        f.truncate((64 << 20) + 1)
    time.sleep(0.01)
    assert policywatch.policy_dir_hash(pol) != h1


def test_policy_check_by_a_user_still_reads_her_own_drafts(
        tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    """The trust rules are the daemon's: `tunerctl policy check` of a user's own file works."""
    user_dir = Path(f"/tmp/tunerd-draft-{os.getpid()}")
    user_dir.mkdir(mode=0o755)
    os.chown(user_dir, *unpriv_user)
    try:
        with forked_as(*unpriv_user, _drop_file, str(user_dir / "d.toml"), GOOD) as conn:
            assert recv(conn) == "written"
        r = ctl_as(unpriv_user, "/nonexistent.sock", "policy", "check", str(user_dir / "d.toml"))
        assert r.returncode == 0, (r.stdout, r.stderr)
    finally:
        for p in user_dir.iterdir():
            p.unlink()
        user_dir.rmdir()
