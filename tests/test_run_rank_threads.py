"""`tunerctl run -- torchrun --nproc-per-node N train.py` (the README's main job) gives each
rank an OMP_NUM_THREADS no larger than the CPUs the bundled rule binds it to (issue 35 item
2: run exported the whole lease's count, torchrun kept it, every rank was oversubscribed).
Real torchrun under the real daemon; read back from the ranks' /proc/PID/environ and
/proc/PID/status."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, DaemonProc, wait_for
from tests.leases_helpers import environ, kill_tree
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.cpulist import parse_cpulist
from tunerd.cli.cmd_leases import _launcher_ranks

HOST_CPUS = os.sched_getaffinity(0)

TRAIN = r"""
import json, os, sys, time
from pathlib import Path

hold = Path(sys.argv[1])
rank = os.environ["LOCAL_RANK"]
(hold / f".rank{rank}").write_text(json.dumps({"pid": os.getpid()}))
(hold / f".rank{rank}").rename(hold / f"rank{rank}.json")
while not (hold / "release").exists():
    time.sleep(0.05)
"""


def _allowed(pid: int) -> frozenset[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1].strip())
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def _rule_bound(d: DaemonProc, pids: list[int]) -> dict[int, frozenset[int]]:
    jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
    got = {p: _allowed(p) for p in pids if jobs.get(p, {}).get("origin") == "rule"}
    return got if len(got) == len(pids) else {}


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("nproc", [2, 3])
def test_run_torchrun_ranks_get_threads_that_fit_their_cpus(daemon_factory, tmp_path: Path,
                                                            nproc: int) -> None:
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir).start()
    hold = tmp_path / "hold"
    hold.mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    job = subprocess.Popen(
        [sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket), "run", "--",
         torchrun, "--standalone", "--nproc-per-node", str(nproc), "train.py", str(hold)],
        env={**env, "TUNERD_TEST_TOKEN": token, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: len(list(hold.glob("rank*.json"))) == nproc or job.poll() is not None,
                 120, "every rank to start")
        assert job.poll() is None, job.communicate()[1][-2000:]
        pids = [json.loads((hold / f"rank{r}.json").read_text())["pid"] for r in range(nproc)]
        cpus = wait_for(lambda: _rule_bound(d, pids), 20, "every rank rule-bound",
                        detail=d.log)
        for pid in pids:
            omp = int(environ(pid)["OMP_NUM_THREADS"])
            assert 1 <= omp <= len(cpus[pid]), (pid, omp, cpus)
        (hold / "release").touch()
        assert job.wait(60) == 0
    finally:
        kill_tree(job)


def test_the_rank_count_is_read_from_each_launchers_own_option() -> None:
    assert _launcher_ranks(["torchrun", "--standalone", "--nproc-per-node", "4", "t.py"]) \
        == ("torchrun", 4)
    assert _launcher_ranks(["/x/python3", "-m", "torch.distributed.run",
                            "--nproc_per_node=8", "t.py"]) == ("torch.distributed.run", 8)
    assert _launcher_ranks(["torchrun", "--nproc-per-node", "gpu", "t.py"]) == ("torchrun", None)
    # the script's own --nproc-per-node is not torchrun's
    assert _launcher_ranks(["torchrun", "t.py", "--nproc-per-node", "4"]) == ("torchrun", None)
    assert _launcher_ranks(["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "t.py"]) \
        == ("torchrun", 2)
    assert _launcher_ranks(["mpirun", "-np", "2", "a.out"]) == ("mpirun", 2)
    assert _launcher_ranks(["python", "train.py"]) is None
