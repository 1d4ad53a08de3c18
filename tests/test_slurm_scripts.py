"""contrib/slurm scripts run directly with the environment Slurm gives them, against a
real daemon, a hung one, a stopped one and none; and `tunerctl --timeout`.

The same scripts under a real slurmd: tests/test_slurm_real.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, CliResult, DaemonProc, run_ctl, wait_for
from tests.leases_helpers import (
    DGX_H100,
    cpus_allowed,
    kill,
    leases_of,
    snapshot_with_gpus_here,
    spawn,
)
from tests.slurm_helpers import (
    SyslogSink,
    hung_socket,
    install_scripts,
    write_script_conf,
)
from tunerd.jobs.binding import Originals
from tunerd.jobs.records import Binding, Hold

pytestmark = pytest.mark.root

# The contract: a hung or missing daemon adds at most this much to a task's start
# or a job's end. Measured around the whole script, so it includes sh, tunerctl's
# Python start-up, logger and the guard's kill.
BOUND_S = 2.0
PROLOG = "tunerd-task-prolog.sh"
EPILOG = "tunerd-epilog.sh"


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    return install_scripts(tmp_path / "contrib")


@pytest.fixture
def syslog(tmp_path: Path) -> Iterator[SyslogSink]:
    sink = SyslogSink(tmp_path / "syslog.sock")
    yield sink
    sink.close()


def configure(scripts: Path, sock: Path | str, syslog: SyslogSink | None = None,
              **kw: object) -> Path:
    return write_script_conf(scripts / "tunerd-slurm.conf", sock,
                             syslog.path if syslog else None, **kw)  # type: ignore[arg-type]


def run_script(scripts: Path, name: str, env: dict[str, str],
               timeout: float = 30) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a script with exactly ``env`` (Slurm gives the Epilog no PATH); (result, seconds)."""
    t0 = time.monotonic()
    r = subprocess.run([str(scripts / name)], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd="/")
    return r, time.monotonic() - t0


