"""A real torchrun DDP job (gloo, CPU, one DataLoader worker per rank) under the real
daemon with the bundled torch-training rule: each rank is bound as it execs and it and
its worker get CPUs, read back from /proc. Not timed (bench/ddp_binding.py measures)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.binding_helpers import task_cpus
from tests.helpers import REPO, write_policy
from tests.leases_helpers import cpus_allowed, scope_bundled_rule
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root
EXAMPLE = REPO / "contrib" / "examples" / "ddp_train.py"


def bundled_rule_policy(pdir: Path, token: str) -> None:
    """The [[job]] torch-training rule of policies/00-base.toml, whole, narrowed by a token
    in the environment to this test's processes (a shared machine may run other
    training jobs). 00-base.toml also sets vm.numa_balancing, a host setting this test
    must not change: only the rule (the file's last section) is taken."""
    text = (REPO / "policies" / "00-base.toml").read_text()
    write_policy(pdir, "00-ddp.toml",
                 '[policy]\nname = "ddp-test"\n\n' + text[text.index("[[job]]"):])
    scope_bundled_rule(pdir, "TUNERD_TEST_TOKEN", token)


def all_threads_cpus(pid: int) -> set[frozenset[int]]:
    return {parse_cpulist(c) for c in task_cpus(pid).values()}


def test_torchrun_ranks_and_workers_get_cpus(daemon_factory, tmp_path: Path) -> None:
    """With tunerd.torch's helpers (`--helpers`): the worker is also pinned to one CPU.
    (Without them the worker inherits the rank's mask; the same checks hold, one CPU
    per worker aside: run the example without --helpers to see it. One variant keeps
    the suite fast.)"""
    helpers = True
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir).start()
    rule = next(j for j in d.ctl("--json", "policy", "show").json()["job"]
                if j["name"] == "torch-training")
    assert rule["match"]["rank"] is True, rule  # ranks by environment and tree
    assert rule["match"]["env"] == {"TUNERD_TEST_TOKEN": token}, rule
    hold = tmp_path / "hold"
    hold.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(29500 + os.getpid() % 1000), str(EXAMPLE), "--steps", "3",
            "--warmup", "0", "--hold-dir", str(hold)] + (["--helpers"] if helpers else [])
    env = {**os.environ, "TUNERD_SOCKET": str(d.socket), "PYTHONPATH": str(REPO),
           "TUNERD_TEST_TOKEN": token}
    job = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list(hold.glob("rank*.json"))) < 2:
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "ranks did not reach their first batch"
            time.sleep(0.05)
        ranks = [json.loads((hold / f"rank{r}.json").read_text()) for r in (0, 1)]
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        for r in ranks:
            pid = r["pid"]
            # the daemon bound the rank by the bundled rule, and /proc agrees
            assert pid in jobs, (pid, jobs)
            bound = parse_cpulist(jobs[pid]["cpus"])
            assert jobs[pid].get("origin") == "rule"
            assert bound and all_threads_cpus(pid) == {bound}
            # its DataLoader worker (forked after the bind) runs inside the rank's CPUs
            assert len(r["workers"]) == 1, r
            worker = r["workers"][0]
            worker_cpus = all_threads_cpus(worker)
            assert all(c and c <= bound for c in worker_cpus), (bound, worker_cpus)
            if helpers:
                # tunerd.torch pinned it to one CPU of the rank's set
                assert all(len(c) == 1 for c in worker_cpus), worker_cpus
        if helpers and len(os.sched_getaffinity(0)) >= 2 and all(
                cpus_allowed(r["pid"]) == cpus_allowed(ranks[0]["pid"]) for r in ranks):
            # ranks sharing one set: their workers take different CPUs (by local rank)
            w = [next(iter(all_threads_cpus(r["workers"][0]))) for r in ranks]
            assert w[0] != w[1], w
        (hold / "release").touch()
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-3000:]
        assert "TUNERD_METRIC samples_per_second" in out
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
