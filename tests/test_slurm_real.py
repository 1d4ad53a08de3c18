"""tunerd under a real single-node Slurm 22.05 (issue 10, items 1-5).

slurmctld, slurmd and munged are started by tests/slurm_helpers.py with
task/affinity + task/cgroup, proctrack/cgroup, two mknod'd GPU gres, and the
contrib/slurm scripts as TaskProlog and Epilog. The tunerd beside it replays this
machine's real topology, recorded at start, plus two GPUs: GPU 0 local to the first
CPU, GPU 1 to the last (tests/leases_helpers.snapshot_with_gpus_here).

Items 1-3 check that placement starts from the caller's allocation: the step's
cpuset, the job's GPUs, the CPU count Slurm granted the task.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, wait_for
from tests.leases_helpers import cpus_allowed, leases_of, unique_sleeper
from tests.slurm_helpers import (
    Job,
    SlurmCluster,
    hung_socket,
    running_tunerd,
    slurm,  # noqa: F401 - the module-scoped fixture
    tunerctl_command,
)
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root

BOUND_S = 2.0  # what a hung or missing daemon may add to a task's start or a job's end

# Prints the cpuset of the task's Slurm step and the task's affinity as KEY=VALUE
# lines. The step's cgroup, not the task's own: `bind --mems` moves a process into a
# child cpuset (.../step_0/tunerd-PID-START) that holds only the CPUs it bound.
PROBE = r"""
probe() {
    cg=$(awk -F: '$2 == "cpuset" {print $3}' /proc/self/cgroup | sed 's#\(/step_[^/]*\)/.*#\1#')
    echo "${1}STEP_CPUSET=$(cat /sys/fs/cgroup/cpuset$cg/cpuset.cpus)"
    echo "${1}MASK=$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)"
}
"""

RANK_RULE = """\
[[job]]
name = "slurm-test-rank"
match.cmdline = ["*/{rank}*"]
match.env = {{ LOCAL_RANK = "*" }}
placement = "gpu-local"
"""


@pytest.fixture(scope="module")
def rank_bin(slurm: SlurmCluster) -> Path:  # noqa: F811
    """A copy of sleep(1) under a name only these tests use: the rule matches it alone."""
    return unique_sleeper(slurm.root / "jobs", f"tsr-rank-{slurm.root.name[-8:]}")


@pytest.fixture(scope="module")
def tunerd(slurm: SlurmCluster, rank_bin: Path) -> Iterator[DaemonProc]:  # noqa: F811
    policy = '[policy]\nname = "slurm-test"\n\n' + RANK_RULE.format(rank=rank_bin.name)
    with running_tunerd(slurm.root / "tunerd", policy) as d:
        yield d


@pytest.fixture(autouse=True)
def quiet_node(slurm: SlurmCluster, tunerd: DaemonProc) -> Iterator[None]:  # noqa: F811
    """Each test starts on an idle node with the scripts pointed at the tunerd."""
    slurm.configure_scripts(tunerd.socket, user_messages="all")
    idle_node(slurm)
    yield
    for jobid in slurm.jobs():
        slurm.cmd("scancel", str(jobid), timeout=10)
    idle_node(slurm)
    for lease in leases_of(tunerd):
        tunerd.ctl("release", lease["id"])


def idle_node(slurm: SlurmCluster, timeout: float = 30.0) -> None:  # noqa: F811
    wait_for(lambda: not slurm.jobs() and slurm.node_state() == "IDLE", timeout,
             "the node to be idle", interval=0.1,
             detail=lambda: f"{slurm.node_state()}, jobs {slurm.jobs()}\n{slurm.logs()}")


def kv(text: str) -> dict[str, str]:
    """KEY=VALUE lines of a job's output."""
    return dict(m.groups() for m in re.finditer(r"^([A-Z0-9_]+)=(.*)$", text, re.M))


def job_script(slurm: SlurmCluster, name: str, body: str) -> Path:  # noqa: F811
    p = slurm.root / "jobs" / f"{name}.sh"
    p.write_text("#!/bin/bash\n" + PROBE + body)
    p.chmod(0o755)
    return p


def tunerctl(d: DaemonProc) -> str:
    return f"{tunerctl_command()} --socket {d.socket}"


def rule_jobs(d: DaemonProc, pids: list[int]) -> dict[int, dict[str, Any]] | None:
    jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
    got = {p: jobs[p] for p in pids if p in jobs and jobs[p].get("origin") == "rule"}
    return got if len(got) == len(pids) else None


# -- item 1: the task prolog keeps the CPUs Slurm granted ------------------------------

