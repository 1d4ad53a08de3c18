"""Helpers for the binding tests: real multi-threaded child processes and /proc readers."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.helpers import wait_for

CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")

# A child that starts N threads (all parked) and prints "ready"; with "churn" it then
# keeps creating short-lived threads, so the set of threads changes while it is bound.
THREAD_CHILD = r"""
import sys, threading, time
n, mode = int(sys.argv[1]), sys.argv[2]
park = threading.Event()
for _ in range(n):
    threading.Thread(target=park.wait, daemon=True).start()
print("ready", flush=True)
if mode == "churn":
    while True:
        threading.Thread(target=time.sleep, args=(0.03,), daemon=True).start()
        time.sleep(0.001)
park.wait()
"""


@contextlib.contextmanager
def thread_child(threads: int = 32, churn: bool = False, nofile_soft: int = 1024,
                 cgroup: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """A real child process with ``threads`` extra threads; killed on exit.

    Its RLIMIT_NOFILE soft limit starts at ``nofile_soft`` so that a bind can raise
    it without CAP_SYS_RESOURCE (the hard limit is inherited). With ``cgroup`` it
    starts inside that cpuset cgroup, as a Slurm step would.
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def setup() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile_soft, hard))
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    p = subprocess.Popen([sys.executable, "-c", THREAD_CHILD, str(threads),
                          "churn" if churn else "park"],
                         stdout=subprocess.PIPE, text=True, preexec_fn=setup)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()


def task_cpus(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every live thread of ``pid``."""
    out: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(tid)] = line.split(":", 1)[1].strip()
    return out


def prlimit_nofile(pid: int) -> tuple[int, int]:
    """(soft, hard) as util-linux prlimit(1) reports it.

    prlimit(1) on another user's process needs CAP_SYS_RESOURCE, which root lacks
    in this sandbox; /proc/PID/limits is read then.
    """
    out = subprocess.run(["prlimit", "--pid", str(pid), "--nofile", "--raw", "--noheadings",
                          "--output", "SOFT,HARD"], capture_output=True, text=True)
    if out.returncode == 0:
        soft, hard = out.stdout.split()
        return int(soft), int(hard)
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no nofile limit for pid {pid}: {out.stderr}")


def cpuset_path(pid: int) -> str:
    return Path(f"/proc/{pid}/cpuset").read_text().strip()


def start_time(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2:].split()[19])


def snapshot(pid: int) -> dict[str, Any]:
    """Everything bind may change, for "the target is unchanged" checks."""
    return {"cpus": task_cpus(pid), "nofile": prlimit_nofile(pid), "cpuset": cpuset_path(pid)}


@contextlib.contextmanager
def scratch_cpuset(cpus: str, mems: str = "0") -> Iterator[Path]:
    """A cpuset cgroup of our own (a stand-in for a Slurm step), removed afterwards."""
    d = CPUSET_ROOT / f"tunerd-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        (d / "cpuset.cpus").write_text(cpus)
        (d / "cpuset.mems").write_text(mems)
        yield d
    finally:
        for sub in sorted(d.glob("tunerd-*"), reverse=True):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    sub.rmdir()
        wait_for(lambda: _rmdir(d), 5.0, f"rmdir {d}")


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def user_thread_child(uid: int, gid: int, threads: int = 8) -> int:
    """Fork a child that drops to uid/gid and starts ``threads`` threads; returns its pid.

    The interpreter cannot be exec'd as another user here (it lives under /root),
    so the child keeps the forked interpreter. Kill it with ``reap``.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            park = threading.Event()
            for _ in range(threads):
                threading.Thread(target=park.wait, daemon=True).start()
            os.write(w, b"r")
            os.close(w)
            while True:
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"r"
    os.close(r)
    return pid


def reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
