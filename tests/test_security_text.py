"""User text: bounded, and shown safely (issue 16, found 5, 6, 7, 10).

The test user chooses lease tags, `run` commands, process names (PR_SET_NAME),
command lines and environment values; root looks at them with `tunerctl leases`,
`jobs`, `top --once`, `status` and in the log. No ESC byte (or CR, LF, C1) a user
chose reaches root's terminal or the log raw, rich never takes a name for markup,
oversized text is refused naming the limit, and hostile numbers are ignored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.binding_helpers import CPUSET_ROOT, scratch_cpuset, thread_child
from tests.helpers import DaemonProc, run_as, wait_for, write_policy
from tests.leases_helpers import (
    DGX_H100,
    autobind_status,
    kill,
    open_path_for_others,
    unique_sleeper,
)
from tests.security_helpers import ctl_as, spawn_as
from tunerd.base.errors import TunerdError
from tunerd.wire.client import Client
from tunerd.wire.protocol import MAX_CMD, MAX_ERROR_MESSAGE, MAX_TAG

pytestmark = pytest.mark.root

EVIL = "\x1b]2;owned\x07\x1b[2J\r\nFORGED 2026 ERROR x\x9b31m"  # OSC 2, CSI, CR LF, C1 CSI
assert len(EVIL.encode()) < MAX_TAG


def _try(sock: str, cmd: str, args: dict) -> str:
    try:
        with Client(sock, timeout=30) as c:
            c.call(cmd, **args)
    except TunerdError as err:
        return f"{type(err).__name__}: {err.message}"
    return "ok"


def _no_raw_controls(text: str, where: str) -> None:
    for ch in ("\x1b", "\x07", "\r", "\x9b"):
        assert ch not in text, f"{ch!r} reached {where}: {text[-800:]!r}"
    assert "\nFORGED" not in text, f"a forged line in {where}"


def test_oversized_tag_and_command_are_refused(daemon: DaemonProc,
                                               unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    sock = str(daemon.socket)
    why = run_as(uid, gid, _try, sock, "alloc", {"ncpus": 1, "tag": "t" * (MAX_TAG + 1)})
    assert why.startswith("UsageError") and f"limit of {MAX_TAG}" in why, why
    why = run_as(uid, gid, _try, sock, "run", {"ncpus": 1, "command": ["x" * (MAX_CMD + 1)]})
    assert why.startswith("UsageError") and "limit of" in why, why
    # the CLI says so with exit code 2
    r = ctl_as(unpriv_user, sock, "alloc", "--ncpus", "1", "--tag", "t" * (MAX_TAG + 1))
    assert r.returncode == 2 and f"limit of {MAX_TAG}" in r.stderr, r.stderr
    assert daemon.ctl("--json", "leases").json() == []


def test_state_of_a_full_node_stays_small(daemon_factory, tmp_path: Path) -> None:
    """Every lease at its largest (tag and command record at their limits): 224 leases
    (one per CPU of a DGX H100) keep RUNTIME_DIR/state.json well under 1 MiB."""
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    with Client(str(d.socket), timeout=60) as c:
        for i in range(224):
            c.call("alloc", ncpus=1, tag=f"{i:03d}" + "t" * (MAX_TAG - 3))
    size = (d.runtime_dir / "state.json").stat().st_size
    print(f"\nstate.json with 224 leases at the tag limit: {size} bytes")
    assert size < (1 << 20) // 2, size


def test_escape_sequences_never_reach_roots_terminal_or_the_log(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    exe = unique_sleeper(tmp_path, f"evil_job_{os.getpid()}")
    open_path_for_others(tmp_path)
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", f'[policy]\nname = "t"\n[[job]]\nname = "evil"\n'
                                 f'match.cmdline = ["*{exe.name}*"]\n')
    d = daemon_factory(policy_dir=pol).start()
    sock = str(d.socket)
    uid, gid = unpriv_user
    assert run_as(uid, gid, _try, sock, "alloc", {"ncpus": 1, "tag": EVIL}) == "ok"
    # a process named with markup and ESC (PR_SET_NAME), bound by its owner; and a
    # command line with ESC and CR LF that a rule binds (the log names it)
    named = spawn_as(unpriv_user, [sys.executable, "-c",
                                   "import ctypes, time; ctypes.CDLL(None).prctl(15, "
                                   "b'[/x]\\x1b[31m[bold', 0, 0, 0); time.sleep(300)"])
    ruled = spawn_as(unpriv_user, [sys.executable, "-c",
                                   "import os, sys; os.execv(sys.argv[1], [sys.argv[2], '300'])",
                                   str(exe), f"{exe.name}{EVIL}"])
    try:
        wait_for(lambda: "[/x]" in Path(f"/proc/{named.pid}/comm").read_text(), 10,
                 "the process name")
        r = ctl_as(unpriv_user, sock, "bind", str(named.pid), "--cpus", "0")
        assert r.returncode == 0, r.stderr
        wait_for(lambda: autobind_status(d)["bound"], 15, "the rule to bind", detail=d.log)
        for args in (("leases",), ("jobs",), ("status",), ("top", "--once")):
            out = d.ctl(*args)
            assert out.rc in (0, 1), (args, out.err)
            _no_raw_controls(out.out + out.err, "tunerctl " + " ".join(args))
            assert "Traceback" not in out.err and "MarkupError" not in out.err, out.err
        # shown as the user named it, not parsed (the monitor lists a new job within a
        # sample cycle or two)
        wait_for(lambda: "[/x]" in d.ctl("top", "--once").out, 10, "the job in top --once")
        assert "\\x1b]2;owned" in d.ctl("leases").out  # visibly escaped
        # --json keeps the text exact, JSON-escaped
        assert any(x["tag"] == EVIL for x in d.ctl("--json", "leases").json())
        _no_raw_controls(d.log(), "the log")
    finally:
        kill(named)
        kill(ruled)


def test_hostile_numbers_are_ignored_without_a_traceback(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    exe = unique_sleeper(tmp_path, f"train_digits_{os.getpid()}")
    open_path_for_others(tmp_path)
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", f'[policy]\nname = "t"\n[[job]]\nname = "torch"\n'
                                 f'match.cmdline = ["*{exe.name}*"]\n'
                                 'match.env = { LOCAL_RANK = "*" }\n')
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    digits = "9" * 5000
    p = spawn_as(unpriv_user, [str(exe), "300"],
                 {"LOCAL_RANK": digits, "LOCAL_WORLD_SIZE": digits,
                  "CUDA_VISIBLE_DEVICES": digits, "SLURM_JOB_ID": "1",
                  "SLURM_CPUS_PER_TASK": digits})
    try:
        wait_for(lambda: autobind_status(d)["matched"] >= 1, 15, "the rule to see it",
                 detail=d.log)
        r = ctl_as(unpriv_user, d.socket, "--json", "bind", str(p.pid))
        assert "internal error" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert r.returncode in (0, 1, 2), r
        assert "LOCAL_RANK='9999999999999999...' ignored (5000 characters)" in r.stdout, r.stdout
        # on the wire: a 5,000-digit pid is a usage error naming the limit
        why = run_as(*unpriv_user, _raw_line, str(d.socket),
                     b'{"id":1,"cmd":"bind","args":{"pid":' + digits.encode() + b"}}\n")
        assert why["error"]["code"] == "usage" and "digits" in why["error"]["message"], why
        assert "Traceback" not in d.log() and "ValueError" not in d.log(), d.log()[-3000:]
    finally:
        kill(p)


def _reply_error(sock: str, cmd: str, args: dict) -> str:
    try:
        with Client(sock, timeout=30) as c:
            c.call(cmd, **args)
    except TunerdError as err:
        return err.message
    return ""


def test_error_replies_are_bounded_and_tracebacks_escaped(
        daemon: DaemonProc, unpriv_user: tuple[int, int], tmp_path: Path) -> None:
    """An error that quotes what a user sent (a 200 KB cpulist with ESC and CR LF in
    it) comes back cut to MAX_ERROR_MESSAGE and escaped; and a traceback the daemon logs
    (log.exception) for an exception whose text quotes a command line is written with
    that text escaped on its one line, through the daemon's own logging set-up."""
    mine = spawn_as(unpriv_user, ["sleep", "302"])
    try:
        msg = run_as(*unpriv_user, _reply_error, str(daemon.socket), "bind",
                     {"pid": mine.pid, "cpus": "0-" + EVIL + "x" * 200_000})
        assert "malformed cpulist" in msg and len(msg) <= MAX_ERROR_MESSAGE, len(msg)
        assert "more characters)" in msg, msg[-200:]
        _no_raw_controls(msg, "the error reply")
        _no_raw_controls(daemon.log(), "the log")
    finally:
        kill(mine)
    log = tmp_path / "tunerd.log"
    code = ("import logging, sys; from pathlib import Path\n"
            "from tunerd.daemon.main import setup_logging\n"
            "setup_logging('info', Path(sys.argv[1]))\n"
            "try:\n"
            "    try:\n"
            "        raise KeyError('inner')\n"
            "    except KeyError as e:\n"
            "        raise ValueError('pid 7 (' + sys.argv[2] + '): bad') from e\n"
            "except ValueError:\n"
            "    logging.getLogger('tunerd.autobind').exception('binding failed')\n")
    subprocess.run([sys.executable, "-c", code, str(log), EVIL], check=True,
                   cwd=str(Path(__file__).parent.parent))
    text = log.read_text()
    _no_raw_controls(text, "a logged traceback")
    assert "ValueError: pid 7 (\\x1b]2;owned" in text, text  # visibly escaped, one line
    assert "direct cause" in text and "KeyError: 'inner'" in text, text