def test_srun_c2_with_one_gpu_keeps_both_cpus(slurm: SlurmCluster,  # noqa: F811
                                              tunerd: DaemonProc) -> None:
    probe = job_script(slurm, "c2", 'probe ""\nsleep 1\n')
    r = slurm.srun("-c2", "--gres=gpu:1", str(probe))
    assert r.returncode == 0, r.stderr
    out = kv(r.stdout)
    assert "tunerd: bound near GPU 0" in r.stdout, r.stdout  # the prolog did bind the task
    assert len(parse_cpulist(out["STEP_CPUSET"])) == 2  # what Slurm granted
    assert out["MASK"] == out["STEP_CPUSET"], r.stdout  # ... and the task kept it all


# -- item 2: alloc inside a job takes only the job's GPUs -------------------------------

def _holder(slurm: SlurmCluster, *args: str) -> None:  # noqa: F811
    """A job holding one core (and what ``args`` ask) for the length of a test."""
    job = slurm.sbatch("exec sleep 300\n", "-c1", *args)
    slurm.wait_job_running(job)


def test_alloc_in_a_job_takes_only_the_jobs_gpus(slurm: SlurmCluster,  # noqa: F811
                                                 tunerd: DaemonProc) -> None:
    _holder(slurm, "--gres=gpu:1")  # Slurm gives it GPU 0 ...
    lease = slurm.root / "jobs" / "alloc-own.json"
    # srun steps have SLURM_STEP_GPUS; batch scripts SLURM_JOB_GPUS
    body = ('echo "JOB_GPUS=${SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}"\n'
            f"{tunerctl(tunerd)} --json alloc --gpus 1 > {lease}\n")
    r = slurm.srun("-c1", "--gres=gpu:1", str(job_script(slurm, "alloc-own", body)))
    assert r.returncode == 0, r.stderr
    assert kv(r.stdout)["JOB_GPUS"] == "1"  # ... and this job GPU 1
    got = json.loads(lease.read_text())
    assert got["gpus"] == [1], got  # not GPU 0, the other job's


def test_alloc_in_a_job_without_gres_gets_no_gpu(slurm: SlurmCluster,  # noqa: F811
                                                 tunerd: DaemonProc) -> None:
    _holder(slurm, "--gres=gpu:1")
    lease = slurm.root / "jobs" / "alloc-none.json"
    body = (f"{tunerctl(tunerd)} --json alloc --gpus 1 > {lease} 2>{lease}.err\n"
            'echo "ALLOC_RC=$?"\n')
    r = slurm.srun("-c1", str(job_script(slurm, "alloc-none", body)))
    assert r.returncode == 0, r.stderr
    rc = int(kv(r.stdout)["ALLOC_RC"])
    got = json.loads(lease.read_text())
    if rc == 0:
        assert got["gpus"] == [], got  # a job with no GPUs is given none
    else:
        assert rc == 1 and "GPU" in got["error"]["message"], got


# -- item 3: placement inside the step ------------------------------------------------

def test_run_in_a_step_with_one_cpu_places_inside_it(slurm: SlurmCluster,  # noqa: F811
                                                     tunerd: DaemonProc) -> None:
    _holder(slurm)  # takes the first core: this step gets another one
    ctl = tunerctl(tunerd)
    lib = slurm.root / "jobs" / "probe.sh"
    lib.write_text(PROBE)
    body = f"""probe ""
{ctl} run --gpus 1 -- bash -c '. {lib}; probe GPUS_'; echo "GPUS_RC=$?"
{ctl} run --ncpus 1 -- bash -c '. {lib}; probe NCPUS_'; echo "NCPUS_RC=$?"
"""
    r = slurm.srun("-c1", "--gres=gpu:1", str(job_script(slurm, "run-in-step", body)))
    assert r.returncode == 0, r.stderr
    out = kv(r.stdout)
    step = parse_cpulist(out["STEP_CPUSET"])
    assert len(step) == 1 and step != {0}, r.stdout  # the holder has the first core
    for which in ("GPUS", "NCPUS"):
        assert out.get(f"{which}_RC") == "0", r.stdout + r.stderr  # the command ran ...
        assert parse_cpulist(out[f"{which}_MASK"]) <= step, r.stdout  # ... inside the step


