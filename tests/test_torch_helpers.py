"""tunerd.torch: the values the helpers compute for given allocations, how the daemon's
settings and the environment override them, worker pinning read back from /proc, and
the step reporter with and without a daemon."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.binding_helpers import task_cpus
from tests.helpers import REPO
from tunerd.torch import (
    Allocation,
    StepReporter,
    WorkerPinner,
    allocation,
    cpu_has_native_bf16,
    env_overrides,
    loader_plan,
)
from tunerd.torch.link import DaemonLink, current_report


def plan(cpus: int, cuda: bool, sharing: int = 1, slot: int = 0, **kw):  # type: ignore[no-untyped-def]
    alloc = Allocation(tuple(range(cpus)), sharing, slot, "test")
    kw.setdefault("settings", {})
    kw.setdefault("env", {})
    return loader_plan(cuda=cuda, alloc=alloc, **kw)


@pytest.mark.parametrize(("cpus", "cuda", "sharing", "workers"), [
    (1, False, 1, 0),    # one CPU, CPU training: the main process needs it
    (2, False, 1, 1),    # this VM: half the CPUs load data
    (8, False, 1, 4),
    (2, False, 2, 0),    # two ranks share two CPUs: one each
    (1, True, 1, 1),     # CUDA: at least one worker, the main process mostly waits
    (4, True, 1, 3),
    (28, True, 1, 8),    # a DGX H100 rank's 28 CPUs: capped at 8
    (16, True, 2, 7),    # two ranks sharing 16 CPUs: 8 each, one for the main process
])
def test_computed_loader_settings(cpus: int, cuda: bool, sharing: int, workers: int) -> None:
    p = plan(cpus, cuda, sharing)
    assert p.num_workers == workers
    assert p.pin_memory is cuda
    assert p.persistent_workers is (workers > 0)
    assert p.prefetch_factor == (2 if workers else None)
    kw = p.kwargs()
    assert ("prefetch_factor" in kw) is (workers > 0)  # torch refuses it without workers
    assert p.sources["num_workers"].startswith("computed")


def test_argument_then_daemon_then_environment_win() -> None:
    p = plan(8, True, num_workers=2)
    assert (p.num_workers, p.sources["num_workers"]) == (2, "argument")
    p = plan(8, True, num_workers=2, settings={"num_workers": 5, "pin_memory": False})
    assert (p.num_workers, p.pin_memory) == (5, False)
    assert p.sources["num_workers"].startswith("daemon")
    p = plan(8, True, settings={"num_workers": 5, "prefetch_factor": 4},
             env={"TUNERD_NUM_WORKERS": "3", "TUNERD_PERSISTENT_WORKERS": "off"})
    assert (p.num_workers, p.persistent_workers, p.prefetch_factor) == (3, False, 4)
    assert p.sources["num_workers"] == "env TUNERD_NUM_WORKERS"
    # no workers: persistent_workers and prefetch_factor are dropped, and it says so
    p = plan(8, True, settings={"prefetch_factor": 4}, env={"TUNERD_NUM_WORKERS": "0"})
    assert (p.num_workers, p.persistent_workers, p.prefetch_factor) == (0, False, None)
    assert p.sources["prefetch_factor"].startswith("dropped")
    assert "num_workers=0 (env TUNERD_NUM_WORKERS)" in p.explain()


def test_bad_overrides_are_ignored_with_a_warning_naming_them(caplog) -> None:
    caplog.set_level(logging.WARNING, "tunerd.torch")
    got = env_overrides({"TUNERD_NUM_WORKERS": "lots", "TUNERD_AMP": "fp8",
                         "TUNERD_PIN_MEMORY": "yes", "TUNERD_PREFETCH_FACTOR": "0"})
    assert got == {"pin_memory": True}
    text = caplog.text
    assert "TUNERD_NUM_WORKERS" in text and "'lots'" in text
    assert "TUNERD_AMP" in text and "fp8" in text
    assert "TUNERD_PREFETCH_FACTOR" in text and "1..64" in text
    p = plan(4, False, settings={"num_workers": -1, "bogus": 1})
    assert p.num_workers == 2  # the computed value stands


def test_allocation_tells_own_cpus_from_shared_ones() -> None:
    own = allocation({2, 3}, local_world_size=2, local_rank=1, launcher_cpus=range(8))
    assert (own.ranks_sharing, own.slot, own.share) == (1, 0, 2)
    shared = allocation(range(8), local_world_size=2, local_rank=1, launcher_cpus=range(8))
    assert (shared.ranks_sharing, shared.slot, shared.share) == (2, 1, 4)
    single = allocation({0, 1}, env={})
    assert (single.ranks_sharing, single.cpus) == (1, (0, 1))
    from_env = allocation(range(4), env={"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2"},
                          launcher_cpus=range(4))
    assert (from_env.ranks_sharing, from_env.slot, from_env.share) == (4, 2, 1)


def test_workers_take_cpus_from_the_end_rank_by_rank() -> None:
    p = WorkerPinner((0, 1, 2, 3), num_workers=2)
    assert [p.cpu_for(w) for w in range(2)] == [3, 2]
    q = WorkerPinner((0, 1, 2, 3), num_workers=2, slot=1, ranks_sharing=2)
    assert [q.cpu_for(w) for w in range(2)] == [1, 0]
    wrap = WorkerPinner((4, 5), num_workers=3)
    assert [wrap.cpu_for(w) for w in range(3)] == [5, 4, 5]


PINNED_LOADER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import tunerd.torch as tt
import torch
from torch.utils.data import DataLoader, Dataset

class Where(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        torch.randperm(50000)  # pytorch#28389's trigger, after the pinning
        return torch.tensor([os.getpid(), int(os.environ.get("USER_FN_RAN", "0"))])

def user_fn(worker_id):
    os.environ["USER_FN_RAN"] = "1"

mode = sys.argv[1]
if mode == "kwargs":
    kw = tt.dataloader_kwargs(num_workers=2, cuda=False, settings={{}}, worker_init_fn=user_fn)
else:
    kw = dict(num_workers=2, persistent_workers=True, worker_init_fn=tt.worker_init_fn)
it = iter(DataLoader(Where(), batch_size=4, **kw))
seen = {{}}
for batch in it:
    for pid, ran in batch.tolist():
        seen[pid] = ran
print(sorted(seen.items()), flush=True)
sys.stdin.readline()  # the test reads /proc while the workers live
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("mode", ["kwargs", "plain"])
def test_each_worker_is_pinned_to_its_own_cpu(mode: str) -> None:
    code = PINNED_LOADER.format(repo=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", code, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        seen = dict(json.loads(p.stdout.readline().replace("(", "[").replace(")", "]")))
        assert len(seen) == 2, seen
        parent_cpus = set(task_cpus(p.pid).values())
        # workers from the end of the rank's set: worker 0 on the last CPU, 1 on the one before
        cpus = sorted(os.sched_getaffinity(0))
        got = {pid: set(task_cpus(pid).values()) for pid in seen}
        assert sorted(next(iter(c)) for c in got.values()) == sorted(
            str(c) for c in cpus[-2:]), got
        assert all(len(c) == 1 for c in got.values()), got  # every thread of each worker
        assert "0-1" in parent_cpus or len(parent_cpus) >= 1  # the main process is not pinned
        if mode == "kwargs":
            assert set(seen.values()) == {1}  # the user's worker_init_fn ran too
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(60) == 0
    finally:
        p.kill()
        p.wait()


def test_step_reporter_measures_without_a_daemon() -> None:
    rep = StepReporter(batch_size=32, interval=0.1, daemon=False)
    t0 = time.perf_counter()
    for _ in range(21):
        time.sleep(0.01)
        rep.step()
    wall = time.perf_counter() - t0
    s = rep.close()
    assert s["steps"] == 21 and s["samples"] == 21 * 32
    assert 0.009 <= s["step_time_s"] < 0.2
    # 20 timed steps of 32 samples over their own span
    assert s["samples_per_s"] == pytest.approx(20 * 32 / s["elapsed_s"])
    assert s["elapsed_s"] <= wall
    assert s["device"] == "cpu" and s["memory"]["rss"] > 10 << 20
    assert s["daemon"] == "off" and s["last_interval"]["steps"] >= 1


def test_step_reporter_never_raises_or_waits_without_a_daemon(tmp_path: Path) -> None:
    rep = StepReporter(batch_size=8, interval=0.1, socket_path=str(tmp_path / "none.sock"))
    t0 = time.perf_counter()
    for _ in range(200):
        rep.step()
    rep.step()
    assert time.perf_counter() - t0 < 1.0
    time.sleep(0.11)
    rep.step()  # an interval passed: it tries the daemon once, then backs off
    s = rep.close()
    assert s["daemon"].startswith("unreachable:") and "none.sock" in s["daemon"]
    assert s["reports_sent"] == 0


def test_report_arguments_follow_the_wire_spec(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    r = current_report(steps=10, step_time_s=0.5, samples_per_s=64.0, num_workers=2)
    assert set(r) == {"pid", "steps", "step_time_s", "samples_per_s", "device", "memory",
                      "workers", "num_workers", "rank", "local_rank", "local_world_size",
                      "job"}
    assert (r["pid"], r["device"], r["num_workers"]) == (os.getpid(), "cpu", 2)
    assert set(r["memory"]) == {"rss"} and isinstance(r["workers"], list)
    assert (r["rank"], r["local_rank"], r["local_world_size"]) == (None, 1, 2)


def test_the_job_id_is_shared_by_the_ranks_of_one_job_on_every_node() -> None:
    from tunerd.torch.link import job_id

    assert job_id({"TUNERD_JOB": "llm-7b", "SLURM_JOB_ID": "42"}) == "llm-7b"
    assert job_id({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "abc"}) == "slurm-42"
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "n1",
                   "MASTER_PORT": "29500"}) == "n1:29500"
    assert job_id({"TUNERD_JOB": "-my job;$x"}) == "j-my_job__x"  # a valid label value
    assert job_id({}) is None


FORKING_PARENT = """
import os, subprocess, sys, time
kids = []
for _ in range(2):  # forked like torch's workers: the same command line
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
# another command line that names itself as torch names its workers
named = subprocess.Popen([sys.executable, "-c", "import time; "
                          "open('/proc/self/comm', 'w').write('pt_data_worker'); "
                          "time.sleep(60)"])