def _raw_line(sock: str, line: bytes) -> dict:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock)
    s.sendall(line)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    return json.loads(buf)




def _hidepid_daemon(daemon_factory, **kw: object) -> DaemonProc:
    """A daemon in a mount namespace of its own with /proc mounted hidepid=2 (the
    host's /proc is untouched)."""
    d = daemon_factory(**kw)
    d.log_path = d.tmp / "tunerd.log"
    with open(d.log_path, "ab") as logf:
        d.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t proc -o hidepid=2 proc /proc && exec "$@"', "sh", *d.argv()],
            stdout=logf, stderr=subprocess.STDOUT, cwd=str(Path(__file__).parent.parent))
    d.wait_ready()
    return d


def test_command_lines_past_hidepid_stay_hidden(daemon_factory,
                                                unpriv_user: tuple[int, int]) -> None:
    """Issue 16, found 14: `tunerctl --json jobs` gave any user every bound process's
    command line, also where /proc is mounted hidepid=2."""
    d = _hidepid_daemon(daemon_factory)
    secret = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                               "--password=SECRET"])  # root's
    try:
        assert d.ctl("bind", str(secret.pid), "--cpus", "0").rc == 0
        mine = spawn_as(unpriv_user, ["sleep", "301"])
        try:
            assert ctl_as(unpriv_user, d.socket, "bind", str(mine.pid), "--cpus",
                          "0").returncode == 0
            for args in (("--json", "jobs"), ("jobs",), ("--json", "top")):
                r = ctl_as(unpriv_user, d.socket, *args)
                assert r.returncode == 0, r.stderr
                assert "SECRET" not in r.stdout, (args, r.stdout)
            jobs = json.loads(ctl_as(unpriv_user, d.socket, "--json", "jobs").stdout)["jobs"]
            own = [j for j in jobs if j["pid"] == mine.pid]
            assert own and "301" in (own[0]["cmdline"] or "")  # their own: as /proc shows
            # root sees everything
            assert "SECRET" in d.ctl("--json", "jobs").out
        finally:
            kill(mine)
    finally:
        kill(secret)