def test_rule_bound_ranks_in_a_c1_step_bind_inside_it(slurm: SlurmCluster,  # noqa: F811
                                                      tunerd: DaemonProc,
                                                      rank_bin: Path) -> None:
    body = f"""probe ""
for r in 0 1; do LOCAL_RANK=$r {rank_bin} 300 & echo "RANK$r=$!"; done
echo READY
wait
"""
    job = slurm.sbatch(PROBE + body, "-c1", "--gres=gpu:2")
    out = kv(slurm.wait_output(job, "READY"))
    step = parse_cpulist(out["STEP_CPUSET"])
    assert len(step) == 1, out
    pids = [int(out["RANK0"]), int(out["RANK1"])]
    # each rank wants its GPU's CPU; one of those two CPUs is outside this step
    bound = wait_for(lambda: rule_jobs(tunerd, pids), 15, "both ranks rule-bound",
                     detail=lambda: str(tunerd.ctl("--json", "status").json().get("errors")))
    for pid in pids:
        assert parse_cpulist(bound[pid]["cpus"]) <= step
        assert parse_cpulist(cpus_allowed(pid) or "") <= step


# -- item 4: a stopped, hung or missing daemon costs at most 2 s ------------------------

def _timed_job(slurm: SlurmCluster) -> tuple[int, float, float]:  # noqa: F811
    """Run a one-task GPU step; (job id, seconds srun took, seconds until the node is idle)."""
    t0 = time.monotonic()
    r = slurm.srun("-c1", "--gres=gpu:1", "bash", "-c", 'echo "JOB=$SLURM_JOB_ID"')
    t1 = time.monotonic()
    assert r.returncode == 0, r.stderr
    wait_for(lambda: slurm.node_state() == "IDLE", 30, "the node to be idle after the job",
             interval=0.05, detail=lambda: f"{slurm.node_state()}\n{slurm.logs()}")
    t2 = time.monotonic()
    return int(kv(r.stdout)["JOB"]), t1 - t0, t2 - t1


def test_a_stopped_hung_or_missing_daemon_adds_at_most_2s(slurm: SlurmCluster,  # noqa: F811
                                                          tunerd: DaemonProc) -> None:
    assert slurm.syslog is not None
    _, base_start, base_end = _timed_job(slurm)
    results = {}
    assert tunerd.proc is not None
    tunerd.proc.send_signal(signal.SIGSTOP)
    try:
        results["stopped"] = _timed_job(slurm)
    finally:
        tunerd.proc.send_signal(signal.SIGCONT)
    with hung_socket(slurm.root / "hung.sock") as hung:
        slurm.configure_scripts(hung)
        results["hung socket"] = _timed_job(slurm)
    slurm.configure_scripts(slurm.root / "gone.sock")
    results["no daemon"] = _timed_job(slurm)
    for what, (job, start, end) in results.items():
        assert start - base_start <= BOUND_S, (what, start, base_start)
        assert end - base_end <= BOUND_S, (what, end, base_end)
        # the scripts really ran into the daemon's state, and said so
        slurm.syslog.wait_for(f"tunerd-task-prolog: job {job}.0 task 0: not bound")
        slurm.syslog.wait_for(f"tunerd-epilog: job {job}: leases tagged slurm:{job} not released")
    log = slurm.slurmd_log.read_text()
    assert not re.search(r"(prolog|epilog) for job \d+ ran for", log, re.I), log[-2000:]
    print("added by the daemon's state (s), start/end:", {
        k: (round(s - base_start, 2), round(e - base_end, 2)) for k, (_, s, e) in results.items()})


# -- item 5: messages where admins and users look -------------------------------------

def test_messages_reach_syslog_and_the_jobs_output(slurm: SlurmCluster,  # noqa: F811
                                                   tunerd: DaemonProc) -> None:
    assert slurm.syslog is not None
    # the job's own TUNERCTL / TUNERD_SOCKET / PATH do not steer the task prolog
    body = f'echo "JOB=$SLURM_JOB_ID"\n{tunerctl(tunerd)} alloc --gpus 1 > /dev/null\n'
    r = slurm.srun("-c1", "--gres=gpu:1",
                   "--export=ALL,TUNERCTL=/bin/false,TUNERD_SOCKET=/nonexistent,PATH=/nonexistent",
                   str(job_script(slurm, "messages", body)))
    assert r.returncode == 0, r.stderr
    job = int(kv(r.stdout)["JOB"])
    # the user sees it in the job's output ...
    assert re.search(r"^tunerd: bound near GPU 0: bound pid \d+", r.stdout, re.M), r.stdout
    # ... the admin in syslog, from the task prolog and from the epilog
    msg = slurm.syslog.wait_for(f"tunerd-task-prolog: job {job}.0 task 0: bound near GPU 0")
    assert "tunerd-slurm:" in msg
    slurm.syslog.wait_for(f"tunerd-epilog: job {job}: released lease")
    wait_for(lambda: not leases_of(tunerd), 10, "the epilog to end the lease")
    # a task that cannot be bound says so in the job's output, too
    slurm.configure_scripts(slurm.root / "gone.sock", user_messages="problems")
    r = slurm.srun("-c1", "--gres=gpu:1", "true")
    assert r.returncode == 0 and r.stdout.startswith("tunerd: not bound (tunerctl exit 3)"), \
        r.stdout  # (a missing socket fails at once: no time-out involved)


