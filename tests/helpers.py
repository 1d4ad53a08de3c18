"""Test helpers: run the real daemon process and the real CLI."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@dataclass
class CliResult:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class _NotifySocket:
    """An sd_notify datagram socket, as systemd gives a Type=notify service: the
    daemon sends READY=1 on it once it is up (tunerd/daemon/notify.py)."""

    def __init__(self) -> None:
        import socket
        import tempfile

        # a short path of its own (sun_path is 108 bytes), reachable from a netns
        self.dir = Path(tempfile.mkdtemp(prefix="tunerd-notify-"))
        self.dir.chmod(0o755)
        self.path = self.dir / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(str(self.path))
        self.path.chmod(0o666)
        self._ready = False

    def ready(self, timeout: float) -> bool:
        """True once READY=1 came (waits up to ``timeout`` for a message)."""
        import select

        if not self._ready and select.select([self.sock], [], [], timeout)[0]:
            self._ready = b"READY=1" in self.sock.recv(4096).split(b"\n")
        return self._ready

    def close(self) -> None:
        import shutil

        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class DaemonProc:
    """A real tunerd process in temporary directories."""

    tmp: Path
    policy_dir: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # rules bind only what this test run started (--scope-pid: and no node lock); False
    # only for a test of the node lock itself, with its own --node-lock and no rules
    scoped: bool = True
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _notify: _NotifySocket | None = field(default=None, repr=False)

    @property
    def runtime_dir(self) -> Path:
        return self.tmp / "run"

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "tunerd.sock"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "tunerd.daemon.main",
                "--policy-dir", str(self.policy_dir),
                "--runtime-dir", str(self.runtime_dir),
                "--state-dir", str(self.state_dir),
                "--metrics-listen", "off", "--log-level", "debug",
                *(["--scope-pid", str(os.getpid())] if self.scoped else []),
                *self.extra_args]

    def start(self, wait: bool = True, timeout: float = 20.0) -> DaemonProc:
        self.log_path = self.tmp / "tunerd.log"
        logf = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        env = {**os.environ, **self.env}
        if "NOTIFY_SOCKET" not in self.env:  # a test's own sd_notify socket wins
            self._close_notify()
            self._notify = _NotifySocket()
            env["NOTIFY_SOCKET"] = str(self._notify.path)
        self.proc = subprocess.Popen(self.argv(), stdout=logf, stderr=subprocess.STDOUT,
                                     env=env, cwd=REPO)
        logf.close()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until the daemon is ready: its READY=1 (sd_notify, sent once every service
        started) and a status answer when start() gave it a notify socket, else (a
        daemon a test started itself) `tunerctl --json status` answering."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        notify, self._notify = self._notify, None
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tunerd exited with {self.proc.returncode}:\n"
                                       f"{self.log()}")
                if notify is not None:
                    if notify.ready(0.05) and self._status_answers():
                        return
                    continue
                if self.socket.exists():
                    r = self.ctl("--json", "status")
                    if r.rc == 0 or r.rc == 1:
                        return
                time.sleep(0.05)
        finally:
            if notify is not None:
                notify.close()
        raise RuntimeError(f"tunerd did not become ready in {timeout} s:\n{self.log()}")

    def _status_answers(self) -> bool:
        from tunerd.wire.client import Client

        try:
            with Client(str(self.socket), timeout=10) as c:
                c.call("status")
        except Exception:
            return False
        return True

    def _close_notify(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def ctl(self, *args: str, timeout: float = 60.0) -> CliResult:
        return run_ctl("--socket", str(self.socket), *args, timeout=timeout)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        self._close_notify()
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


T = TypeVar("T")


def ask_child(p: subprocess.Popen[str], what: str) -> None:
    """One command to a line-driven test child (``what`` on its stdin); it answers "done"."""
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(what + "\n")
    p.stdin.flush()
    assert p.stdout.readline() == "done\n"


def wait_for(pred: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05,
             detail: Callable[[], str] | None = None) -> T:
    """Poll ``pred`` until it returns something truthy, and return that value.

    On timeout raise AssertionError naming ``what``, the timeout and ``pred``'s last
    value (plus ``detail()``, e.g. the daemon's log), so that a caller can never
    forget to assert. ``pred`` is tried once more at the deadline, so a slow
    machine that got there just in time passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    extra = f"\n{detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; "
                         f"last value: {last!r}{extra}")


def run_ctl(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> CliResult:
    p = subprocess.run([sys.executable, "-m", "tunerd.cli.main", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=REPO,
                       env={**os.environ, **(env or {})})
    return CliResult(p.returncode, p.stdout, p.stderr)


def write_policy(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / name
    p.write_text(text)
    return p


def run_as(uid: int, gid: int, fn: Any, *args: Any, timeout: float = 60.0) -> Any:
    """Run ``fn(*args)`` in a forked child that dropped to uid/gid; return its result.

    The interpreter lives under /root in this sandbox, which other users cannot
    enter, so the child keeps the already-loaded interpreter instead of exec'ing.
    Exceptions raised in the child are re-raised here.
    """
    import pickle

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            payload = pickle.dumps(("ok", fn(*args)))
        except BaseException as e:
            try:
                payload = pickle.dumps(("err", e))
            except Exception:
                payload = pickle.dumps(("err", RuntimeError(repr(e))))
        with os.fdopen(w, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "err":
        raise value
    return value


@contextlib.contextmanager
def ready_child(code: str, args: list[str] | None = None,
                env: dict[str, str] | None = None,
                stderr: int | None = None) -> Iterator[subprocess.Popen[str]]:
    """A Python child running ``code`` with ``args`` and ``env``, which prints "ready"
    once set up; killed after. ``stderr`` as for Popen (e.g. DEVNULL for a chatty one)."""
    p = subprocess.Popen([sys.executable, "-c", code, *(args or [])], env=env,
                         stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        yield p
    finally:
        p.kill()
        p.wait()