def task_env(pid: int, localid: int = 0, **extra: str) -> dict[str, str]:
    """What slurmstepd gives a TaskProlog (plus the job's own variables in ``extra``)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_LOCALID": str(localid), "SLURM_TASK_PID": str(pid),
            "SLURM_STEP_TASKS_PER_NODE": "2(x1)", **extra}


def epilog_env(job: str = "4242") -> dict[str, str]:
    """What slurmd gives an Epilog: no PATH, no HOME, a few SLURM_* variables."""
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root"}


# -- with a working daemon ------------------------------------------------------------

@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_task_prolog_binds_each_task_near_its_gpu(tmp_path: Path, scripts: Path,
                                                  syslog: SyslogSink, daemon_factory) -> None:
    snap, lo, hi = snapshot_with_gpus_here(tmp_path / "snap.json")
    d = daemon_factory(args=["--topology", str(snap)]).start()
    configure(scripts, d.socket, syslog, user_messages="all")
    t0 = spawn(["sleep", "30"])
    t1 = spawn(["sleep", "30"])
    try:
        for pid, lid in ((t0.pid, 0), (t1.pid, 1)):
            r, _ = run_script(scripts, PROLOG,
                              task_env(pid, lid, CUDA_VISIBLE_DEVICES="0,1",
                                       SLURM_STEP_GPUS="0,1"))
            assert r.returncode == 0
            assert f"bound near GPU {lid}" in r.stderr, r.stderr
            # stdout is read by slurmstepd: only "print" lines, here one for the user
            assert r.stdout.startswith(f"print tunerd: bound near GPU {lid}: bound pid {pid}")
            assert all(x.startswith("print ") for x in r.stdout.splitlines())
            msg = syslog.wait_for(f"task {lid}: bound near GPU {lid}")
            assert "tunerd-slurm:" in msg and "job 4242.0" in msg
        assert cpus_allowed(t0.pid) == str(lo)
        assert cpus_allowed(t1.pid) == str(hi)
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert jobs[t0.pid]["gpus"] == [0] and jobs[t1.pid]["gpus"] == [1]
    finally:
        kill(t0)
        kill(t1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_tasks_of_a_step_keep_their_cpus_across_a_daemon_restart(
        tmp_path: Path, scripts: Path, daemon_factory) -> None:
    """Three tasks of one step, all on GPU 0 (local to CPU ``lo``), bound by the
    TaskProlog: task 0 takes ``lo``, task 1 is kept off it (``hi``). The daemon is killed
    (SIGKILL) right after the second bind -- a hold saved with the binding's first record,
    not by a later deferred save -- and restarts,
    task 1 ends, task 2 is bound: it takes the room task 1 left (its restored hold ended
    with it), not task 0's CPU -- the restored binding of task 0 holds its CPU against
    the step's other tasks. (Three disjoint tasks need 3 CPUs; this machine has 2, so
    the third finds room once one ends.)"""
    snap, lo, hi = snapshot_with_gpus_here(tmp_path / "snap.json")
    d = daemon_factory(args=["--topology", str(snap)]).start()
    configure(scripts, d.socket)
    # the tasks' own environment: what the intake reads (a Slurm task of job 4243 step 0)
    step = {"SLURM_JOB_ID": "4243", "SLURM_STEP_ID": "0", "SLURM_STEP_GPUS": "0",
            "SLURM_STEP_TASKS_PER_NODE": "3"}
    tasks = [spawn(["sleep", "60"], env={**step, "SLURM_LOCALID": str(i)}) for i in range(3)]

    def prolog(i: int) -> str | None:
        r, _ = run_script(scripts, PROLOG, task_env(tasks[i].pid, i, **step))
        assert r.returncode == 0 and "bound near GPU 0" in r.stderr, r.stderr
        return cpus_allowed(tasks[i].pid)

    try:
        assert [prolog(0), prolog(1)] == [str(lo), str(hi)]
        assert d.proc is not None
        d.proc.kill()
        d.proc.wait(10)
        d.start()
        for t in tasks[:2]:
            assert f"pid {t.pid}: reservation restored (CPUs " in d.log()
        kill(tasks[1])
        wait_for(lambda: f"bound process {tasks[1].pid} exited" in d.log(), 10,
                 "task 1's exit noticed")
        assert prolog(2) == str(hi), d.log()[-3000:]  # not lo: task 0 holds it
        assert cpus_allowed(tasks[0].pid) == str(lo)
    finally:
        for t in tasks:
            kill(t)


def test_a_binding_saved_without_a_hold_loads() -> None:
    """State written by a daemon that kept no holds (or a damaged hold): the binding
    loads (its originals matter for unbind), only without a reservation to restore."""
    orig = Originals(pid=7, start_time=1, process_cpus=frozenset({0}))
    rec = Binding(pid=7, start_time=1, originals=orig, cpus="1",
                  hold=Hold(group="slurm:4243.0", job="slurm:4243", uid=1000))
    raw = rec.to_json()
    assert Binding.from_json(raw) == rec
    for hold in (None, "x", {"group": 5, "exclusive": False}, {"group": "g"}):
        old = {k: v for k, v in raw.items() if k != "hold"}
        if hold is not None:
            old["hold"] = hold
        assert Binding.from_json(old) == dataclasses.replace(rec, hold=None)


def test_task_prolog_never_fails_the_task(tmp_path: Path, scripts: Path,
                                          daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    configure(scripts, d.socket, user_messages="problems")
    t = spawn(["sleep", "30"])
    try:
        before = cpus_allowed(t.pid)
        # a replayed node: nothing applied, said on stderr and to the user, exit 0
        r, _ = run_script(scripts, PROLOG, task_env(t.pid, 0, CUDA_VISIBLE_DEVICES="3"))
        assert r.returncode == 0 and "not bound" in r.stderr and "nothing was applied" in r.stderr
        assert r.stdout.startswith("print tunerd: not bound")
        # no GPUs in the task: left to Slurm, nothing for the user
        r, _ = run_script(scripts, PROLOG, task_env(t.pid, 0))
        assert r.returncode == 0 and "no GPUs" in r.stderr and r.stdout == ""
        # daemon down
        configure(scripts, tmp_path / "none.sock", user_messages="problems")
        r, _ = run_script(scripts, PROLOG, task_env(t.pid, 0, CUDA_VISIBLE_DEVICES="0"))
        assert r.returncode == 0 and "not reachable" in r.stderr
        assert str(tmp_path / "none.sock") in r.stdout
        assert cpus_allowed(t.pid) == before
    finally:
        kill(t)


def test_user_messages_setting(scripts: Path, daemon_factory, tmp_path: Path) -> None:
    snap, _, _ = snapshot_with_gpus_here(tmp_path / "snap.json")
    d = daemon_factory(args=["--topology", str(snap)]).start()
    t = spawn(["sleep", "30"])
    try:
        env = task_env(t.pid, 0, SLURM_STEP_GPUS="0")
        configure(scripts, d.socket, user_messages="problems")
        r, _ = run_script(scripts, PROLOG, env)
        assert r.returncode == 0 and "bound near GPU 0" in r.stderr and r.stdout == ""
        configure(scripts, tmp_path / "none.sock", user_messages="none")
        r, _ = run_script(scripts, PROLOG, env)
        assert r.returncode == 0 and "not bound" in r.stderr and r.stdout == ""
    finally:
        kill(t)


def test_epilog_releases_the_jobs_leases_with_no_path(scripts: Path, syslog: SyslogSink,
                                                      daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    env = {**os.environ, "SLURM_JOB_ID": "777", "SLURM_JOB_GPUS": "2,5"}
    r = subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket),
                        "alloc", "--gpus", "2"], cwd=REPO, env=env, capture_output=True,
                       text=True, check=True)
    assert "TUNERD_LEASE=L1" in r.stdout
    other = d.ctl("alloc", "--gpus", "1", "--tag", "slurm:778", "--json").json()["id"]
    configure(scripts, d.socket, syslog)
    r2, _ = run_script(scripts, EPILOG, epilog_env("777"))
    assert r2.returncode == 0, r2.stderr
    assert [x["id"] for x in leases_of(d)] == [other]
    assert "released lease L1" in syslog.wait_for("tunerd-epilog: job 777")
    # nothing to release: no syslog line (most jobs never alloc)
    n = len(syslog.messages())
    r3, _ = run_script(scripts, EPILOG, epilog_env("779"))
    assert r3.returncode == 0 and "no lease tagged" not in r3.stderr
    time.sleep(0.2)
    assert len(syslog.messages()) == n


def test_epilog_takes_overrides_from_slurmds_side(tmp_path: Path, scripts: Path,
                                                  daemon_factory) -> None:
    """The Epilog's environment is slurmd's: TUNERD_SOCKET/TUNERCTL there beat the config."""
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    d.ctl("alloc", "--gpus", "1", "--tag", "slurm:31")
    configure(scripts, tmp_path / "wrong.sock")
    r, _ = run_script(scripts, EPILOG, {**epilog_env("31"), "TUNERD_SOCKET": str(d.socket)})
    assert r.returncode == 0 and "released lease L1" in r.stderr, r.stderr
    assert leases_of(d) == []


def test_task_prolog_ignores_the_jobs_environment(tmp_path: Path, scripts: Path,
                                                  daemon_factory) -> None:
    """TUNERCTL, TUNERD_SOCKET, TUNERCTL_TIMEOUT, PATH, PYTHONPATH come from the user's job."""
    snap, lo, _ = snapshot_with_gpus_here(tmp_path / "snap.json")
    d = daemon_factory(args=["--topology", str(snap)]).start()
    configure(scripts, d.socket)
    marker = tmp_path / "evil-ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    for tool in ("tunerctl", "timeout", "logger", "env", "awk", "sed"):
        (evil / tool).write_text(f"#!/bin/sh\necho {tool} >> {marker}\nexit 0\n")
        (evil / tool).chmod(0o755)
    (evil / "tunerd").mkdir()
    (evil / "tunerd" / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('py')\n")
    with hung_socket(tmp_path / "hung.sock") as hung:
        t = spawn(["sleep", "30"])
        try:
            r, _ = run_script(scripts, PROLOG, task_env(
                t.pid, 0, SLURM_STEP_GPUS="0", PATH=f"{evil}:/usr/bin:/bin",
                TUNERCTL=str(evil / "tunerctl"), TUNERD_SOCKET=str(hung),
                TUNERCTL_TIMEOUT="600", PYTHONPATH=str(evil)))
            assert r.returncode == 0 and "bound near GPU 0" in r.stderr, r.stderr
            assert cpus_allowed(t.pid) == str(lo)
            assert not marker.exists(), marker.read_text()
        finally:
            kill(t)


def test_config_problems_are_reported_and_unsafe_configs_ignored(
        tmp_path: Path, scripts: Path, syslog: SyslogSink, daemon_factory,
        unpriv_user: tuple[int, int]) -> None:
    d: DaemonProc = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    d.ctl("alloc", "--gpus", "1", "--tag", "slurm:51")
    conf = configure(scripts, d.socket, syslog,
                     extra="BOGUS=1\nTIMEOUT=soon\n# a comment\nUSER_MESSAGES = all  # ok\n")
    r, _ = run_script(scripts, EPILOG, epilog_env("51"))
    assert r.returncode == 0 and "released lease L1" in r.stderr
    msg = syslog.wait_for("tunerd-epilog: job 51")
    assert f"{conf}:7: unknown key BOGUS" in msg
    assert f"{conf}:8: TIMEOUT=soon is not a positive number of seconds" in msg
    # a config someone other than root could change is not read at all
    for change in (lambda: conf.chmod(0o664),
                   lambda: os.chown(conf, unpriv_user[0], unpriv_user[1])):
        configure(scripts, d.socket, syslog)
        change()
        r, _ = run_script(scripts, EPILOG, epilog_env("52"))
        assert r.returncode == 0
        assert f"{conf} ignored" in r.stderr, r.stderr
        # ... so the defaults apply: no tunerctl in the usual places on a test machine
        if not Path("/usr/local/bin/tunerctl").exists():
            assert "tunerctl not found" in r.stderr


# -- bounded time ---------------------------------------------------------------------

def _stopped_daemon(tmp_path: Path, daemon_factory) -> Iterator[Path]:
    d: DaemonProc = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)
    try:
        yield d.socket
    finally:
        d.proc.send_signal(signal.SIGCONT)


