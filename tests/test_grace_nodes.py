"""The newest training nodes on the map (issue 36): GB200 trays (with and without the
GPUs' memory onlined as CPU-less NUMA nodes), DGX B200 and HGX H200 recordings.

The node map against the table in docs/placement.md; no rank given CPUs (or, by
default, memory) on a CPU-less node; a GPU's node from its PCI device, not NVML's NUMA
id; a 4-rank torchrun on a GB200 tray split over the two Graces, each rank with its
GPU's NIC (real ranks described from /proc, the replay daemon naming each rank's NIC);
DGX B200 GPUs paired with the ConnectX-7 behind their own switch, never a BlueField."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from tests.helpers import run_ctl, wait_for, write_policy
from tests.iotree import build
from tests.launcher_helpers import spawn_rank
from tests.leases_helpers import kill_tree
from tests.topology_helpers import TOPOLOGIES, fixture, render_sysfs
from tunerd.adapters import nvml
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.jobs.allocation import Allocation
from tunerd.jobs.intake import Intake, JobContext, RankId, request
from tunerd.jobs.placer import HostCapacity, Placer, Reservation
from tunerd.policy.typed import IrqSection
from tunerd.topology import read_system
from tunerd.topology.iopath import gpu_nics
from tunerd.topology.model import RdmaDevice, Topology
from tunerd.topology.nodemap import node_map
from tunerd.topology.nvml_replay import ReplayNvml
from tunerd.tuners.irq import IrqContext, IrqTuner

REPO = Path(__file__).resolve().parent.parent
NEW = ["gb200.json", "gb200-hbm-numa.json", "dgx-b200.json", "hgx-h200.json"]
GRACE = ["gb200.json", "gb200-hbm-numa.json", "gh200.json"]


def _documented() -> dict[str, dict[int, tuple[str, str, str]]]:
    """docs/placement.md's per-platform table: recording -> GPU -> (cpus, mem, NIC)."""
    text = (REPO / "docs" / "placement.md").read_text()
    out: dict[str, dict[int, tuple[str, str, str]]] = {}
    for m in re.finditer(r"^\| ([\w.-]+\.json) \| (\d+) \| ([\d,-]+) \| (\d+) \| (\S+) \|",
                         text, re.M):
        out.setdefault(m[1], {})[int(m[2])] = (m[3], m[4], m[5])
    return out


def _placer(topo: Topology) -> Placer:
    return Placer(topo, HostCapacity(topo.online_cpus(), frozenset(topo.numa_nodes)),
                  frozenset)


def _rank(pid: int, gpu: int) -> JobContext:
    return JobContext(pid=pid, start_time=1, ppid=1, uid=0, comm="python",
                      argv=("python", "train.py"), env={}, allocation=Allocation(),
                      gpus=(gpu,), gpus_how="LOCAL_RANK",
                      rank=RankId(0, 1, "LOCAL_RANK=0", f"torchrun:{pid}.1"), role="rank",
                      why="LOCAL_RANK", visible=(gpu,))


def _cpuless(topo: Topology) -> set[int]:
    return {n.id for n in topo.numa_nodes.values() if not n.cpus}


@pytest.mark.parametrize("name", NEW)
def test_node_map_matches_the_documented_table(name: str) -> None:
    rows = _documented().get(name)
    assert rows, f"docs/placement.md has no rows for {name}"
    m = node_map(fixture(name))
    for g, (cpus, mem, nic) in rows.items():
        s = m.slices[g]
        assert (format_cpulist(s.cpus), format_cpulist(s.mems), ",".join(s.nics)) == \
            (cpus, mem, nic), (name, g)


