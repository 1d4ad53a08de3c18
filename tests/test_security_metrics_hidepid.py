"""`/metrics` and `tunerctl metrics` follow hidepid as `jobs` and `top` do (issue 28, found 8).

Past hidepid=2, `jobs`, `top` and the rest hide another user's process names, but
`/metrics` and `tunerctl metrics` still carried the victim's process name as a job
label. Replayed by the real test user, over the control socket and over HTTP from a
socket she owns.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import run_as, wait_for
from tests.leases_helpers import kill, open_path_for_others, unique_sleeper
from tests.security_helpers import ctl_as, spawn_as
from tests.test_security_text import _hidepid_daemon

pytestmark = pytest.mark.root


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as r:
        return r.read().decode()


def test_metrics_hide_other_users_process_names_past_hidepid(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    secret = unique_sleeper(tmp_path, f"SECRETjob{os.getpid()}"[:15])
    mine_exe = unique_sleeper(tmp_path, f"minejob{os.getpid()}"[:15])
    open_path_for_others(tmp_path)
    d = _hidepid_daemon(daemon_factory, args=["--metrics-listen", "127.0.0.1:0"])
    victim = subprocess.Popen([str(secret), "300"])  # root's
    mine = spawn_as(unpriv_user, [str(mine_exe), "300"])
    try:
        assert d.ctl("bind", str(victim.pid), "--cpus", "0").rc == 0
        assert ctl_as(unpriv_user, d.socket, "bind", str(mine.pid), "--cpus",
                      "0").returncode == 0
        port = d.ctl("--json", "status").json()["services"]["monitor"]["metrics_port"]
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: "SECRETjob" in _get(url) and mine_exe.name in _get(url), 20,
                 "root's scrape to name both jobs", detail=d.log)
        assert "SECRETjob" in d.ctl("--json", "metrics").out  # root sees it
        r = ctl_as(unpriv_user, d.socket, "metrics")
        assert r.returncode == 0, r.stderr
        assert "SECRETjob" not in r.stdout, r.stdout
        assert f'pid="{victim.pid}"' in r.stdout  # the pid stays, as in jobs
        assert mine_exe.name in r.stdout  # her own job: as /proc shows it to her
        text = run_as(*unpriv_user, _get, url)
        assert "SECRETjob" not in text and f'pid="{victim.pid}"' in text
        assert mine_exe.name in text
    finally:
        kill(victim)
        kill(mine)
