"""Connection floods (issue 9, found 3): per-user limit, listen backlog, fd limits,
accept() errors that pause instead of spinning, and a log that does not explode."""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
import socket
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from tests.helpers import REPO, DaemonProc, wait_for
from tests.security_helpers import forked_as, recv, start_daemon
from tunerd.base.logutil import RepeatFilter
from tunerd.wire.client import Client

pytestmark = pytest.mark.root


def _hold_connections(conn: Connection, path: str, n: int, limit: int) -> None:
    """As the test user: open ``n`` connections, report how many the daemon refused,
    keep the rest open until told to stop."""
    import select

    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 100, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))
    held: list[socket.socket] = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(20)
        s.connect(path)
        held.append(s)
    # the daemon answers an over-limit connection with one line and closes it: wait
    # until the n - limit it must refuse have their line (at most 10 s), then 0.5 s more
    # for any it should not have refused
    poller = select.poll()
    for s in held:
        poller.register(s, select.POLLIN)
    deadline = time.monotonic() + 10
    while len(poller.poll(0)) < n - limit and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    refused, kept, messages = 0, 0, set()
    for s in held:
        s.setblocking(False)
        try:
            data = s.recv(4096)
        except BlockingIOError:
            kept += 1
            continue
        if data:
            refused += 1
            messages.add(data.decode())
    conn.send((refused, kept, sorted(messages)))
    conn.recv()  # "stop"
    for s in held:
        s.close()


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_user_holding_1100_connections_is_limited_and_root_is_served(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("max_connections_per_user = 100\n")
    d: DaemonProc = daemon_factory(args=["--config", str(cfg)]).start()
    log_before = len(d.log())
    with forked_as(uid, gid, _hold_connections, str(d.socket), 1100, 100) as conn:
        refused, kept, messages = recv(conn, timeout=120)
        assert (kept, refused) == (100, 1000)
        assert len(messages) == 1 and "too many connections" in messages[0]
        assert f"uid {uid} already has 100 open connections" in messages[0]
        assert "max_connections_per_user = 100" in messages[0]
        t0 = time.monotonic()
        r = d.ctl("--json", "status")
        took = time.monotonic() - t0
        assert r.rc == 0 and took < 5, (r, took)  # a tunerctl start-up included
        with Client(str(d.socket), timeout=10) as c:  # root is not limited
            assert c.call("ping")["pong"]
    # once the user lets go, their connections count down again
    assert _user_ping(uid, gid, str(d.socket))
    new_log = d.log()[log_before:]
    assert len(re.findall("refusing more", new_log)) <= 5, new_log[-2000:]
    assert "Traceback" not in new_log


def _user_ping(uid: int, gid: int, path: str) -> bool:
    from tests.helpers import run_as

    def ping(p: str) -> bool:
        deadline = time.monotonic() + 10
        while True:
            try:
                with Client(p, timeout=10) as c:
                    return bool(c.call("ping")["pong"])
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    return bool(run_as(uid, gid, ping, path))


def test_a_burst_of_1000_connects_fits_the_backlog(daemon: DaemonProc) -> None:
    socks = []
    eagain = 0
    try:
        for _ in range(1000):  # as fast as one thread can: no waiting for accept()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            try:
                s.connect(str(daemon.socket))
            except BlockingIOError:
                eagain += 1
            socks.append(s)
    finally:
        for s in socks:
            s.close()
    assert eagain == 0


def test_400_simultaneous_clients_connect(daemon: DaemonProc) -> None:
    start = threading.Barrier(400)
    errors: list[str] = []
    ok: list[int] = []

    def one() -> None:
        c = Client(str(daemon.socket), timeout=60)
        start.wait()
        try:
            c.connect()
            ok.append(c.call("ping")["pid"])
        except Exception as err:
            errors.append(repr(err))
        finally:
            c.close()

    threads = [threading.Thread(target=one) for _ in range(400)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(ok) == 400


def test_daemon_raises_its_fd_soft_limit(daemon_factory) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= 256:
        pytest.skip("hard RLIMIT_NOFILE too low to tell")
    d: DaemonProc = start_daemon(daemon_factory(), nofile=(256, hard))
    limits = Path(f"/proc/{d.proc.pid}/limits").read_text()  # type: ignore[union-attr]
    soft_now = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits)
    assert soft_now and int(soft_now.group(1)) == hard == int(soft_now.group(2))


def test_out_of_fds_pauses_accepting_without_spinning_or_flooding_the_log(
        daemon_factory) -> None:
    """The daemon's hard limit is tiny, so accept() fails with EMFILE under a flood."""
    d: DaemonProc = start_daemon(daemon_factory(), nofile=(96, 96))
    assert d.proc is not None
    socks = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(str(d.socket))
            except OSError as err:  # the backlog may fill while the daemon has no fds
                assert err.errno in (errno.EAGAIN, errno.ECONNREFUSED), err
                s.close()
                break
            socks.append(s)
        time.sleep(1.0)
        cpu0 = cpu_seconds(d.proc.pid)
        time.sleep(3.0)
        used = cpu_seconds(d.proc.pid) - cpu0
        assert used < 0.6, f"the daemon used {used:.2f} s of CPU in 3 s while out of fds"
        log = d.log()
        assert "accept() failed" in log and "Too many open files" in log
        assert log.count("accept() failed") <= 6, log[-3000:]
        assert "Traceback" not in log and "out of system resource" not in log
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 20  # fds are back: it serves again
    while True:
        try:
            with Client(str(d.socket), timeout=5) as c:
                assert c.call("ping")["pong"]
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_repeat_filter_lets_a_few_through_then_counts() -> None:
    now = [0.0]
    flt = RepeatFilter(burst=3, window=10.0, clock=lambda: now[0])
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("tunerd.test.repeat")
    logger.propagate = False
    h = Keep()
    h.addFilter(flt)
    logger.addHandler(h)
    try:
        for _ in range(1000):
            logger.error("accept() failed: %s", "Too many open files")
        logger.error("something else")
        now[0] = 11.0
        logger.error("accept() failed: %s", "Too many open files")
    finally:
        logger.removeHandler(h)
    assert seen[:3] == ["accept() failed: Too many open files"] * 3
    assert seen[3] == "something else"
    assert seen[4] == ("accept() failed: Too many open files [997 identical message(s) "
                       "suppressed in the previous 10 s]")
    assert len(seen) == 5 and flt.dropped_total == 997


def test_unit_raises_the_fd_limit() -> None:
    unit = (REPO / "systemd" / "tunerd.service").read_text()
    m = re.search(r"^LimitNOFILE=(\d+)$", unit, re.M)
    assert m and int(m.group(1)) >= 65536


def _vm_rss(pid: int) -> int:
    """Resident memory of ``pid`` in bytes, from /proc/PID/status."""
    m = re.search(r"^VmRSS:\s+(\d+) kB$", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert m, f"no VmRSS in /proc/{pid}/status"
    return int(m.group(1)) * 1024


def _send_without_reading(conn: Connection, path: str, total: int, seconds: float) -> None:
    """As the test user: send pings for ``seconds`` (at most ``total`` bytes) and never
    read a reply; report the bytes sent, then, once told, whether the daemon closed us."""
    import select

    line = b'{"cmd":"ping"}\n'
    chunk = line * ((1 << 20) // len(line))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.settimeout(1.0)  # a daemon that stopped reading blocks our sends: then we stop too
    sent = 0
    deadline = time.monotonic() + seconds
    while sent < total and time.monotonic() < deadline:
        try:
            sent += s.send(chunk[sent % len(chunk):])
        except TimeoutError:
            break
        except (BrokenPipeError, ConnectionResetError):
            break  # on a loaded machine the daemon may drop us (client_timeout) mid-send
    conn.send(sent)
    wait = conn.recv()  # seconds to wait for the daemon to close the connection
    p = select.poll()
    p.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    deadline = time.monotonic() + wait
    closed = False
    while not closed and time.monotonic() < deadline:  # poll, never read: we stay stalled
        closed = bool(p.poll(100))
    conn.send(closed)
    conn.recv()  # "stop"
    s.close()


def test_a_client_that_never_reads_replies_is_bounded_then_dropped(
        daemon_factory, tmp_path: Path, unpriv_user: tuple[int, int]) -> None:
    """Pipelined requests whose replies are never read: the daemon stops reading from
    that client (its memory stays bounded), serves others, and drops it after the idle
    timeout although requests are still queued."""
    uid, gid = unpriv_user
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("client_timeout = 2.0\n")
    d: DaemonProc = daemon_factory(args=["--config", str(cfg)]).start()
    assert d.proc is not None
    rss0 = _vm_rss(d.proc.pid)
    with forked_as(uid, gid, _send_without_reading, str(d.socket), 50 << 20, 8.0) as conn:
        sent = recv(conn, timeout=60)
        grown = _vm_rss(d.proc.pid) - rss0
        assert grown < 64 << 20, f"the daemon grew by {grown >> 20} MiB on {sent >> 20} MiB " \
                                 "of requests whose replies were never read"
        assert sent < 40 << 20, f"the daemon read {sent >> 20} MiB from a client that reads " \
                                "no replies"
        with Client(str(d.socket), timeout=10) as c:  # others are served meanwhile
            assert c.call("ping")["pong"]
        conn.send(15.0)
        assert recv(conn, timeout=60) is True, "the stalled connection was never closed"
    with Client(str(d.socket), timeout=10) as c:
        assert c.call("ping")["pong"]
    assert d.proc.poll() is None and "Traceback" not in d.log()


def _vmrss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def hostile_binds(sock: str, n: int, first: int) -> int:
    """``n`` bind/unbind requests for PIDs that do not exist (each one new), over one
    connection; returns how many were refused as they should be."""
    from tunerd.base.errors import TunerdError

    refused = 0
    with Client(sock, timeout=60) as c:
        for i in range(n):
            try:
                c.call("bind" if i % 2 else "unbind", pid=first + i, cpus="0")
            except TunerdError:
                refused += 1
    return refused


def test_requests_for_absent_pids_leave_nothing_behind(
        daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    """Issue 16, found 3: ~170 bytes were kept per request (a per-PID lock made before
    the PID was checked). bench/hostile_requests.py runs the full 400,000 (+36 KiB)."""
    from tests.helpers import run_as

    uid, gid = unpriv_user
    sock = str(daemon.socket)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    run_as(uid, gid, hostile_binds, sock, 1000, 10_000_000)  # warm caches, arenas
    before = _vmrss_kib(pid)
    n = 10_000  # ~1.7 MB kept before the fix, ~200 bytes a request
    # pids that cannot exist (above PID_MAX_LIMIT) and ones that may (none of them does)
    assert run_as(uid, gid, hostile_binds, sock, n // 2, 5_000_000, timeout=120) == n // 2
    assert run_as(uid, gid, hostile_binds, sock, n // 2, 4_000_000, timeout=120) == n // 2
    after = _vmrss_kib(pid)
    grew = (after - before) * 1024
    assert grew < n * 16, f"daemon RSS grew {grew} bytes for {n} requests"  # was ~170 each
    # the unit's MemoryMax leaves room: several times what the daemon uses here
    unit = (REPO / "systemd" / "tunerd.service").read_text()
    limit = int(re.search(r"^MemoryMax=(\d+)M$", unit, re.M).group(1))  # type: ignore[union-attr]
    assert limit * 1024 >= 5 * after, (limit, after)


def _lease_loop(sock: str, n: int) -> int:
    done = 0
    with Client(sock, timeout=60) as c:
        for i in range(n):
            lease = c.call("alloc", ncpus=1, tag=f"loop-{i}")
            c.call("release", lease=lease["id"])
            done += 1
    return done


def test_a_users_lease_loop_writes_few_log_lines(daemon: DaemonProc,
                                                 unpriv_user: tuple[int, int]) -> None:
    """Issue 16, found 9: a distinct line per lease (6,000 for 6,000 leases). Now
    at most 20 lines a minute per uid, plus one saying the rest is suppressed.
    600 leases (~3 s: within the limit's first minute) would write at least 600 lines
    without the limit; with it, 21 (and 21 for 2,000 or 6,000: the same first minute)."""
    from tests.helpers import run_as

    uid, gid = unpriv_user
    n = 600
    before = len(daemon.log().splitlines())
    assert run_as(uid, gid, _lease_loop, str(daemon.socket), n, timeout=300) == n
    new = daemon.log().splitlines()[before:]
    print(f"\n{n:,} user leases: {len(new)} log lines")
    # 20 lines, the one saying the rest is suppressed, and room for a few of the daemon's
    # own (n // 60 for the 2,000 leases this loop was: 33)
    assert len(new) <= 30, "\n".join(new[-30:])
    assert any("further lines its requests cause are suppressed" in ln for ln in new)
    # root is not limited: its lease is logged
    with Client(str(daemon.socket), timeout=30) as c:
        lid = c.call("alloc", ncpus=1)["id"]
    wait_for(lambda: f"lease {lid} for root" in daemon.log(), 5, "root's lease in the log")


def test_log_file_without_journald_is_private_and_bounded(daemon_factory,
                                                          tmp_path: Path) -> None:
    from tunerd.base.logutil import PrivateRotatingFileHandler

    log_file = tmp_path / "tunerd.log"
    log_file.write_text("an older install's log\n")
    log_file.chmod(0o644)
    d = daemon_factory(args=["--log-file", str(log_file)]).start()
    assert "ready" in log_file.read_text()
    assert log_file.stat().st_mode & 0o777 == 0o600  # it holds command lines
    d.stop()
    # the bound: FILE + N backups of at most max_bytes (plus one line) each
    h = PrivateRotatingFileHandler(str(tmp_path / "small.log"), max_bytes=10_000, backups=2)
    lg = logging.getLogger("tunerd.test-rotation")
    lg.propagate = False
    lg.addHandler(h)
    try:
        for i in range(2000):
            lg.warning("line %d %s", i, "x" * 80)
    finally:
        lg.removeHandler(h)
        h.close()
    files = sorted(tmp_path.glob("small.log*"))
    assert [f.name for f in files] == ["small.log", "small.log.1", "small.log.2"]
    assert all(f.stat().st_size <= 10_000 + 200 and f.stat().st_mode & 0o777 == 0o600
               for f in files)
