"""The Monitor service in-process: GPU series from NVML replay, sampler isolation, listen."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.monitor_helpers import TelemetryReplay
from tunerd.adapters import nvml
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import UsageError
from tunerd.daemon.state import RuntimeStore
from tunerd.jobs.actuate import Binder
from tunerd.jobs.ledger import Ledger
from tunerd.jobs.registry import JobRegistry
from tunerd.monitor.listen import parse_listen
from tunerd.monitor.service import Monitor, MonitorSettings

PROMTOOL = shutil.which("promtool")


def make_monitor(tmp_path: Path) -> Monitor:
    """The real Monitor with a real (empty) JobRegistry and error log: no daemon around it."""
    errors = ErrorLog()
    state = RuntimeStore(tmp_path / "state.json")
    jobs = JobRegistry(Binder(), state.section("bindings"), state.save, Ledger(), errors)
    return Monitor(MonitorSettings(metrics_listen="off"), jobs, errors)


@pytest.fixture
def replay() -> Iterator[TelemetryReplay]:
    r = TelemetryReplay()
    with nvml.use_backend(r):
        yield r


def run_cycles(mon: Monitor, n: int = 2) -> None:
    async def go() -> None:
        await mon.start()
        for _ in range(n - 1):
            await mon.cycle()
        await mon.stop()

    asyncio.run(go())


def test_gpu_series_from_replayed_nvml_pass_promtool(tmp_path: Path,
                                                     replay: TelemetryReplay) -> None:
    mon = make_monitor(tmp_path)
    run_cycles(mon)
    text = mon.exposition()
    u0 = 'gpu="0",uuid="GPU-5b3a9a1e-6f0c-2d4e-8a31-0c1f7d2e9b10"'
    assert f"tunerd_gpu_power_watts{{{u0}}} 612.345" in text
    assert f"tunerd_gpu_sm_clock_hertz{{{u0}}} 1.98e+09" in text
    assert f"tunerd_gpu_ecc_corrected_errors_total{{{u0}}} 3.0" in text
    assert 'tunerd_gpu_throttle_reasons{gpu="1",' in text and "} 36.0" in text
    assert 'tunerd_gpu_xid_events_total{gpu="1",' in text
    assert 'tunerd_gpu_process_memory_used_bytes{gpu="0",pid="4242"} 7.0866960384e+10' in text
    assert "tunerd_gpu_monitoring_available 1.0" in text
    # GPU 1 does not support the PCIe getter: that series is absent, not zero
    assert 'tunerd_gpu_pcie_transmit_bytes_per_second{gpu="1"' not in text
    assert len(mon.history.gpus[1]) == 2
    assert mon.status()["summary"].startswith("sampling every 1 s; 2 GPU(s); 0 job(s)")
    # last, so that the values above are checked on machines without promtool too
    if PROMTOOL is None:
        pytest.skip("promtool not installed: the exposition's syntax was not checked")
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=text,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_failing_sampler_does_not_stop_the_others(tmp_path: Path) -> None:
    mon = make_monitor(tmp_path)

    def broken(full: bool = True) -> dict[str, Any]:
        raise RuntimeError("simulated bug in the host sampler")

    mon.host.sample = broken  # type: ignore[method-assign]
    run_cycles(mon, 3)
    st = mon.sampler_status
    assert st["host"]["ok"] is False and st["host"]["errors"] == 3
    assert "simulated bug" in st["host"]["last_error"]
    assert st["gpu"]["ok"] and st["jobs"]["ok"]
    assert mon.latest is not None and mon.latest["gpu"]["reason"].startswith("not available")
    text = mon.exposition()
    assert 'tunerd_sampler_up{sampler="host"} 0.0' in text
    assert 'tunerd_sampler_errors_total{sampler="host"} 3.0' in text
    assert 'tunerd_sampler_up{sampler="gpu"} 1.0' in text


@pytest.mark.parametrize(("value", "want"), [
    ("off", None), ("OFF", None), ("127.0.0.1:9464", ("127.0.0.1", 9464)),
    ("0.0.0.0:1", ("0.0.0.0", 1)), ("[::1]:9464", ("::1", 9464)),
    ("gpu-node-01:9100", ("gpu-node-01", 9100)), ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("[::1]:0", ("::1", 0))])
def test_parse_listen(value: str, want: tuple[str, int] | None) -> None:
    assert parse_listen(value) == want


@pytest.mark.parametrize("bad", ["", "9464", ":9464", "host:", "host:-1", "host:65536",
                                 "::1:9464", "[::1]9464", "[nothost]:1", "h:12ab"])
def test_parse_listen_rejects(bad: str) -> None:
    with pytest.raises(UsageError, match="metrics_listen"):
        parse_listen(bad)


def test_the_sampler_thread_samples_on_its_own_timer(tmp_path: Path) -> None:
    """Timed cycles run and publish in the sampler thread: they go on while the event
    loop is blocked (a cycle no longer waits for the loop, nor wakes it)."""
    errors = ErrorLog()
    state = RuntimeStore(tmp_path / "state.json")
    jobs = JobRegistry(Binder(), state.section("bindings"), state.save, Ledger(), errors)
    mon = Monitor(MonitorSettings(interval=0.05, metrics_listen="off"), jobs, errors)

    async def go() -> tuple[int, int, float]:
        await mon.start()
        n0 = mon.samples_total
        t0 = mon.last_cycle_at
        time.sleep(0.6)  # the loop is blocked: nothing on it runs meanwhile
        n1 = mon.samples_total
        await mon.stop()
        return n0, n1, mon.last_cycle_at - t0

    n0, n1, advanced = asyncio.run(go())
    assert n0 == 1  # start()'s first sample, asked for on the loop
    assert n1 >= 4, f"only {n1 - n0} timed cycles in 0.6 s at a 0.05 s interval"
    assert advanced > 0.3
    assert mon.status()["samples_total"] == mon.samples_total
