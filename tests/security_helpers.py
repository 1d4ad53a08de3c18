"""Helpers for the hardening tests: an attacker process as a real user, daemons as a user.

Nothing here is a fake: a forked child really drops to the test user's uid/gid
(so SO_PEERCRED, file ownership and permission checks are the kernel's), and a
daemon "run by a user" is the real tunerd process started with that uid.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from tests.helpers import REPO, DaemonProc


@contextlib.contextmanager
def forked_as(uid: int, gid: int, fn: Callable[..., Any], *args: Any,
              timeout: float = 60.0) -> Iterator[Connection]:
    """Run ``fn(conn, *args)`` in a child that dropped to uid/gid; yield our end of conn.

    The child talks to the test through ``conn`` (send/recv of picklable values)
    and typically waits for a message before it lets go of what it holds. An
    exception in the child is sent as ("error", traceback text).
    """
    ours, theirs = Pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            ours.close()
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            fn(theirs, *args)
        except BaseException:
            code = 1
            with contextlib.suppress(Exception):
                theirs.send(("error", traceback.format_exc()))
        finally:
            os._exit(code)
    theirs.close()
    try:
        yield ours
    finally:
        with contextlib.suppress(OSError):
            ours.send("stop")
        ours.close()
        deadline = time.monotonic() + timeout
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)  # our own child, by pid
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


def recv(conn: Connection, timeout: float = 60.0) -> Any:
    """The child's next message; its traceback as an AssertionError if it failed."""
    if not conn.poll(timeout):
        raise AssertionError(f"no message from the child within {timeout} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise AssertionError(f"the child failed:\n{msg[1]}")
    return msg


def start_daemon(d: DaemonProc, *, user: tuple[int, int] | None = None,
                 nofile: tuple[int, int] | None = None, wait: bool = True,
                 timeout: float = 20.0) -> DaemonProc:
    """DaemonProc.start, optionally as ``user`` (uid, gid) and with RLIMIT_NOFILE ``nofile``."""
    d.log_path = d.tmp / "tunerd.log"
    logf = open(d.log_path, "ab")  # noqa: SIM115 - owned by the process

    def limits() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    kw: dict[str, Any] = {}
    if user is not None:
        kw = {"user": user[0], "group": user[1], "extra_groups": []}
    d.proc = subprocess.Popen(d.argv(), stdout=logf, stderr=subprocess.STDOUT,
                              env={**os.environ, **d.env}, cwd=REPO, preexec_fn=limits, **kw)
    logf.close()
    if wait:
        d.wait_ready(timeout)
    return d


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for root, dirs, files in os.walk(path):
        for n in [*dirs, *files]:
            os.lchown(os.path.join(root, n), uid, gid)
    os.lchown(path, uid, gid)


def wait_exit(d: DaemonProc, timeout: float = 20.0) -> int:
    assert d.proc is not None
    return d.proc.wait(timeout)


def error_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if " ERROR " in ln or " CRITICAL " in ln]


def ctl_as(user: tuple[int, int], sock: str | Path, *args: str,
           timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """The real tunerctl, run by ``user`` (uid, gid): exit code and output as they see it."""
    import sys

    return subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(sock),
                           *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          user=user[0], group=user[1], extra_groups=[])


def spawn_as(user: tuple[int, int], argv: list[str],
             env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A process that ``user`` owns (real and effective uid), started by this test."""
    return subprocess.Popen(argv, env={**os.environ, **(env or {})}, user=user[0],
                            group=user[1], extra_groups=[], cwd="/",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def strict_json(line: bytes) -> Any:
    """json.loads that accepts only what the JSON standard does (no NaN/Infinity)."""
    def bad(name: str) -> Any:
        raise AssertionError(f"reply holds {name}: not JSON")

    return json.loads(line, parse_constant=bad)


def exchange(path: str, payload: bytes, timeout: float = 20) -> list[Any]:
    """Send raw bytes, then read reply lines until the daemon has answered each request."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    s.sendall(payload)
    want = payload.count(b"\n")
    buf = b""
    while buf.count(b"\n") < want:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    s.close()
    return [strict_json(ln) for ln in buf.splitlines()]
