"""Real DeepSpeed and HF Accelerate launchers (issue 26 item 10), 2 local ranks each.

Each launcher is started its documented way for 2 processes on one node with
``CUDA_VISIBLE_DEVICES=2,5``; a scoped real daemon with the bundled torch-training rule,
on a snapshot of this machine with 8 recorded GPUs, binds local rank 0 in GPU 2's slice
and local rank 1 in GPU 5's (read back from /proc, every thread), the two apart, and the
launcher processes themselves are left alone. The tree is what a GPU node runs:

- ``deepspeed train.py`` (a python script, comm ``deepspeed``) runs ``python -u -m
  deepspeed.launcher.launch ...``, which starts each rank with ``LOCAL_RANK`` and
  ``CUDA_VISIBLE_DEVICES``. On a CPU-only box DeepSpeed's CPU accelerator
  (``DS_ACCELERATOR=cpu``) counts ``LOCAL_SIZE`` devices (else one per NUMA node), and
  its runner takes ``CUDA_VISIBLE_DEVICES`` only when it names devices that exist:
  ``LOCAL_SIZE=8`` stands for the GPU node's 8 GPUs.
- ``accelerate launch --multi_gpu`` runs torch's elastic agent in its own process
  (which names itself ``pt_elastic``); the ranks are its children with ``LOCAL_RANK``.
  On a GPU node ``--gpu_ids 2,5`` sets ``CUDA_VISIBLE_DEVICES``; with a CPU torch it
  sets nothing, so the variable is also given to the launcher, which passes it on.

Installed by scripts/test.sh (``pip install accelerate`` and ``DS_BUILD_OPS=0 pip
install --no-build-isolation deepspeed``); a launcher that is not installed is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.binding_helpers import task_cpus
from tests.helpers import DaemonProc, wait_for
from tests.leases_helpers import (
    autobind_status,
    cpus_allowed,
    descendants,
    kill_tree,
    local_ranks,
    ppid,
    snapshot_with_8_gpus_here,
)
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root

HOST_CPUS = frozenset(os.sched_getaffinity(0))
GPUS = (2, 5)  # CUDA_VISIBLE_DEVICES: local rank i uses GPU GPUS[i]
BIN = Path(sys.executable).parent
# a rank: starts two threads (after its bind: they inherit its CPUs), says so, and
# sleeps until the test ends it
_TRAIN = """import os, sys, threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
open(sys.argv[0] + ".ready" + os.environ["LOCAL_RANK"], "w").close()
time.sleep(60)
"""


@dataclass(frozen=True)
class Setup:
    daemon: DaemonProc
    token: str
    tmp: Path
    slices: dict[int, frozenset[int]]  # GPU -> its slice, as the daemon's node map says


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    """One scoped daemon for the module, with the bundled rule narrowed to its token."""
    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs (GPU 2's and GPU 5's slices apart)")
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-test-launchers-"))
    tmp.chmod(0o755)
    token = f"lr{os.getpid()}"
    bundled_rule_policy(tmp / "policies", token)
    snap = snapshot_with_8_gpus_here(tmp / "snap.json")
    (tmp / "d").mkdir()
    d = DaemonProc(tmp=tmp / "d", policy_dir=tmp / "policies",
                   extra_args=["--topology", str(snap)])
    try:
        d.start()
        r = d.ctl("--json", "topology")
        assert r.rc == 0, r.err
        slices = {s["gpu"]: parse_cpulist(s["cpus"]) for s in r.json()["node_map"]["slices"]}
        assert slices[GPUS[0]] and slices[GPUS[1]] and not slices[GPUS[0]] & slices[GPUS[1]]
        yield Setup(daemon=d, token=token, tmp=tmp, slices=slices)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deepspeed(train: Path) -> tuple[list[str], dict[str, str]]:
    return ([str(BIN / "deepspeed"), "--master_port", str(_free_port()), str(train)],
            {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "8"})


def _accelerate(train: Path) -> tuple[list[str], dict[str, str]]:
    return ([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
             "--gpu_ids", ",".join(map(str, GPUS)), "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no",
             "--main_process_port", str(_free_port()), str(train)], {})


LAUNCHERS = {"deepspeed": _deepspeed, "accelerate": _accelerate}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_real_launcher_local_rank_i_is_bound_in_its_gpus_slice(setup: Setup,
                                                               name: str) -> None:
    if importlib.util.find_spec(name) is None or not (BIN / name).exists():
        pytest.skip(f"{name} is not installed (scripts/test.sh installs it)")
    d = setup.daemon
    train = setup.tmp / f"train_{name}_{setup.token}.py"
    train.write_text(_TRAIN)
    argv, extra = LAUNCHERS[name](train)
    env = {**os.environ, **extra, "TUNERD_TEST_TOKEN": setup.token,
           "TUNERD_NUM_WORKERS": "0", "CUDA_VISIBLE_DEVICES": ",".join(map(str, GPUS)),
           "HF_HOME": str(setup.tmp / "hf"), "PYTHONUNBUFFERED": "1"}
    log = setup.tmp / f"{name}.log"
    with log.open("wb") as out:
        top = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                               cwd=setup.tmp)
    try:
        by_rank = wait_for(lambda: local_ranks(top.pid, train, 2), 30, f"{name}'s two ranks",
                           detail=log.read_text)
        pids = set(by_rank.values())

        def bound() -> dict[int, dict[str, object]] | None:
            got = {b["pid"]: b for b in autobind_status(d)["bound"] if b["pid"] in pids}
            return got if len(got) == 2 else None

        wait_for(bound, 15, f"both {name} ranks bound by the rule", detail=d.log)
        wait_for(lambda: all(Path(f"{train}.ready{r}").exists() for r in (0, 1)), 15,
                 f"{name}'s ranks running their threads", detail=log.read_text)
        cpus = {}
        for rank, gpu in enumerate(GPUS):
            tasks = task_cpus(by_rank[rank])
            threads = {parse_cpulist(c) for c in tasks.values()}
            assert len(tasks) >= 3 and all(c and c <= setup.slices[gpu] for c in threads), \
                (name, rank, gpu, threads, setup.slices[gpu], d.log())
            cpus[rank] = frozenset().union(*threads)
        assert not cpus[0] & cpus[1], cpus
        # the launcher's own processes are no ranks: not bound, their CPUs untouched
        bound_pids = {b["pid"] for b in autobind_status(d)["bound"]}
        launchers = [top.pid, *(p for p in descendants(top.pid) if p not in pids)]
        for pid in launchers:
            assert pid not in bound_pids, (name, pid, d.log())
            assert parse_cpulist(cpus_allowed(pid) or "") == HOST_CPUS, (name, pid)
        # one job, keyed by the launcher process that started the ranks (pid and start)
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        groups = {str(jobs[p]["why"]).rpartition("group ")[2] for p in pids}
        parent = ppid(by_rank[0])
        assert len(groups) == 1 and f":{parent}." in next(iter(groups)), (name, parent, groups)
    finally:
        kill_tree(top)  # type: ignore[arg-type]
        top.wait()