def test_advise_and_status_past_hidepid_keep_others_text_hidden(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    """`advise` and `status` named another user's processes as jobs/top would not
    past hidepid=2: a `tunerctl bind`'s process name, and the why of a rank a rule
    left alone (its environment's run id), in advise's finding and status's
    services.autobind.left_alone; top's sample named a bound process by its comm, and
    jobs's left_alone gave the why."""
    job = unique_sleeper(tmp_path, f"hidden_job_{os.getpid()}")
    named = unique_sleeper(tmp_path, f"SECRETcomm{os.getpid()}"[:15])
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", f'[policy]\nname = "t"\n[[job]]\nname = "ranks"\n'
                                 f'match.cmdline = ["*{job.name}*"]\n')
    d = _hidepid_daemon(daemon_factory, policy_dir=pol)
    rank = {**os.environ, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "SECRETrun",
            "LOCAL_WORLD_SIZE": "SECRETws"}
    procs = [subprocess.Popen([sys.executable, "-c", "import os, sys; os.execv(sys.argv[1], "
                               "[sys.argv[2], '300'])", str(job), f"{job}--password=SECRET"],
                              env=rank),  # root's, as every process here
             # as taskset would start it: its own CPUs from the first exec on
             subprocess.Popen([str(job), "300"], env=rank,
                              preexec_fn=lambda: os.sched_setaffinity(0, {0})),
             subprocess.Popen([str(named), "300"])]
    try:
        assert d.ctl("bind", str(procs[2].pid), "--cpus", "0").rc == 0
        wait_for(lambda: len(d.ctl("--json", "advise").json()["jobs"]) >= 3, 15,
                 "advise to list the bound rank, the bound process and the rank left "
                 "alone", detail=d.log)
        # root sees them all: what the user must not
        # the left-alone's why (a run id is no longer part of it: jobs are keyed by their
        # launcher, issue 26; its mask and its parent's are)
        st = d.ctl("--json", "status").out
        assert "left as it is" in st and str(procs[1].pid) in st, st
        assert "SECRETcomm" in d.ctl("--json", "advise").out
        assert "left as it is" in d.ctl("--json", "advise").out  # the self-affined's why
        for args in (("--json", "advise"), ("advise",), ("--json", "status"), ("status",),
                     ("--json", "top"), ("--json", "jobs")):
            r = ctl_as(unpriv_user, d.socket, *args)
            assert r.returncode in (0, 1), (args, r.stderr)
            assert "SECRET" not in r.stdout + r.stderr, (args, r.stdout)
    finally:
        for p in procs:
            kill(p)