# -- issue 15: tasks and ranks split their allocation; leases die with their job ---------

def test_two_tasks_of_a_step_stay_on_different_cpus(slurm: SlurmCluster,  # noqa: F811
                                                    tunerd: DaemonProc) -> None:
    """srun -n2 -c1 with one GPU: Slurm binds the tasks to different CPUs, and the
    TaskProlog's bind (both near GPU 0) keeps them apart."""
    probe = job_script(slurm, "two-tasks", 'probe "T${SLURM_LOCALID}_"\nsleep 1\n')
    r = slurm.srun("-n2", "-c1", "--gres=gpu:1", str(probe))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tunerd: bound near GPU") == 2, r.stdout
    out = kv(r.stdout)
    a, b = parse_cpulist(out["T0_MASK"]), parse_cpulist(out["T1_MASK"])
    assert len(a) == len(b) == 1 and a != b, r.stdout


def test_ranks_of_a_two_cpu_job_get_one_cpu_each(slurm: SlurmCluster,  # noqa: F811
                                                 tunerd: DaemonProc, rank_bin: Path) -> None:
    """sbatch -c2 starting two ranks: they split the job's 2 CPUs (not 2 CPUs each)."""
    body = f"""probe ""
for r in 0 1; do LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 {rank_bin} 300 & echo "RANK$r=$!"; done
echo READY
wait
"""
    job = slurm.sbatch(PROBE + body, "-c2", "--gres=gpu:2")
    out = kv(slurm.wait_output(job, "READY"))
    step = parse_cpulist(out["STEP_CPUSET"])
    pids = [int(out["RANK0"]), int(out["RANK1"])]
    bound = wait_for(lambda: rule_jobs(tunerd, pids), 15, "both ranks rule-bound",
                     detail=lambda: str(tunerd.ctl("--json", "status").json().get("errors")))
    sets = [parse_cpulist(bound[p]["cpus"]) for p in pids]
    assert len(step) == 2 and all(len(s) == 1 and s <= step for s in sets), (step, sets)
    assert sets[0] != sets[1], sets
    assert [parse_cpulist(cpus_allowed(p) or "") for p in pids] == sets


def test_a_lease_of_a_job_that_ended_while_tunerd_was_down_is_gone_at_start(
        slurm: SlurmCluster, tunerd: DaemonProc) -> None:  # noqa: F811
    """An alloc lease with the user's own tag (the Epilog releases only slurm:JOB) made
    inside a job that ends while tunerd is stopped: gone when tunerd starts."""
    out = slurm.root / "jobs" / "own-tag.json"
    job = slurm.sbatch(f"{tunerctl(tunerd)} --json alloc --gpus 0 --ncpus 1 --tag my-own "
                       f"> {out}\necho READY\nexec sleep 300\n", "-c1")
    slurm.wait_output(job, "READY")
    lid = json.loads(out.read_text())["id"]
    assert lid in [x["id"] for x in leases_of(tunerd)]
    tunerd.stop()
    try:
        slurm.cmd("scancel", str(job.jobid), timeout=10)
        idle_node(slurm)
    finally:
        tunerd.start()
    assert lid not in [x["id"] for x in leases_of(tunerd)]
    assert f"lease {lid} released: its job (slurm:{job.jobid}) ended" in tunerd.log()


def test_a_jobs_own_exclusive_lease_does_not_block_its_steps(
        slurm: SlurmCluster, tunerd: DaemonProc) -> None:  # noqa: F811
    """A one-CPU job takes an exclusive lease of its GPU and CPU, then runs a step on
    them: the TaskProlog still binds the step's task (the lease is the job's own)."""
    lease = slurm.root / "jobs" / "own-exclusive.json"
    lib = slurm.root / "jobs" / "probe.sh"
    lib.write_text(PROBE)
    body = f"""probe ""
{tunerctl(tunerd)} --json alloc --gpus 1 --exclusive > {lease}
srun --quiet -n1 -c1 --gres=gpu:1 bash -c '. {lib}; probe STEP_'
echo "SRUN_RC=$?"
"""
    job = slurm.sbatch(PROBE + body, "-c1", "--gres=gpu:1")
    text = slurm.wait_output(job, "SRUN_RC")
    out = kv(text)
    got = json.loads(lease.read_text())
    assert got["exclusive"] and got["cpus"], got
    assert out["SRUN_RC"] == "0", text
    assert "tunerd: bound near GPU" in text and "not bound" not in text, text
    assert parse_cpulist(out["STEP_MASK"]) <= parse_cpulist(out["STEP_CPUSET"]), text