@pytest.mark.parametrize("name", GRACE)
def test_no_rank_gets_cpus_or_memory_on_a_cpuless_node(name: str) -> None:
    topo = fixture(name)
    cpuless = _cpuless(topo)
    assert cpuless or name == "gb200.json"
    placer = _placer(topo)
    for g in topo.gpus:  # two ranks per GPU, held: the second takes what is left
        for r in range(2):
            ctx = _rank(1000 * (g.index + 1) + r, g.index)
            p = placer.place(request(ctx, gpu_ids=(g.index,), ignore_busy_gpus=True))
            assert p.cpus and p.mems, p.explanation
            assert not {topo.cpus[c].numa_node for c in p.cpus} & cpuless
            assert not p.mems & cpuless  # memory on the Grace's node by default
            assert p.mems == {node_map(topo).slices[g.index].numa_node}
            placer.reserve(Reservation(key=f"rule:{ctx.pid}", holder="t", gpus=p.gpus,
                                       cpus=p.cpus, group=f"j{g.index}"))
    assert all(not (s.mems & cpuless) for s in node_map(topo).slices.values())
    for mode in ("node", "socket", "exclusive", "core-complex"):  # every placement mode
        for g in [*(g.index for g in topo.gpus), None]:
            ask = request(_rank(7, g or 0), gpus=0, mode=mode, ignore_busy_gpus=True) \
                if g is None else request(_rank(7, g), gpu_ids=(g,), mode=mode,
                                          ignore_busy_gpus=True)
            p = _placer(topo).place(ask)
            assert p.cpus and p.mems and not p.mems & cpuless, (mode, g, p.explanation)


def test_a_gpus_node_comes_from_its_pci_device_not_nvmls_numa_id(tmp_path: Path) -> None:
    """Non-CDMM GB200: NVML says node 2/10/18/26 (the HBM); sysfs's numa_node of the
    GPU's PCI function, or where firmware gives -1 its local_cpulist, says the Grace."""
    rec = fixture("gb200-hbm-numa.json")
    no_node = Topology(**{**{f.name: getattr(rec, f.name)
                             for f in dataclasses.fields(rec) if f.name != "_cache"},
                          "gpus": [dataclasses.replace(g, numa_node=None) for g in rec.gpus]})
    sysd, procd = render_sysfs(no_node, tmp_path)
    with nvml.use_backend(ReplayNvml(rec)):
        got = read_system(sysd, procd)
    assert [(g.numa_node, g.memory_numa_nodes) for g in got.gpus] == [
        (0, (2,)), (0, (10,)), (1, (18,)), (1, (26,))]
    assert [format_cpulist(node_map(got).slices[i].cpus) for i in range(4)] == [
        "0-35", "36-71", "72-107", "108-143"]


def test_a_gpu_whose_pci_node_is_its_memory_node_gets_its_graces_cpus(tmp_path: Path) -> None:
    """Firmware that gives the GPU's PCI function its memory node (2, a node without
    CPUs, and so an empty local_cpulist): that node is its memory, its CPUs' node is the
    Grace its CPU affinity says (NVML), and its NIC is that Grace's."""
    rec = fixture("gb200-hbm-numa.json")
    mem_node = Topology(**{**{f.name: getattr(rec, f.name)
                              for f in dataclasses.fields(rec) if f.name != "_cache"},
                           "gpus": [dataclasses.replace(g, numa_node=g.memory_numa_nodes[0],
                                                        local_cpus=frozenset())
                                    for g in rec.gpus]})
    sysd, procd = render_sysfs(mem_node, tmp_path)
    with nvml.use_backend(ReplayNvml(rec)):
        got = read_system(sysd, procd)
    assert [(g.numa_node, g.memory_numa_nodes) for g in got.gpus] == [
        (0, (2,)), (0, (10,)), (1, (18,)), (1, (26,))]
    m = node_map(got)
    assert [(format_cpulist(m.slices[i].cpus), m.slices[i].nics) for i in (0, 3)] == [
        ("0-35", ("mlx5_0:1",)), ("108-143", ("mlx5_3:1",))]