def _hung(tmp_path: Path, daemon_factory) -> Iterator[Path]:
    with hung_socket(tmp_path / "hung.sock") as p:
        yield p


def _gone(tmp_path: Path, daemon_factory) -> Iterator[Path]:
    d: DaemonProc = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    d.kill9()  # leaves its socket file behind, nobody listening
    assert d.socket.exists()
    yield d.socket


def _absent(tmp_path: Path, daemon_factory) -> Iterator[Path]:
    yield tmp_path / "no-such.sock"


@pytest.mark.parametrize("daemon_state", [_stopped_daemon, _hung, _gone, _absent],
                         ids=["stopped", "hung-socket", "killed", "no-socket"])
def test_scripts_add_at_most_2s_when_the_daemon_hangs_or_is_gone(
        tmp_path: Path, scripts: Path, syslog: SyslogSink, daemon_factory,
        daemon_state) -> None:
    t = spawn(["sleep", "30"])
    gen = daemon_state(tmp_path, daemon_factory)
    sock = next(gen)
    try:
        configure(scripts, sock, syslog)
        before = cpus_allowed(t.pid)
        r, took = run_script(scripts, PROLOG, task_env(t.pid, 0, SLURM_STEP_GPUS="0"))
        assert r.returncode == 0 and took <= BOUND_S, (took, r.stderr)
        # exit 3: tunerctl's own --timeout; 124: the scripts' guard stopped it first
        assert re.search(r"not bound \(tunerctl exit (3|124)\)", r.stderr), r.stderr
        assert str(sock) in r.stderr, r.stderr
        assert r.stdout.startswith("print tunerd: not bound")
        assert cpus_allowed(t.pid) == before
        r, took = run_script(scripts, EPILOG, epilog_env("4242"))
        assert r.returncode == 0 and took <= BOUND_S, (took, r.stderr)
        assert re.search(r"not released \(tunerctl exit (3|124)\)", r.stderr), r.stderr
        assert str(sock) in r.stderr, r.stderr
        syslog.wait_for("tunerd-task-prolog: job 4242.0 task 0: not bound")
        syslog.wait_for("tunerd-epilog: job 4242: leases tagged slurm:4242 not released")
    finally:
        kill(t)
        for _ in gen:
            pass


