"""The fleet series of one node stay bounded (docs/fleet.md): the real Monitor in-process on
a replayed 8-GPU node, real rank processes reporting, real NICs of this machine."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from tests.helpers import FIXTURES
from tests.leases_helpers import kill, spawn
from tests.test_monitor_service import make_monitor
from tunerd.adapters import nvml, procfs
from tunerd.monitor.facts import MAX_NCCL_KEYS, MAX_RANKS, FleetFacts, policy_hash
from tunerd.monitor.reports import parse_report
from tunerd.topology import load_topology
from tunerd.topology.nvml_replay import ReplayNvml

FLEET_FAMILIES = ("tunerd_node_info", "tunerd_policy_info", "tunerd_nic_mtu",
                  "tunerd_nccl_setting_info", "tunerd_rank_step_seconds",
                  "tunerd_rank_samples_per_second", "tunerd_rank_bound",
                  "tunerd_gpu_pcie_link_degraded")


def _series(text: str, names: tuple[str, ...]) -> int:
    return sum(1 for line in text.splitlines()
               if not line.startswith("#") and re.match(rf"({'|'.join(names)})[{{ ]", line))


def _exposition(tmp_path: Path, ranks: int, nccl_keys: int, job: str = "llm") -> tuple[str, str]:
    """(exposition with `ranks` live reporting ranks, exposition after they ended)."""
    topo = load_topology(FIXTURES / "topologies" / "dgx-h100.json")
    procs = [spawn(["sleep", "60"]) for _ in range(ranks)]
    try:
        with nvml.use_backend(ReplayNvml(topo)):
            mon = make_monitor(tmp_path)
            settings = {f"NCCL_KEY_{i}": str(i) for i in range(nccl_keys)}
            mon.fleet = FleetFacts(nccl_conf=lambda: (settings, "e"), python=None)
            mon.fleet.policy_changed(("base", "h100"), [g.model for g in topo.gpus],
                                     {"policy": {"name": "h100"}})
            for rank, p in enumerate(procs):
                st = procfs.Process(p.pid).stat().start_time
                mon.reports.put(parse_report(
                    {"step_time_s": 0.5, "samples_per_s": 128.0, "rank": rank, "job": job},
                    pid=p.pid, start_time=st))
            deadline = time.monotonic() + 30  # the version probe runs in its thread
            while mon.fleet.versions is None and time.monotonic() < deadline:
                time.sleep(0.01)

            async def live() -> str:
                await mon.start()
                await mon.cycle()
                return mon.exposition()

            async def after() -> str:
                await mon.cycle()  # notices the ended ranks, forgets their reports
                await mon.cycle()
                out = mon.exposition()
                await mon.stop()
                return out

            loop = asyncio.new_event_loop()
            try:
                during = loop.run_until_complete(live())
                for p in procs:
                    kill(p)
                return during, loop.run_until_complete(after())
            finally:
                loop.close()
    finally:
        for p in procs:
            kill(p)


def test_an_8_gpu_node_with_8_ranks_exports_under_200_fleet_series(tmp_path: Path) -> None:
    text, ended = _exposition(tmp_path, ranks=8, nccl_keys=6)
    n = _series(text, FLEET_FAMILIES)
    total = sum(1 for ln in text.splitlines() if ln.startswith("tunerd_"))
    print(f"fleet series: {n}; whole exposition: {total}")
    assert n < 200
    assert _series(text, ("tunerd_rank_step_seconds",)) == 8
    assert 'tunerd_rank_step_seconds{job="llm",rank="7"} 0.5' in text
    assert 'tunerd_rank_bound{job="llm",rank="0"} 0.0' in text  # reported, never bound
    assert re.search(r'tunerd_node_info\{class="base,h100/NVIDIA H100 80GB HBM3",cuda="",'
                     r'driver="",kernel="[^"]+",nccl="",torch="",version="[^"]+"\} 1', text)
    assert f'tunerd_policy_info{{hash="{policy_hash({"policy": {"name": "h100"}})}"}} 1' in text
    assert 'tunerd_nccl_setting_info{key="NCCL_KEY_5",value="5"} 1.0' in text
    # ranks and their series end with their processes
    assert _series(ended, ("tunerd_rank_",)) == 0


def test_floods_are_capped(tmp_path: Path) -> None:
    text, _ = _exposition(tmp_path, ranks=MAX_RANKS + 8, nccl_keys=MAX_NCCL_KEYS * 3)
    assert _series(text, ("tunerd_rank_step_seconds",)) == MAX_RANKS
    assert _series(text, ("tunerd_nccl_setting_info",)) == MAX_NCCL_KEYS
    assert _series(text, FLEET_FAMILIES) < 200


def test_pcie_link_width_against_its_maximum(tmp_path: Path) -> None:
    from tunerd.monitor.facts import read_pcie_links

    for bdf, width in (("0000:18:00.0", "16"), ("0000:2a:00.0", "4")):
        d = tmp_path / "bus/pci/devices" / bdf
        d.mkdir(parents=True)
        for name, value in (("current_link_width", width), ("max_link_width", "16"),
                            ("current_link_speed", "2.5 GT/s PCIe"),  # idle: ASPM
                            ("max_link_speed", "32.0 GT/s PCIe")):
            (d / name).write_text(value + "\n")
    links = read_pcie_links([(0, "0000:18:00.0"), (1, "0000:2a:00.0"), (2, "0000:99:00.0")],
                            tmp_path)
    assert [(p.gpu, p.width, p.max_width) for p in links] == [(0, 16, 16), (1, 4, 16)]