# and a helper that is neither
other = subprocess.Popen(["sleep", "60"])
print(kids, named.pid, other.pid, flush=True)
sys.stdin.readline()
"""


def test_dataloader_workers_are_read_from_proc() -> None:
    from tunerd.torch import dataloader_workers

    p = subprocess.Popen([sys.executable, "-c", FORKING_PARENT], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        kids_text, named, other = p.stdout.readline().rsplit(maxsplit=2)
        forked = json.loads(kids_text)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{named}/comm").read_text().strip() != "pt_data_worker":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert dataloader_workers(p.pid) == sorted([*forked, int(named)])
        assert int(other) not in dataloader_workers(p.pid)
        assert dataloader_workers(2 ** 22 + 1) == []  # no such process: nothing, no error
    finally:
        os.killpg(p.pid, 9)  # the session we started, by its id
        p.wait()


def test_step_reporter_reaches_the_daemon(daemon) -> None:
    rep = StepReporter(batch_size=16, interval=0.1, socket_path=str(daemon.socket))
    for _ in range(6):
        time.sleep(0.03)
        rep.step()
    s = rep.close()
    assert s["daemon"] == "accepted", s
    assert s["reports_sent"] >= 1 and s["settings"] == {}


RULE_SETTINGS = """
[policy]
name = "settings"