def test_without_hidepid_command_lines_are_shown_as_proc_shows_them(
        daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                              "--visible"])
    try:
        assert daemon.ctl("bind", str(other.pid), "--cpus", "0").rc == 0
        r = ctl_as(unpriv_user, daemon.socket, "--json", "jobs")
        assert "--visible" in r.stdout  # /proc/PID/cmdline is world-readable here
    finally:
        kill(other)


def test_advise_keeps_what_a_process_environment_says_to_its_owner(
        daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    """/proc/PID/environ and maps are their owner's to read, hidepid or not: advise's
    findings built from them (OMP_NUM_THREADS here) reach root, not another user."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             env={**os.environ, "OMP_NUM_THREADS": "777"})
    try:
        assert daemon.ctl("bind", str(other.pid), "--cpus", "0").rc == 0

        last: list[str] = []

        def roots_finding() -> bool:
            r = daemon.ctl("--json", "advise", str(other.pid))
            last[:] = [r.out + r.err]
            return r.rc == 1 and "omp-threads-oversubscribe" in r.out  # 1: findings
        wait_for(roots_finding, 15, "root's advise names OMP_NUM_THREADS=777",
                 detail=lambda: last)
        r = ctl_as(unpriv_user, daemon.socket, "--json", "advise", str(other.pid))
        assert r.returncode in (0, 1) and json.loads(r.stdout)["jobs"], r.stderr
        assert "777" not in r.stdout and "omp-threads" not in r.stdout, r.stdout
    finally:
        kill(other)
        daemon.ctl("unbind", str(other.pid))


@pytest.mark.skipif(not (CPUSET_ROOT / "cpuset.cpus").exists() or os.cpu_count() == 1,
                    reason="needs cgroup v1 cpusets and two CPUs")
def test_past_hidepid_a_rule_error_about_another_users_process_keeps_its_message(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    """status's errors: "rule R, pid N: MESSAGE" about root's process (its cgroup's
    path in MESSAGE here) reaches another user past hidepid=2 as "rule R, pid N:" and
    the hidden marker; root reads it whole."""
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", '[policy]\nname = "t"\n[[job]]\nname = "outside"\n'
                                 'match.cmdline = ["*threading*park"]\ncpus = "1"\n')
    d = _hidepid_daemon(daemon_factory, policy_dir=pol)
    with scratch_cpuset("0") as cg, thread_child(threads=1, cgroup=cg) as p:
        head = f"rule outside, pid {p.pid}: "

        def roots_error() -> str:
            errs = d.ctl("--json", "status").json().get("errors") or []
            return next((e["message"] for e in errs if e["message"].startswith(head)), "")
        whole = wait_for(roots_error, 15, "the rule's error in root's status", detail=d.log)
        assert cg.name in whole, whole
        r = ctl_as(unpriv_user, d.socket, "--json", "status")
        assert r.returncode in (0, 1), r.stderr
        assert cg.name not in r.stdout, r.stdout
        assert head + "(hidden: /proc is mounted hidepid)" in r.stdout, r.stdout
