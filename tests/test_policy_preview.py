"""``tunerctl plan --policy-dir`` and ``reload --no-rebind-running`` with the real daemon
and a real process of the unprivileged test user (issue 19, item 2)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DaemonProc, wait_for, write_policy
from tests.leases_helpers import cpus_allowed, kill, rule_policy

pytestmark = pytest.mark.root

HOST_CPUS = frozenset(os.sched_getaffinity(0))


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to tell a binding apart")
def test_plan_previews_a_candidate_dir_and_reload_can_refuse_rebinding(
        tmp_path: Path, daemon_factory, unpriv_user: tuple[int, int]) -> None:
    token = f"3000{os.getpid()}.5"  # sleep's argument: only this test's process matches
    target = min(HOST_CPUS)
    # the policy file is a symlink to a file outside the dir: editing that file is not a
    # change of the dir, so the daemon's policy-dir watcher does not reload by itself and
    # the explicit `tunerctl reload` below is the one that reads the new rule
    pdir, real = tmp_path / "pol", tmp_path / "real.toml"
    real.write_text('[policy]\nname = "test"\n')
    pdir.mkdir()
    (pdir / "00-test.toml").symlink_to(real)
    cand = rule_policy(tmp_path / "cand", f'[[job]]\nname = "preview"\n'
                                          f'match.cmdline = ["*sleep {token}*"]\n'
                                          f'cpus = "{target}"\n')
    d: DaemonProc = daemon_factory(policy_dir=pdir).start()
    uid, gid = unpriv_user
    p = subprocess.Popen(["sleep", token], user=uid, group=gid, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: cpus_allowed(p.pid) is not None, 5, "the sleeper to start")
        before = cpus_allowed(p.pid)
        r = d.ctl("--json", "plan", "--policy-dir", str(cand))
        assert r.rc == 0, r.err
        rows = r.json()["would_bind"]
        assert [(x["pid"], x["uid"], x["user"], x["rule"], x["cpus"]) for x in rows] == [
            (p.pid, uid, "tunerd-test", "preview", str(target))], rows
        assert r.json()["host"]["changes"] == []
        as_user = subprocess.run(  # a preview reads any directory as root: root only
            [sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket), "plan",
             "--policy-dir", str(cand)], user=uid, group=gid, capture_output=True, text=True,
            timeout=60, cwd="/")
        assert as_user.returncode == 4 and "needs root" in as_user.stderr, as_user
        human = d.ctl("plan", "--policy-dir", str(cand)).out
        assert f"pid {p.pid} user tunerd-test rule preview: cpus {target}" in human, human
        # a preview changes nothing: same policy in force, the process not bound
        assert d.ctl("--json", "policy", "show").json()["sources"] == [str(pdir / "00-test.toml")]
        assert cpus_allowed(p.pid) == before

        shutil.copy(cand / "00-test.toml", real)
        refused = d.ctl("reload", "--no-rebind-running")
        assert refused.rc == 1, refused
        assert f"pid {p.pid} (tunerd-test, rule preview)" in refused.out, refused.out
        assert d.ctl("--json", "status").json()["policy"]["error"] is None  # not a bad file
        assert cpus_allowed(p.pid) == before
        ok = d.ctl("reload")  # the default: running processes are bound at once
        assert ok.rc == 0, ok
        wait_for(lambda: cpus_allowed(p.pid) == str(target), 10, "the rule to bind it",
                 detail=d.log)
    finally:
        kill(p)  # type: ignore[arg-type]


def test_config_key_makes_every_reload_refuse_rebinding(
        tmp_path: Path, daemon_factory, unpriv_user: tuple[int, int]) -> None:
    """reload_rebinds_running = false: SIGHUP (systemctl reload) refuses too."""
    token = f"3100{os.getpid()}.5"
    pdir = tmp_path / "pol"
    write_policy(pdir, "00-test.toml", '[policy]\nname = "test"\n')
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("reload_rebinds_running = false\n")
    d: DaemonProc = daemon_factory(policy_dir=pdir, args=["--config", str(cfg)]).start()
    uid, gid = unpriv_user
    p = subprocess.Popen(["sleep", token], user=uid, group=gid, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: cpus_allowed(p.pid) is not None, 5, "the sleeper to start")
        rule_policy(pdir, f'[[job]]\nname = "later"\nmatch.cmdline = ["*sleep {token}*"]\n'
                          f'cpus = "{min(HOST_CPUS)}"\n')
        d.signal(signal.SIGHUP)
        wait_for(lambda: "reload refused" in d.log(), 10, "the reload to be refused",
                 detail=d.log)
        assert f"pid {p.pid} (tunerd-test, rule later)" in d.log()
        assert "reload refused" in d.ctl("status").out
        r = d.ctl("reload")  # the key holds for tunerctl reload too
        assert r.rc == 1 and "reload_rebinds_running = false" in r.out, r
        assert d.ctl("--json", "policy", "show").json()["job"] == []
    finally:
        kill(p)  # type: ignore[arg-type]


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to tell a binding apart")
def test_a_staged_dir_waits_for_reload_policy_dir_and_a_refusal_installs_nothing(
        tmp_path: Path, daemon_factory, unpriv_user: tuple[int, int]) -> None:
    """The recipe: stage, preview, then `reload --policy-dir DIR [--no-rebind-running]`:
    nothing of DIR is in force or in the policy dir until that command accepts it, a
    refusal names the files that really stay in force, an acceptance installs DIR's files
    as the policy dir's whole content and puts them in force at once."""
    token = f"3200{os.getpid()}.5"
    target = min(HOST_CPUS)
    pdir = tmp_path / "pol"
    write_policy(pdir, "00-test.toml", '[policy]\nname = "test"\n')
    write_policy(pdir, "05-old.toml", '[policy]\nname = "old"\n')
    cand = rule_policy(tmp_path / "cand", f'[[job]]\nname = "staged"\n'
                                          f'match.cmdline = ["*sleep {token}*"]\n'
                                          f'cpus = "{target}"\n')
    bad = tmp_path / "bad"
    write_policy(bad, "00-test.toml", '[policy]\nname = "test"\n[limits]\nnofile = "x"\n')
    d: DaemonProc = daemon_factory(policy_dir=pdir).start()
    in_force = [str(pdir / "00-test.toml"), str(pdir / "05-old.toml")]
    uid, gid = unpriv_user
    p = subprocess.Popen(["sleep", token], user=uid, group=gid, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: cpus_allowed(p.pid) is not None, 5, "the sleeper to start")
        before = cpus_allowed(p.pid)
        r = d.ctl("reload", "--policy-dir", str(bad))
        assert r.rc == 1 and r.out.startswith(
            f"rejected: nothing installed from {bad}; still in force: {', '.join(in_force)}, "
            "loaded "), r.out
        assert "limits.nofile" in r.out
        assert d.ctl("--json", "status").json()["policy"]["error"] is None  # the dir is fine
        r = d.ctl("reload", "--policy-dir", str(cand), "--no-rebind-running")
        assert r.rc == 1, r
        assert r.out.startswith(f"refused: nothing installed from {cand}; still in force: "
                                f"{', '.join(in_force)}, loaded "), r.out
        assert f"pid {p.pid} (tunerd-test, rule staged)" in r.out
        # the hint names the candidate dir, where plan finds what it would bind
        assert f"`tunerctl plan --policy-dir {cand}` lists them" in r.out, r.out
        assert sorted(x.name for x in pdir.glob("*.toml")) == ["00-test.toml", "05-old.toml"]
        assert d.ctl("--json", "policy", "show").json()["sources"] == in_force
        assert cpus_allowed(p.pid) == before
        r = d.ctl("reload", "--policy-dir", str(cand))
        assert r.rc == 0, r
        assert r.out.splitlines()[:2] == [f"installed from {cand}: 00-test.toml",
                                          f"reloaded; in force: {pdir / '00-test.toml'}"]
        # the policy dir is the staged one's content: 05-old.toml gone, no temporary left
        assert [x.name for x in pdir.iterdir()] == ["00-test.toml"]
        assert (pdir / "00-test.toml").read_text() == (cand / "00-test.toml").read_text()
        assert (pdir / "00-test.toml").stat().st_mode & 0o777 == 0o644
        wait_for(lambda: cpus_allowed(p.pid) == str(target), 10, "the rule to bind it",
                 detail=d.log)
        assert d.ctl("--json", "policy", "show").json()["sources"] == [str(pdir / "00-test.toml")]
    finally:
        kill(p)  # type: ignore[arg-type]