[[job]]
name = "reporter-test"
match.cmdline = ["*tunerd-reporter-probe*"]
placement = "none"
torch = { num_workers = 3, amp = "bf16" }
"""

PROBE = """
import json, sys, time
sys.path.insert(0, {repo!r})
import tunerd.torch as tt
for _ in range(100):  # until the rule bound us
    if tt.daemon_settings(refresh=True):
        break
    time.sleep(0.05)
print(json.dumps(tt.daemon_settings()))
"""


def test_rule_settings_reach_the_helpers(daemon_factory, tmp_path: Path) -> None:
    from tests.helpers import write_policy

    pdir = tmp_path / "policies"
    write_policy(pdir, "00-settings.toml", RULE_SETTINGS)
    d = daemon_factory(policy_dir=pdir).start()
    link = DaemonLink(str(d.socket))
    link.send(current_report())
    link.close()
    assert link.status == "accepted", link.status
    out = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO)),
                          "tunerd-reporter-probe"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "TUNERD_SOCKET": str(d.socket)})
    assert json.loads(out.stdout) == {"num_workers": 3, "amp": "bf16"}, out.stderr


@pytest.fixture(scope="module")
def torch_mod():  # type: ignore[no-untyped-def]
    return pytest.importorskip("torch")


def test_amp_modes_on_cpu(torch_mod, caplog) -> None:
    from tunerd.torch import Amp

    torch = torch_mod
    computed = Amp("cpu", settings={}, env={})
    assert computed.mode == ("bf16" if cpu_has_native_bf16() else "off")
    assert computed.source == "computed" and not computed.scaler.is_enabled()
    amp = Amp("cpu", settings={"amp": "off"}, env={"TUNERD_AMP": "bf16"})
    assert (amp.mode, amp.source) == ("bf16", "environment")
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with amp.autocast():
        out = model(torch.randn(4, 16))
    assert out.dtype == torch.bfloat16
    amp.backward(out.float().pow(2).mean())
    amp.step(opt)
    assert not torch.equal(before, model.weight)  # the step happened
    caplog.set_level(logging.WARNING, "tunerd.torch")
    assert Amp("cpu", "fp16", settings={}, env={}).mode == "bf16"
    assert "fp16 autocast needs CUDA" in caplog.text
    off = Amp("cpu", settings={}, env={"TUNERD_AMP": "off"})
    with off.autocast():
        assert model(torch.randn(2, 16)).dtype == torch.float32


def test_compile_is_off_unless_asked(torch_mod) -> None:
    from tunerd.torch import maybe_compile

    model = torch_mod.nn.Linear(4, 4)
    assert maybe_compile(model, settings={}, env={}) is model
    compiled = maybe_compile(model, settings={}, env={"TUNERD_COMPILE": "1"})
    assert compiled is not model and compiled._orig_mod is model
    assert maybe_compile(model, True, settings={"compile": False}, env={}) is model


def test_helpers_write_what_they_resolved_for_bench(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import tunerd.torch as tt
        kw = tt.dataloader_kwargs(cuda=False, settings={{}})
        rep = tt.StepReporter(batch_size=4, daemon=False)
        for _ in range(3):
            rep.step()
        rep.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "TUNERD_BENCH_OUT": str(out), "TUNERD_NUM_WORKERS": "0"})
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    kinds = {x["kind"]: x for x in lines}
    assert kinds["dataloader"]["num_workers"] == 0
    assert kinds["dataloader"]["sources"]["num_workers"] == "env TUNERD_NUM_WORKERS"
    assert kinds["reporter"]["steps"] == 3


def test_cuda_paths_on_a_gpu_node(torch_mod) -> None:
    """Runs only where CUDA is (none on the dev VM): fp16 autocast with an enabled
    GradScaler, pinned memory by default, CUDA memory in the reporter."""
    torch = torch_mod
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    from tunerd.torch import Amp, StepReporter

    amp = Amp("cuda", "fp16", settings={}, env={})
    assert amp.mode == "fp16" and amp.scaler.is_enabled()
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp.autocast():
        out = model(torch.randn(8, 64, device="cuda"))
    assert out.dtype == torch.float16
    amp.backward(out.float().pow(2).mean())
    amp.step(opt)
    assert loader_plan(alloc=Allocation((0, 1, 2, 3)), settings={}, env={}).pin_memory
    rep = StepReporter(batch_size=8, daemon=False)
    rep.step()
    rep.step()
    mem = rep.close()["memory"]
    assert set(mem) == {"allocated", "reserved", "max_allocated"} and mem["allocated"] > 0
