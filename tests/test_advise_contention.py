"""`advise` under CPU contention, with a real torch DataLoader (issue 15 item 6).

The guide's example: 4 DataLoader workers on 1 CPU, the job at nice 10, and another
process hogging the same CPU. Every CPU the job may use is busy, but most of that
time is the neighbour's: the job's own share (and its workers') is small. advise
must still say that the job's workers are starved for CPU; a healthy job, with a
CPU per worker and its training loop, gets no finding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProc, wait_for
from tunerd.diagnose.advise import MIN_SAMPLES

pytest.importorskip("torch")
pytestmark = pytest.mark.root

CONTENTION_IDS = {"data-loading-cpu-starved", "cpu-oversubscription"}
JOB = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
os.nice(int(sys.argv[2]))

class Burn(Dataset):
    def __len__(self): return 1 << 30
    def __getitem__(self, i):
        x = 0
        for k in range(20000): x += k * k  # a CPU-heavy transform, as decoding is
        return torch.tensor([x % 7], dtype=torch.float32)

print("ready", flush=True)
sys.stdin.readline()  # bound now: the workers fork onto the job's CPUs
loader = DataLoader(Burn(), batch_size=8, num_workers=int(sys.argv[1]))
for batch in loader:
    batch.sum().item()  # the training step: light
"""
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


@pytest.fixture
def advise_daemon(daemon_factory: Any, tmp_path: Path) -> DaemonProc:
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("sample_interval = 0.5\nhistory_seconds = 60\n")
    d: DaemonProc = daemon_factory(args=["--config", str(cfg)]).start()
    return d


def start_job(workers: int, nice: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", JOB, str(workers), str(nice)], cwd=REPO,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)  # its workers in its process group
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        # the job's workers are its children: end the whole group of each job
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def findings(d: DaemonProc, pid: int) -> dict[str, Any] | None:
    res = d.ctl("--json", "advise", str(pid))
    out = json.loads(res.out or "{}")
    if "jobs" not in out:
        return None
    return {f["id"]: f for j in out["jobs"] for f in j["findings"]}


def bind_and_go(d: DaemonProc, p: subprocess.Popen[str], cpus: str) -> None:
    r = d.ctl("bind", str(p.pid), "--cpus", cpus)
    assert r.rc == 0, r.err
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()


def test_workers_and_a_neighbour_on_one_cpu_are_found_within_25_s(
        advise_daemon: DaemonProc, procs: list[subprocess.Popen[str]]) -> None:
    d = advise_daemon
    cpu = str(max(os.sched_getaffinity(0)))
    job = start_job(workers=4, nice=10)
    procs.append(job)
    procs.append(subprocess.Popen([sys.executable, "-c", HOG, cpu], start_new_session=True))
    bind_and_go(d, job, cpu)
    got = wait_for(lambda: (f := findings(d, job.pid)) and (CONTENTION_IDS & set(f)) and f,
                   25, "a contention finding for the starved job", interval=0.5,
                   detail=lambda: d.ctl("--json", "advise", str(job.pid)).out[-2000:])
    f = got.get("data-loading-cpu-starved") or got["cpu-oversubscription"]
    assert f["evidence"]["ncpus"] == 1 and f["evidence"]["bound_cpus"] == cpu, f
    # the starved-workers finding in particular: its CPU is all busy (the hog), while
    # the job's tree gets little of it (nice 10)
    starved = wait_for(lambda: (findings(d, job.pid) or {}).get("data-loading-cpu-starved"),
                       15, "data-loading-cpu-starved", interval=0.5)
    assert starved["evidence"]["workers"] == 4
    assert starved["evidence"]["cpus_busy_ratio_median"] >= 0.9


def test_a_healthy_job_gets_no_finding(advise_daemon: DaemonProc,
                                       procs: list[subprocess.Popen[str]]) -> None:
    d = advise_daemon
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one per worker plus the training loop")
    job = start_job(workers=1, nice=0)
    procs.append(job)
    bind_and_go(d, job, f"{cpus[0]},{cpus[1]}")
    # sampled for a while (the same 10 s of history the starved job needed at most)
    wait_for(lambda: (findings(d, job.pid) is not None and len(json.loads(d.ctl(
        "--json", "top").out)["sample"]["jobs"][0].get("worker_pids") or []) == 1), 25,
        "the job and its worker sampled", interval=0.5)
    # 6 more samples (0.5 s apart): twice the MIN_SAMPLES every advise rule needs before it
    # can find anything; the starved job above has its finding within ~2 s of sampling
    time.sleep(2 * MIN_SAMPLES * 0.5)
    assert findings(d, job.pid) == {}, d.ctl("--json", "advise", str(job.pid)).out
