"""`tunerctl jobs`: live names and thread counts, leases, and replay-only placements (issue 10)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.leases_helpers import DGX_H100, kill, rule_policy, spawn, unique_sleeper

pytestmark = pytest.mark.root

def test_jobs_shows_live_threads_and_the_leases(daemon_factory) -> None:
    import subprocess
    import sys

    d = daemon_factory().start()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert d.ctl("bind", str(p.pid), "--cpus", "0").rc == 0
        lease = d.ctl("--json", "alloc", "--ncpus", "1", "--tag", "t1").json()["id"]
        # NAME and THREADS come from /proc at the time of the query, not from bind time
        with open(f"/proc/{p.pid}/comm") as f:
            comm = f.read().strip()
        out = d.ctl("jobs").out
        assert comm in out and "LEASE" in out and lease in out and "t1" in out, out
        job = next(j for j in d.ctl("--json", "jobs").json()["jobs"] if j["pid"] == p.pid)
        assert job["threads"] == 1
    finally:
        p.kill()
        p.wait()


def test_rule_placements_on_a_foreign_replay_are_listed_not_applied(daemon_factory,
                                                                     tmp_path: Path) -> None:
    """On `--topology dgx-h100.json` the rank's CPUs do not exist here: nothing is
    applied, but jobs and advise still show where it would go, and why."""
    exe = unique_sleeper(tmp_path, "replay_rank_train")
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "ranks"\n'
                                        f'match.cmdline = ["*{exe.name}*"]\n'
                                        'match.env = { LOCAL_RANK = "*" }\n')
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    rank = spawn([str(exe), "30"], {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"})
    before = os.sched_getaffinity(rank.pid)
    try:
        job = wait_for(lambda: next((j for j in d.ctl("--json", "jobs").json()["jobs"]
                                     if j["pid"] == rank.pid), None), 10, "the rank listed")
        assert job["applied"] is False and job["origin"] == "rule"
        assert job["gpus"] == [3] and "rank 3 of 8" in job["explanation"]
        assert any("nothing was applied" in n for n in job["notes"])
        assert os.sched_getaffinity(rank.pid) == before
        human = d.ctl("jobs").out
        assert "rule*" in human and "placed on the replayed topology only" in human
    finally:
        kill(rank)
