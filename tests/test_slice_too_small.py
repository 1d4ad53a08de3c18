"""A GPU's slice too small for a rank and its DataLoader workers: the rank stays in its
slice (never spread over other GPUs' slices), and `jobs` and `advise` say so (issue 26
item 2)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import DaemonProc, wait_for
from tests.launcher_helpers import spawn_rank
from tests.leases_helpers import DGX_H100, cpus_allowed, kill_tree, snapshot_with_gpus_here
from tunerd.base.cpulist import parse_cpulist
from tunerd.diagnose.advise import advise, slice_too_small
from tunerd.jobs.placer import HostCapacity, Placer, PlaceRequest
from tunerd.topology import load_topology
from tunerd.topology.nodemap import node_map


def test_a_rank_whose_workers_do_not_fit_stays_in_its_slice_with_a_note() -> None:
    topo = load_topology(DGX_H100)
    placer = Placer(topo, HostCapacity(topo.online_cpus(), frozenset(topo.numa_nodes)),
                    frozenset)
    own = node_map(topo).slices[2].cpus
    one = placer.place(PlaceRequest(gpu_ids=(2,), rank=0, ranks=1, workers=40,
                                    mode="gpu-local", group="torchrun:1.1", what="process 1"))
    assert one.cpus == own  # its 28 CPUs: never more of another GPU's
    assert "28 CPU(s) for a process with 40 DataLoader worker(s)" in (one.explanation or "")
    found = slice_too_small({"explanation": one.explanation, "gpus": [2]}, {})
    assert found is not None and found.id == "slice-too-small"
    assert found.evidence["workers"] == 40 and found.evidence["slice_cpus"] == 28
    assert found.evidence["gpus"] == "2"
    two = placer.place(PlaceRequest(gpu_ids=(2,), rank=1, ranks=2, workers=40, gpu_sharers=2,
                                    gpu_peers=(2,), mode="gpu-local", group="torchrun:1.1",
                                    what="process 2"))
    assert two.cpus and two.cpus <= own
    found = slice_too_small({"explanation": two.explanation}, {})
    assert found is not None and found.evidence["ranks_on_gpu"] == 2


def test_the_finding_needs_the_note() -> None:
    job = {"explanation": "near GPU 2 (NUMA node 0); rank 0 of 1: 14 CPUs (room for the "
                          "rank and 4 DataLoader worker(s))"}
    assert slice_too_small(job, {}) is None
    assert [f.id for f in advise(job, {})] == []
    shared = {"explanation": "GPU 0's slice (CPU 0-13) cannot give each of the 2 ranks on "
                             "it room for 8 DataLoader worker(s): they share the slice"}
    f = slice_too_small(shared, {})
    assert f is not None and f.evidence["ranks_on_gpu"] == 2 and f.evidence["workers"] == 8


def test_jobs_and_advise_say_a_bound_rank_s_slice_is_too_small(daemon_factory,
                                                               tmp_path: Path) -> None:
    snap, _, _ = snapshot_with_gpus_here(tmp_path / "snap.json")
    slice0 = node_map(load_topology(snap)).slices[0].cpus
    workers = len(slice0) + 1  # more than the slice holds, whatever this machine is
    pdir = tmp_path / "policies"
    pdir.mkdir()
    (pdir / "00-t.toml").write_text(
        '[policy]\nname = "t"\n\n[[job]]\nname = "train"\n'
        'match.cmdline = ["*slice_test_rank*"]\nmatch.rank = true\n'
        f'placement = "gpu-local"\nworkers = {workers}\n')
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("sample_interval = 0.5\n")
    rank_exe = tmp_path / "slice_test_rank"
    rank_exe.write_bytes(Path("/bin/sleep").read_bytes())
    rank_exe.chmod(0o755)
    d: DaemonProc = daemon_factory(policy_dir=pdir, args=[
        "--topology", str(snap), "--config", str(cfg)]).start()
    agent, pid = spawn_rank([str(rank_exe), "60"], {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                                     "CUDA_VISIBLE_DEVICES": "0"})
    try:
        wait_for(lambda: cpus_allowed(pid) is not None
                 and parse_cpulist(cpus_allowed(pid) or "") == slice0, 10,
                 f"rank {pid} in GPU 0's slice", detail=d.log)
        jobs = json.loads(d.ctl("--json", "jobs").out)["jobs"]
        rec = next(j for j in jobs if j["pid"] == pid)
        assert f"CPU(s) for a process with {workers} DataLoader worker(s)" \
            in rec["explanation"], rec

        def finding() -> dict[str, object] | None:
            out = json.loads(d.ctl("--json", "advise", str(pid)).out or "{}")
            for j in out.get("jobs") or []:
                for f in j["findings"]:
                    if f["id"] == "slice-too-small":
                        return dict(f)
            return None

        f = wait_for(finding, 15, "advise's slice-too-small finding", detail=d.log)
        assert f["evidence"]["workers"] == workers  # type: ignore[index]
    finally:
        kill_tree(agent)
