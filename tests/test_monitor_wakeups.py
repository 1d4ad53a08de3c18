"""What the daemon's threads do between events (issue 15's whole-daemon CPU budget):
they sleep in the kernel without a timeout where nothing needs a timer, which is read
back from /proc/self/task/TID/syscall (the system call a thread is blocked in and its
arguments), not timed."""

from __future__ import annotations

import platform
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from tests.helpers import wait_for
from tunerd.monitor.http import serve_metrics

X86_64_POLL = 7  # poll(2) on x86_64
NO_TIMEOUT = 0xFFFFFFFF  # poll's timeout, an int: -1 in the low 32 bits of its register


def _syscall(tid: int) -> list[str]:
    """``NR arg1 ... arg6 sp pc`` of the call thread ``tid`` is blocked in ("running"
    while it runs)."""
    return Path(f"/proc/self/task/{tid}/syscall").read_text().split()


def _in_poll_forever(tid: int) -> bool:
    f = _syscall(tid)
    return len(f) > 3 and f[0] == str(X86_64_POLL) and int(f[3], 16) & NO_TIMEOUT == NO_TIMEOUT


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86_64 syscall numbers")
def test_the_metrics_server_sleeps_without_a_timeout_between_scrapes() -> None:
    """socketserver's loop polls every 0.5 s for a shutdown request; the metrics
    server's waits in poll(2) with no timeout, serves scrapes, and still stops."""
    reg = CollectorRegistry(auto_describe=False)
    Gauge("tunerd_test_value", "a value", registry=reg).set(3)
    server, thread = serve_metrics("127.0.0.1", 0, reg)
    try:
        assert thread.native_id is not None
        tid = thread.native_id
        wait_for(lambda: _in_poll_forever(tid), 10.0, "the metrics thread blocked in poll(-1)",
                 detail=lambda: " ".join(_syscall(tid)))
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        for _ in range(2):
            with urllib.request.urlopen(url, timeout=10) as r:
                assert b"tunerd_test_value 3.0" in r.read()
            wait_for(lambda: _in_poll_forever(tid), 10.0, "back in poll(-1) after a scrape",
                     detail=lambda: " ".join(_syscall(tid)))
        stopper = threading.Thread(target=server.shutdown, daemon=True)
        stopper.start()
        stopper.join(10.0)
        thread.join(10.0)
        assert not stopper.is_alive() and not thread.is_alive()
    finally:
        server.server_close()