def test_guard_stops_a_tunerctl_that_hangs_itself(tmp_path: Path, scripts: Path) -> None:
    """The outer `timeout -k` guard: a tunerctl wedged before its own timeout is stopped."""
    wedged = tmp_path / "wedged-tunerctl"
    wedged.write_text("#!/bin/sh\nsleep 30\n")  # a child that keeps the pipe open
    wedged.chmod(0o755)
    configure(scripts, tmp_path / "x.sock", extra=f"TUNERCTL={wedged}\n")
    t = spawn(["sleep", "30"])
    try:
        r, took = run_script(scripts, PROLOG, task_env(t.pid, 0, SLURM_STEP_GPUS="0"))
        assert r.returncode == 0 and took <= BOUND_S, (took, r.stderr)
        assert "did not finish within 1.4 s and was stopped" in r.stderr, r.stderr
        r, took = run_script(scripts, EPILOG, epilog_env())
        assert r.returncode == 0 and took <= BOUND_S, (took, r.stderr)
        assert "did not finish within 1.4 s" in r.stderr
    finally:
        kill(t)


# -- tunerctl --timeout ---------------------------------------------------------------

def ctl(*args: str, env: dict[str, str] | None = None) -> tuple[CliResult, float]:
    """tests.helpers.run_ctl, and how long it took (start-up included)."""
    t0 = time.monotonic()
    r = run_ctl(*args, env=env)
    return r, time.monotonic() - t0