def test_torchrun_4_ranks_on_a_gb200_tray_split_over_the_two_graces(
        daemon_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real rank processes (LOCAL_RANK under a torchrun agent) described from /proc on
    the replayed tray and placed as the rule does (records only: these CPUs are not
    here); the replay daemon names each rank's NIC."""
    topo = fixture("gb200-hbm-numa.json")
    intake = Intake(topo, frozenset(os.sched_getaffinity(0)), bound=lambda pid: None,
                    lease=lambda pid: None)
    placer = _placer(topo)
    got = []
    for r in range(4):
        env = {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4"}
        agent, pid = spawn_rank(["sleep", "30"], env)
        try:  # the rank as it runs (past the launcher's fork, exec'd)
            comm = Path(f"/proc/{pid}/comm")
            wait_for(lambda c=comm: c.read_text().strip() == "sleep", 10,  # type: ignore[misc]
                     "the rank's exec")
            ctx = intake.describe(pid)
            assert ctx.role == "rank" and ctx.gpus == (r,), (ctx.why, ctx.gpus)
            p = placer.place(request(ctx, gpu_ids=ctx.gpus, ignore_busy_gpus=True))
            assert p.cpus is not None, p.explanation
            placer.reserve(Reservation(key=f"rule:{pid}", holder=f"rank {r}", gpus=p.gpus,
                                       cpus=p.cpus, group="torchrun:1.1"))
            got.append(({topo.cpus[c].numa_node for c in p.cpus}, p.mems, p.cpus))
        finally:
            kill_tree(agent)  # type: ignore[arg-type]
    assert [(nodes, set(mems)) for nodes, mems, _ in got] == [
        ({0}, {0}), ({0}, {0}), ({1}, {1}), ({1}, {1})]
    assert not got[0][2] & got[1][2] and not got[2][2] & got[3][2]
    pdir = tmp_path / "policies"
    write_policy(pdir, "00-nic.toml", '[policy]\nname = "nic"\n\n[nccl]\nper_rank_nic = true\n')
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(TOPOLOGIES / "gb200-hbm-numa.json")]
                       ).start()
    # an empty CUDA_VISIBLE_DEVICES hides every GPU (exit 2): the variable is removed
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)
    clean = {k: "" for k in ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
    for r in range(4):
        out = run_ctl("--socket", str(d.socket), "env", "--local-rank", str(r), env=clean)
        assert out.rc == 0, out.err
        assert f"export NCCL_IB_HCA==mlx5_{r}:1" in out.out, out.out
    text = run_ctl("--socket", str(d.socket), "topology").out  # the CLI, from the daemon
    assert "NUMA node 2: GPU0 memory, no CPUs" in text and "GPU3  108-143" in text, text


@pytest.mark.parametrize("name", ["gb200.json", "gb200-hbm-numa.json"])
@pytest.mark.parametrize("jobs", [[[(0,)], [(1,)], [(2,)], [(3,)]], [[(0,), (1,)], [(2,), (3,)]],
                                  [[(0,)], [(1,), (2,)], [(3,)]]])
def test_several_jobs_on_a_gb200_tray_share_no_cpu(name: str,
                                                   jobs: list[list[tuple[int, ...]]]) -> None:
    from tests.test_node_map import _no_core_shared_between_jobs, _run_jobs

    topo = fixture(name)
    got = _run_jobs(topo, jobs)
    _no_core_shared_between_jobs(got)
    m = node_map(topo)
    for key, cpus in got.items():
        j = int(key.split(":")[1].split(".")[0]) - 1000
        for gpus, c in zip(jobs[j], cpus, strict=True):
            assert c <= m.slice_cpus(gpus), (key, gpus, sorted(c))


def test_dgx_b200_gpus_pair_with_their_switchs_cx7_never_a_bluefield() -> None:
    topo = fixture("dgx-b200.json")
    bluefield = {r.name for r in topo.rdma if r.link_layer == "Ethernet"}
    assert bluefield == {"mlx5_8", "mlx5_9", "mlx5_10", "mlx5_11"}
    pairs = gpu_nics(topo)
    assert {g: [(p.nic.name, p.tier) for p in ps] for g, ps in pairs.items()} == {
        g: [(f"mlx5_{g}", "switch")] for g in range(8)}
    # a BlueField port moved behind GPU 0's switch, listed first: still never chosen
    gpu0 = topo.gpu(0)
    moved = dataclasses.replace(next(r for r in topo.rdma if r.name == "mlx5_8"),
                                pcie_path=(*gpu0.pcie_path[:3], "0000:17:02.0"))
    rdma: list[RdmaDevice] = [moved, *(r for r in topo.rdma if r.name != "mlx5_8")]
    odd = dataclasses.replace(topo, rdma=rdma, _cache={})
    assert [p.nic.name for p in gpu_nics(odd)[0]] == ["mlx5_0"]


def test_gb200_pairs_each_gpu_with_a_compute_port_of_its_grace_whatever_the_order() -> None:
    topo = fixture("gb200.json")
    rdma = sorted(topo.rdma, key=lambda r: r.link_layer != "Ethernet")  # BlueField first
    odd = dataclasses.replace(topo, rdma=rdma, _cache={})
    assert {g: ps[0].nic.name for g, ps in gpu_nics(odd).items()} == {
        0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_3"}


def test_gb200_interrupts_go_to_their_graces_cpus(tmp_path: Path) -> None:
    topo = fixture("gb200-hbm-numa.json")
    build(tmp_path, topo)
    ctx = IrqContext(online=frozenset(topo.cpus), held={}, housekeeping=frozenset(),
                     gpus=[(g.index, g.pci_bus_id) for g in topo.gpus])
    t = IrqTuner(tmp_path / "proc", tmp_path / "sys", tmp_path / "etc", lambda: ctx)
    changes = t.plan(IrqSection(devices=("mlx5_*", "gpu")))
    grace1 = {"mlx5_2", "mlx5_3", "gpu2", "gpu3"}
    assert {c.key.split(":")[1] for c in changes} >= grace1 | {"mlx5_0", "gpu0"}
    for c in changes:
        want = "72-143" if c.key.split(":")[1] in grace1 else "0-71"
        assert parse_cpulist(c.desired or "") == parse_cpulist(want), c.key


def test_topology_text_names_cpuless_nodes_and_whose_memory_they_hold() -> None:
    import json

    from tunerd.topology.render import render

    text = render(json.loads((TOPOLOGIES / "gb200-hbm-numa.json").read_text()))
    for node, gpu in ((2, 0), (10, 1), (18, 2), (26, 3)):
        assert f"NUMA node {node}: GPU{gpu} memory, no CPUs" in text
    assert "NUMA nodes 3-9,11-17,19-25,27-33: no CPUs, no memory" in text
    assert "NUMA node 0: CPUs 0-71 (72)" in text


def test_advise_on_grace_says_binding_was_not_measured_to_pay() -> None:
    from tunerd.diagnose.advise import advise

    job = {"pid": 7, "name": "train", "cpus": "0-35", "mems": "0", "gpus": [0]}
    found = {f.id: f for f in advise({**job, "arch": "aarch64"}, {})}
    f = found["grace-binding-unmeasured"]
    assert f.severity == "info" and "tunerctl bench" in f.fix
    assert "grace-binding-unmeasured" not in {x.id for x in advise({**job, "arch": "x86_64"}, {})}
    assert "grace-binding-unmeasured" not in {
        x.id for x in advise({**job, "arch": "aarch64", "binding_measured": True}, {})}
    assert "grace-binding-unmeasured" not in {
        x.id for x in advise({**job, "arch": "aarch64", "gpus": []}, {})}


def test_a_ranks_memory_goes_to_its_gpus_memory_node_only_if_a_policy_asks(
        tmp_path: Path) -> None:
    from tunerd.policy import load_policy_dir
    from tunerd.policy.model import NodeFacts
    from tunerd.topology.nodemap import rank_mems
    from tunerd.watch.rules import JobRule

    topo = fixture("gb200-hbm-numa.json")
    grace0 = frozenset({0})
    assert rank_mems(topo, grace0, (1,)) == grace0  # the default: its CPUs' node
    assert rank_mems(topo, grace0, (1,), gpu_memory=True) == {0, 10}
    assert rank_mems(fixture("gb200.json"), grace0, (1,), gpu_memory=True) == grace0  # CDMM
    assert rank_mems(fixture("dgx-h100.json"), grace0, (1,), gpu_memory=True) == grace0
    write_policy(tmp_path, "10-hbm.toml", '[policy]\nname = "hbm"\n\n[[job]]\n'
                 'name = "offload"\nmatch.rank = true\ngpu_memory = true\n')
    p = load_policy_dir(tmp_path, NodeFacts("gb200-01", ("NVIDIA GB200",) * 4))
    assert [JobRule.from_policy(j).gpu_memory for j in p.model.jobs] == [True]
    write_policy(tmp_path, "10-hbm.toml", '[policy]\nname = "hbm"\n\n[[job]]\n'
                 'name = "offload"\ngpu_memory = "yes"\n')
    from tunerd.base.errors import PolicyError

    with pytest.raises(PolicyError, match=r"10-hbm.toml: job\[0\]\.gpu_memory: expected true"):
        load_policy_dir(tmp_path, NodeFacts("gb200-01", ("NVIDIA GB200",) * 4))
