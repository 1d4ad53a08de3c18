"""The metrics endpoint under a slow-request flood by a local user (issue 9).

prometheus_client's HTTP server (what `--metrics-listen` starts, 127.0.0.1:9464 by
default) answers any local user, one thread per connection. The attack: the
unprivileged test user opens many TCP connections, sends part of a request line on
each and stalls (slowloris). The daemon must keep serving its control socket and
fresh scrapes (it does), and its threads must stay bounded (they do not yet: one
per stalled connection, never timed out; the test marks that xfail with the numbers
it saw).
"""

from __future__ import annotations

import resource
import socket
import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any

import pytest

from tests.helpers import DaemonProc, wait_for
from tests.security_helpers import forked_as, recv
from tunerd.client import Client

pytestmark = pytest.mark.root

HELD = 200
# what the metrics server may add while HELD connections stall: enough for a few
# honest scrapers at once, far below one thread per connection
MAX_EXTRA_THREADS = 32


def _slowloris(conn: Connection, port: int, n: int) -> None:
    """As the test user: ``n`` connections, each with half a request line, then stall.

    Reports how many it holds; on "check", how many the server has closed since.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 100)), hard))
    held: list[socket.socket] = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /metr")  # no end of line: the handler waits in readline()
        held.append(s)
        # paced: the server's listen backlog is 5, and a SYN it drops is resent
        # after 1 s (a burst of 200 took 30 s; an attacker paces too)
        time.sleep(0.005)
    conn.send(len(held))
    while conn.recv() == "check":
        closed = 0
        for s in held:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass  # still open, nothing sent: the server is still waiting
            except OSError:
                closed += 1
        conn.send(closed)
    for s in held:
        s.close()


def _proc_status(pid: int) -> dict[str, int]:
    """Threads and VmRSS (KiB) of ``pid`` from /proc/PID/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("Threads", "VmRSS"):
                out[key] = int(val.split()[0])
    return out


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    value = fn()
    return value, time.monotonic() - t0


def test_slow_requests_on_the_metrics_port_leave_the_daemon_serving(
        daemon_factory: Any, unpriv_user: tuple[int, int]) -> None:
    d: DaemonProc = daemon_factory(args=["--metrics-listen", "127.0.0.1:0"]).start()
    assert d.proc is not None
    port = d.ctl("--json", "status").json()["services"]["monitor"]["metrics_port"]
    url = f"http://127.0.0.1:{port}/metrics"
    before = _proc_status(d.proc.pid)

    def status() -> Any:
        with Client(str(d.socket), timeout=10) as c:
            return c.call("status")

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())

    with forked_as(*unpriv_user, _slowloris, port, HELD) as conn:
        assert recv(conn, 60) == HELD
        time.sleep(1.0)  # the server has accepted them all and each handler waits
        during = _proc_status(d.proc.pid)
        reply, status_s = _timed(status)
        body, scrape_s = _timed(scrape)
        conn.send("check")
        closed = recv(conn, 30)
    print(f"\nmetrics slowloris, {HELD} connections: threads {before['Threads']} -> "
          f"{during['Threads']}, VmRSS {before['VmRSS']} -> {during['VmRSS']} KiB; "
          f"status {status_s:.2f} s, scrape {scrape_s:.2f} s; {closed} closed by the server")
    assert reply["pid"] == d.proc.pid
    assert status_s < 2.0, f"status took {status_s:.2f} s while {HELD} scrapes stalled"
    assert "tunerd_up 1.0" in body
    assert scrape_s < 5.0, f"a scrape took {scrape_s:.2f} s while {HELD} scrapes stalled"
    # the attacker gone, its threads end (+4: idle executor threads the daemon may keep)
    wait_for(lambda: _proc_status(d.proc.pid)["Threads"] <= before["Threads"] + 4, 15,
             "the metrics server's threads to end after the attacker closed its connections",
             interval=0.2, detail=lambda: str(_proc_status(d.proc.pid)))
    grown = during["Threads"] - before["Threads"]
    if grown > MAX_EXTRA_THREADS:
        # open finding, reported to the lead (the fix is in tunerd/monitor/): the
        # server's threads follow the attacker's connection count up to the unit's
        # TasksMax, and a stalled one is never timed out
        pytest.xfail(f"the metrics server holds {grown} threads for {HELD} stalled "
                     f"connections ({closed} closed by it); RSS +"
                     f"{during['VmRSS'] - before['VmRSS']} KiB")
