"""A daemon in a PID namespace of its own still binds (issue 34 item 6).

The kernel sends proc-connector events only to listeners in the initial PID namespace
(drivers/connector/cn_proc.c); a daemon in a container without hostPID, or in an
`unshare` sandbox, that subscribed anyway got nothing and bound nothing, silently: its
check read NSpid, which under a /proc mounted for the namespace shows one level. Here
the real daemon and a real torchrun run inside `unshare --pid --fork --mount-proc`: the
daemon knows where it is (its /proc/self/ns/pid is not the initial namespace's), says
so in status, and binds the ranks by scanning its namespace's /proc.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_ctl, wait_for
from tests.leases_helpers import cpus_allowed, local_ranks, snapshot_with_8_gpus_here
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root

HOST_CPUS = frozenset(os.sched_getaffinity(0))
GPUS = (2, 5)
TORCHRUN = Path(sys.executable).parent / "torchrun"
_TRAIN = """import os, sys, time
open(sys.argv[0] + ".ready" + os.environ["LOCAL_RANK"], "w").close()
time.sleep(60)
"""


def _ns_pid(host_pid: int) -> int:
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {host_pid}")


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs (two GPU slices apart)")
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_a_daemon_in_its_own_pid_namespace_binds_torchrun_ranks(tmp_path: Path) -> None:
    tmp = tmp_path / "pidns"
    tmp.mkdir()
    token = f"pidns{os.getpid()}"
    bundled_rule_policy(tmp / "policies", token)
    snap = snapshot_with_8_gpus_here(tmp / "snap.json")
    run, sock = tmp / "run", tmp / "run" / "tunerd.sock"
    train = tmp / f"train_{token}.py"
    train.write_text(_TRAIN)
    # unscoped: inside the namespace it sees only the namespace's processes (and the
    # rule binds only this test's token); its own node lock, not the host's
    daemon = [sys.executable, "-m", "tunerd.daemon.main", "--policy-dir", str(tmp / "policies"),
              "--runtime-dir", str(run), "--state-dir", str(tmp / "state"),
              "--metrics-listen", "off", "--log-level", "debug", "--topology", str(snap),
              "--node-lock", str(tmp / "node.lock")]
    job = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(train)]
    script = (f"{shlex.join(daemon)} > {tmp / 'tunerd.log'} 2>&1 &\n"
              f"for i in $(seq 400); do [ -S {sock} ] && break; sleep 0.05; done\n"
              f"exec {shlex.join(job)}\n")
    env = {**os.environ, "TUNERD_TEST_TOKEN": token, "CUDA_VISIBLE_DEVICES": "2,5",
           "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL",
                          "--", "bash", "-c", script], env=env, cwd=tmp)

    def log() -> str:
        return (tmp / "tunerd.log").read_text(errors="replace")

    try:
        ranks = wait_for(lambda: local_ranks(p.pid, train, 2), 60, "torchrun's 2 ranks",
                         detail=log)

        def bound() -> list[dict[str, object]] | None:
            """The rule-bound jobs, once both ranks are, each in the CPUs its record says."""
            r = run_ctl("--socket", str(sock), "--json", "jobs")
            jobs = [j for j in r.json()["jobs"] if j.get("origin") == "rule"] if r.rc == 0 else []
            return jobs if len(jobs) == 2 else None

        jobs = wait_for(bound, 15, "both ranks bound by the rule", detail=log)
        for j in jobs:  # the daemon's pids are its namespace's: NSpid's last field
            host = next(h for h in ranks.values() if _ns_pid(h) == j["pid"])
            assert parse_cpulist(cpus_allowed(host) or "") == parse_cpulist(str(j["cpus"])), j
            gpus = j["gpus"]
            assert isinstance(gpus, list) and len(gpus) == 1 and gpus[0] in GPUS, j
        st = run_ctl("--socket", str(sock), "--json", "status").json()
        summary = st["services"]["autobind"]["summary"]
        assert "watcher proc-scan" in summary and "initial PID namespace" in summary, summary
        human = run_ctl("--socket", str(sock), "status").out
        assert "not in the initial PID namespace" in human, human
    finally:
        p.kill()  # our own child, by pid: --kill-child ends the namespace with it
        p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_connectors_view_is_checked_against_ours() -> None:
    """The second check, independent of the namespace inode: the exec of a child the
    daemon starts must arrive with the pid it sees. Here in the initial namespace it
    does; inside a PID namespace (the inode check skipped, as a kernel that reports
    namespaces otherwise would) it does not, and the watcher would fall back."""
    from tunerd.watch.proc_connector import ProcConnector

    c = ProcConnector()
    c.open()
    try:
        assert c.view_mismatch() is None
    finally:
        c.close()
    code = ("import tunerd.watch.proc_connector as pc\n"
            "pc.listen_refusal = lambda: None  # only the probe decides\n"
            "c = pc.ProcConnector(); c.open(); print(c.view_mismatch(0.5)); c.close()\n")
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--", sys.executable,
                        "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert p.returncode == 0, p.stderr
    assert "no exec event for pid" in p.stdout and "do not match this PID namespace" in (
        p.stdout), p.stdout
