"""`tunerctl bind PID` without placement flags: near the GPUs the process uses (leases placer)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.leases_helpers import (
    DGX_H100,
    cpus_allowed,
    kill,
    snapshot_with_gpus_here,
    spawn,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")]


def test_bind_reads_cuda_visible_devices_and_local_rank(tmp_path: Path, daemon_factory) -> None:
    snap, lo, hi = snapshot_with_gpus_here(tmp_path / "snap.json")
    d = daemon_factory(args=["--topology", str(snap)]).start()
    by_cvd = spawn(["sleep", "30"], {"CUDA_VISIBLE_DEVICES": "1"})
    by_rank = spawn(["sleep", "30"], {"LOCAL_RANK": "0"})
    by_uuid = spawn(["sleep", "30"], {"CUDA_VISIBLE_DEVICES": "GPU-test-1"})
    no_gpu = spawn(["sleep", "30"], {"CUDA_VISIBLE_DEVICES": ""})
    try:
        wait_for(lambda: all(os.path.exists(f"/proc/{p.pid}/environ")
                             for p in (by_cvd, by_rank, by_uuid, no_gpu)), 10,
                 "the four processes to start")
        r = d.ctl("--json", "bind", str(by_cvd.pid))
        assert r.rc == 0, r.err
        assert r.json()["gpus"] == [1]
        assert cpus_allowed(by_cvd.pid) == str(hi)
        assert d.ctl("bind", str(by_rank.pid)).rc == 0
        assert cpus_allowed(by_rank.pid) == str(lo)
        assert d.ctl("bind", str(by_uuid.pid)).rc == 0
        assert cpus_allowed(by_uuid.pid) == str(hi)
        r = d.ctl("bind", str(no_gpu.pid))
        assert r.rc == 2 and "GPU placement is not available" in r.err
        # --nofile alone on such a process: limits only, CPUs unchanged
        r = d.ctl("--json", "bind", str(no_gpu.pid), "--nofile", "4096")
        assert r.rc == 0 and r.json()["nofile"]["new"] == 4096, r.err
        # --gpus overrides the environment
        assert d.ctl("bind", str(by_cvd.pid), "--gpus", "0").rc == 0
        assert cpus_allowed(by_cvd.pid) == str(lo)
    finally:
        for p in (by_cvd, by_rank, by_uuid, no_gpu):
            kill(p)


def test_bind_on_replay_of_another_machine_applies_nothing(daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    p = spawn(["sleep", "30"], {"CUDA_VISIBLE_DEVICES": "3"})
    try:
        wait_for(lambda: os.path.exists(f"/proc/{p.pid}/environ"), 10, "the process to start")
        before = cpus_allowed(p.pid)
        r = d.ctl("bind", str(p.pid))
        assert r.rc == 1
        assert "nothing was applied" in r.err and "GPUs from its CUDA_VISIBLE_DEVICES" in r.err
        assert cpus_allowed(p.pid) == before
    finally:
        kill(p)


def test_gpus_from_env_and_nvml_on_a_recorded_dgx() -> None:
    """In-process: which GPUs a process uses, from its environment or NVML (replayed)."""
    from tunerd.adapters import nvml
    from tunerd.topology import load_topology
    from tunerd.topology.nvml_replay import ReplayDevice, ReplayNvml
    from tunerd.topology.visible import gpus_from_env, gpus_from_nvml

    topo = load_topology(DGX_H100)
    uuid5 = topo.gpus[5].uuid
    assert gpus_from_env(topo, {}) is None
    assert gpus_from_env(topo, {"LOCAL_RANK": "3"}) == (3,)
    assert gpus_from_env(topo, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == (5,)
    assert gpus_from_env(topo, {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "6"}) == (6,)
    assert gpus_from_env(topo, {"CUDA_VISIBLE_DEVICES": f"2,{uuid5}"}) == (2, 5)
    assert gpus_from_env(topo, {"CUDA_VISIBLE_DEVICES": uuid5[:12]}) == (5,)
    assert gpus_from_env(topo, {"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert gpus_from_env(topo, {"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0"}) == ()

    p = spawn(["sleep", "30"])

    class BusyDevice(ReplayDevice):
        """A snapshot GPU plus a recorded compute-process list (GPU 2 and 7)."""

        def compute_processes(self) -> list[nvml.GpuProcess]:
            busy = {2: [p.pid], 7: [p.pid, 1]}.get(self.index, [1])
            return [nvml.GpuProcess(x, 1 << 30) for x in busy]

    class WithProcesses(ReplayNvml):
        device_class = BusyDevice

    try:
        with nvml.use_backend(WithProcesses(topo)):
            assert gpus_from_nvml(p.pid) == (2, 7)
            assert gpus_from_nvml(999_999_999) == ()
        with nvml.use_backend(None, "no driver"):
            assert gpus_from_nvml(p.pid) == ()
    finally:
        kill(p)
