"""``tunerctl plan --policy-dir`` and ``reload --no-rebind-running`` with the real daemon
and a real process of the unprivileged test user (issue 19, item 2)."""

from __future__ import annotations

import os
import shutil
import subprocess
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
    pdir = tmp_path / "pol"
    write_policy(pdir, "00-test.toml", '[policy]\nname = "test"\n')
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
        human = d.ctl("plan", "--policy-dir", str(cand)).out
        assert f"pid {p.pid} user tunerd-test rule preview: cpus {target}" in human, human
        # a preview changes nothing: same policy in force, the process not bound
        assert d.ctl("--json", "policy", "show").json()["sources"] == [str(pdir / "00-test.toml")]
        assert cpus_allowed(p.pid) == before

        shutil.copy(cand / "00-test.toml", pdir / "00-test.toml")
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