def test_timeout_bounds_the_reply(tmp_path: Path) -> None:
    with hung_socket(tmp_path / "hung.sock") as sock:
        r, took = ctl("--socket", str(sock), "--timeout", "0.5", "status")
        assert r.rc == 3, r.err
        assert f"tunerd at {sock} did not answer 'status' within 0.5 s" in r.err
        assert "--timeout" in r.err and took < 10
        r, _ = ctl("--socket", str(sock), "--json", "bind", "1", "--cpus", "0",
                   env={"TUNERCTL_TIMEOUT": "0.3"})
        assert r.rc == 3
        err = json.loads(r.out)["error"]
        assert err["code"] == "unreachable" and "within 0.3 s" in err["message"]


def test_a_full_backlog_fails_at_once(tmp_path: Path) -> None:
    """A listener whose backlog is full: connect(2) on a Unix socket returns EAGAIN at
    once; the client retries until its timeout (a burst of connects clears in a few
    ms), then exits 3 saying the daemon is too busy, within the bound."""
    path = tmp_path / "full.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(0)
    fillers = []
    try:
        for _ in range(3):  # fill the backlog (never accepted)
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(str(path))
            except BlockingIOError:
                c.close()
                break
            fillers.append(c)
        r, took = ctl("--socket", str(path), "--timeout", "1", "status")
        assert r.rc == 3 and f"tunerd at {path} is too busy" in r.err, r.err
        assert took < 2.5
    finally:
        for c in fillers:
            c.close()
        srv.close()


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_timeout_must_be_a_positive_number(value: str) -> None:
    r, _ = ctl("--timeout", value, "status")
    assert r.rc == 2 and "--timeout" in r.err
    r, _ = ctl("status", env={"TUNERCTL_TIMEOUT": value})
    assert r.rc == 2 and "--timeout" in r.err


def test_timeout_with_a_working_daemon(daemon: DaemonProc) -> None:
    r, _ = ctl("--socket", str(daemon.socket), "--timeout", "5", "--json", "status")
    assert r.rc == 0, r.err
    assert r.out and "pid" in r.out


def test_the_scripts_own_tools_carry_no_rank_variable(scripts: Path, tmp_path: Path) -> None:
    """Issue 26: the TaskProlog's sed/awk/logger/tunerctl were bound as ranks (they
    carried the task's SLURM_LOCALID). After ts_init the script keeps the task's local
    id in TS_LOCALID, and what it runs sees no rank variable."""
    probe = tmp_path / "probe.sh"
    probe.write_text(f'TS_DIR={scripts}\n. "$TS_DIR/tunerd-slurm-common.sh"\n'
                     'ts_init untrusted\necho "localid=$TS_LOCALID"\n'
                     'env | grep -E "^(SLURM_LOCALID|LOCAL_RANK|OMPI_COMM_WORLD_LOCAL_RANK|'
                     'MPI_LOCALRANKID)=" || echo "no rank variable"\n')
    r = subprocess.run(["sh", str(probe)], capture_output=True, text=True, timeout=30,
                       env={**task_env(os.getpid(), localid=3), "LOCAL_RANK": "3",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["localid=3", "no", "rank", "variable"], r.stdout
