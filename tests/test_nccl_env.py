"""NCCL settings reach pods: `tunerctl env`, the tunerd.torch helper and the nccl.conf
file under the runtime dir, from a real daemon (its /etc is a temp dir)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.host_helpers import NsDaemonProc, make_daemon

POLICY = """[policy]
name = "nccl-node"

[nccl]
NCCL_SOCKET_IFNAME = "=ens1f0"
NCCL_IB_DISABLE = true
NCCL_BUFFSIZE = 8388608
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[NsDaemonProc]:
    d = make_daemon(tmp_path, POLICY, ns=None)
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


def test_tunerctl_env_prints_exports_a_shell_can_eval(daemon: NsDaemonProc) -> None:
    r = daemon.ctl("env")
    assert r.rc == 0, r.err
    assert "export NCCL_IB_DISABLE=1\n" in r.out and "export NCCL_BUFFSIZE=8388608" in r.out
    sh = subprocess.run(["sh", "-c", 'eval "$(' + " ".join(
        [sys.executable, "-m", "tunerd.cli.main", "--socket", str(daemon.socket), "env"])
        + ')"; echo "$NCCL_SOCKET_IFNAME $NCCL_IB_DISABLE"'],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert sh.stdout.strip() == "=ens1f0 1", sh.stdout + sh.stderr
    js = daemon.ctl("--json", "env").json()
    assert js["nccl"] == {"NCCL_BUFFSIZE": "8388608", "NCCL_IB_DISABLE": "1",
                          "NCCL_SOCKET_IFNAME": "=ens1f0"}
    # the file a pod mounts (the directory) and names with NCCL_CONF_FILE
    conf = Path(js["nccl_conf_file"])
    assert conf == daemon.runtime_dir / "nccl" / "nccl.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o644
    lines = [ln for ln in conf.read_text().splitlines() if not ln.startswith("#")]
    assert lines == ["NCCL_BUFFSIZE=8388608", "NCCL_IB_DISABLE=1", "NCCL_SOCKET_IFNAME==ens1f0"]
    # a rank on this node (GPU-less here, or with GPUs): the settings, exit 0
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(daemon.socket),
                        "env", "--local-rank", "0"], capture_output=True, text=True, cwd=REPO,
                       timeout=60, env=env)
    assert r.returncode == 0 and "export NCCL_IB_DISABLE=1\n" in r.stdout, r.stderr


def test_torch_helper_exports_only_what_the_job_did_not_set(daemon: NsDaemonProc) -> None:
    code = ("import os, json, tunerd.torch as tt, sys\n"
            "os.environ['NCCL_IB_DISABLE'] = '0'\n"
            "done = tt.export_nccl_env()\n"
            "print(json.dumps([done, os.environ['NCCL_IB_DISABLE'],"
            " 'torch' in sys.modules]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, timeout=60, env={"TUNERD_SOCKET": str(daemon.socket),
                                                  "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    done, ib, torch_loaded = json.loads(p.stdout)
    assert done == {"NCCL_BUFFSIZE": "8388608", "NCCL_SOCKET_IFNAME": "=ens1f0"}
    assert ib == "0" and torch_loaded is False
    # no daemon: nothing set, no error
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, timeout=60, env={"TUNERD_SOCKET": "/nonexistent/tunerd.sock"})
    assert p.returncode == 0 and json.loads(p.stdout)[0] == {}, p.stderr
