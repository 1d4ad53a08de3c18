"""Work the daemon does not do while nobody reads it (issue 15's whole-daemon CPU budget).

Its threads sleep in the kernel without a timeout where nothing needs a timer (read
back from /proc/self/task/TID/syscall: the system call a thread is blocked in and its
arguments, not timed); facts only a reader uses are read when a reader asks."""

from __future__ import annotations

import asyncio
import platform
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from tests.helpers import wait_for
from tests.test_monitor_service import make_monitor
from tunerd.monitor.facts import FleetFacts
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


def test_fleet_facts_are_read_by_a_scrape_not_by_sampling_cycles(tmp_path: Path) -> None:
    """NICs, nccl.conf and PCIe links: never read by a sampling cycle; read by the
    first scrape, not again by one within LIVE_EVERY, and again by the first scrape
    after a policy change (whose NCCL settings it then shows)."""
    reads: list[int] = []
    settings = {"NCCL_IB_HCA": "mlx5_0"}

    def nccl_conf() -> tuple[dict[str, str], str | None]:
        reads.append(1)
        return dict(settings), None

    mon = make_monitor(tmp_path)
    mon.fleet = FleetFacts(nccl_conf=nccl_conf, python=None)

    async def go() -> list[str]:
        await mon.start()
        for _ in range(3):
            await mon.cycle()
        texts = [] if reads else [mon.exposition()]  # none read by the cycles
        texts.append(mon.exposition())
        settings["NCCL_IB_HCA"] = "mlx5_1"
        texts.append(mon.exposition())  # within LIVE_EVERY: the facts read before
        mon.fleet.policy_changed(("base",), [], {"policy": {"name": "base"}})
        texts.append(mon.exposition())
        await mon.stop()
        return texts

    texts = asyncio.run(go())
    assert len(texts) == 4 and len(reads) == 2
    line = 'tunerd_nccl_setting_info{key="NCCL_IB_HCA",value="%s"} 1.0'
    assert all(line % "mlx5_0" in t for t in texts[:3])
    assert line % "mlx5_1" in texts[3]