@contextlib.contextmanager
def srun_in_background(slurm: SlurmCluster, name: str,  # noqa: F811
                       *args: str) -> Iterator[Job]:
    """``srun ARGS`` running while the block runs (its tasks' output in a file); ended
    by PID after it (srun passes the SIGTERM to its tasks)."""
    out = slurm.root / "jobs" / f"{name}.out"
    p = subprocess.Popen(["srun", "--quiet", f"--output={out}", *args], env=slurm.env,
                         cwd=slurm.root / "jobs", stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield Job(0, out)  # (an interactive job: its id is in its output)
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_two_jobs_at_once_with_two_gpu_tasks_per_step(slurm: SlurmCluster,  # noqa: F811
                                                      tunerd: DaemonProc) -> None:
    """Two jobs running at the same time, each one step of two GPU tasks bound by the
    TaskProlog: every task stays inside its own job's cpuset and the jobs' tasks share
    no CPU, although each job's GPU is local to the *other* job's CPU.

    What this 2-CPU node allows: four tasks on two CPUs cannot be disjoint both within
    each step and across the jobs, and the two gres GPUs allow one per job (two jobs of
    ``--gres=gpu:2`` cannot run at once). So each job is ``srun -n2 -c1 --overcommit
    --gres=gpu:1``: one CPU and one GPU per job, both tasks on that GPU and that CPU
    (tasks of a step on disjoint CPUs: test_two_tasks_of_a_step_stay_on_different_cpus).
    A holder job takes the first CPU while job A starts, so that job A gets another CPU
    with GPU 0 (local to the first CPU) and job B the first CPU with GPU 1 (local to the
    last): placing near the GPU alone would put each job on the other's CPU.
    """
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    lo, hi = min(online), max(online)  # GPU 0's CPU, GPU 1's (slurm_helpers.start_tunerd)
    task = job_script(slurm, "two-gpu-tasks", 'probe "T${SLURM_LOCALID}_"\n'
                      'echo "T${SLURM_LOCALID}_PID=$$"\n'
                      'echo "T${SLURM_LOCALID}_GPUS=$SLURM_STEP_GPUS"\n'
                      "exec sleep 300\n")
    step = ("-n2", "-c1", "--overcommit", "--gres=gpu:1", str(task))
    holder = slurm.sbatch("exec sleep 300\n", "-c1")
    slurm.wait_job_running(holder)
    with srun_in_background(slurm, "job-a", *step) as job_a:
        slurm.wait_output(job_a, "T1_GPUS=")
        slurm.cancel(holder)  # its CPU, the first, is job B's
        with srun_in_background(slurm, "job-b", *step) as job_b:
            jobs = [job_a, job_b]
            for j in jobs:  # both tasks of both jobs started (and bound: the prolog is first)
                slurm.wait_output(j, "T0_GPUS=")
                slurm.wait_output(j, "T1_GPUS=")
            outs = [kv(j.output.read_text()) for j in jobs]
            masks = {(j, t): parse_cpulist(cpus_allowed(int(o[f"{t}_PID"])) or "")
                     for j, o in enumerate(outs) for t in ("T0", "T1")}  # both jobs running
    steps = [parse_cpulist(o["T0_STEP_CPUSET"]) for o in outs]
    # what Slurm did: job A off GPU 0's CPU, job B off GPU 1's, neither on the other's
    assert [o["T0_GPUS"] for o in outs] == ["0", "1"], outs
    assert lo not in steps[0] and hi not in steps[1] and not steps[0] & steps[1], outs
    for j, (o, cpus) in enumerate(zip(outs, steps, strict=True)):
        text = jobs[j].output.read_text()
        for t in ("T0", "T1"):
            pid = int(o[f"{t}_PID"])
            assert f"tunerd: bound near GPU {o['T0_GPUS']}: bound pid {pid} " in text, text
            # inside its own job's cpuset, so off the other job's
            assert masks[j, t] <= cpus and masks[j, t] == parse_cpulist(o[f"{t}_MASK"]), \
                (j, t, masks, o)
