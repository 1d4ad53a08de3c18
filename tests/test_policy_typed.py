"""The typed policy (Policy.model): built by the loader, read by tuners and rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers import REPO, write_policy
from tunerd.base.errors import UsageError
from tunerd.base.modes import MODES, Mode
from tunerd.policy import NodeFacts, load_policy_dir
from tunerd.policy.sections import PLACEMENTS
from tunerd.policy.typed import (
    BlockRule,
    CpuSection,
    GpuSection,
    GpuUseSpec,
    JobSpec,
    LeasePolicy,
    Limits,
    NicRule,
    PolicyInfo,
    PolicyModel,
    TorchSettings,
    VmSection,
)
from tunerd.tuners import SECTIONS, build_tuners
from tunerd.watch.rules import RuleSet

FULL = '''
[policy]
name = "site"
extends = ["base"]
apply_once = ["nic:*:mtu"]
[sysctl]
"net.core.somaxconn" = 4096
"net.ipv4.tcp_rmem" = "4096 87380 268435456"
[[nic]]
match = "ens*"
mtu = 9000
[[nic]]
match = "ib*"
txqueuelen = 10000
[nccl]
NCCL_SOCKET_IFNAME = "=ens1f0"
NCCL_IB_DISABLE = 0
NCCL_NVLS_ENABLE = false
[[block]]
match = "nvme*"
scheduler = "none"
read_ahead_kb = 4096
[limits]
nofile = 65536
[cpu]
housekeeping = "1,0,3"
governor = "performance"
[vm]
transparent_hugepage = "madvise"
[gpu]
persistence_mode = true
power_limit_w = 400
[leases]
user_exclusive = true
alloc_ttl = 0
[[job]]
name = "torch-training"
workers = 8
torch = { num_workers = 8, pin_memory = true, amp = "bf16" }
[[job]]
name = "pinned"
match.cmdline = ["*bench*"]
match.env = { RANK = "[0-3]", LOCAL_RANK = "*" }
match.user = ["root", "1234"]
placement = "exclusive"
cpus = "5,4,6"
gpus = 2
nofile = 2048
exclusive = true
exclusive_scope = "pid:1"
gpu_use = { enabled = true, user = ["alice"], cmdline = ["*bench*"], env = { TEAM = "a*" } }
[job.torch]
persistent_workers = false
prefetch_factor = 4
compile = true
amp = "off"
'''


def test_every_section_typed(tmp_path: Path) -> None:
    site = write_policy(tmp_path, "site.toml", FULL)
    p = load_policy_dir(tmp_path, NodeFacts("n1"))
    m = p.model
    base = str(REPO / "tunerd/bundled_policies/00-base.toml")
    assert m.info == PolicyInfo(name="site", names=("base", "site"), sources=(base, str(site)))
    assert dict(m.sysctl) == {"net.core.somaxconn": 4096,
                              "net.ipv4.tcp_rmem": "4096 87380 268435456"}
    assert m.nic == (NicRule("ens*", mtu=9000), NicRule("ib*", txqueuelen=10000))
    assert dict(m.nccl) == {"NCCL_SOCKET_IFNAME": "=ens1f0", "NCCL_IB_DISABLE": 0,
                            "NCCL_NVLS_ENABLE": False}
    assert m.block == (BlockRule("nvme*", scheduler="none", read_ahead_kb=4096),)
    assert m.limits == Limits(nofile=65536)
    assert m.cpu == CpuSection(housekeeping=frozenset({0, 1, 3}), governor="performance")
    assert m.vm == VmSection(transparent_hugepage="madvise", numa_balancing=False)  # base
    assert m.gpu == GpuSection(persistence_mode=True, power_limit_w=400)
    assert m.apply_once == ("nic:*:mtu",)
    assert m.leases == LeasePolicy(user_exclusive=True, max_per_user=64, alloc_ttl=0)
    torch_rule, pinned = m.jobs
    # the site file changed the bundled rule by name: match, placement, gpu_use stay base's
    assert torch_rule == JobSpec(
        name="torch-training", rank=True, placement="gpu-local", nofile=1048576, workers=8,
        torch=TorchSettings(num_workers=8, pin_memory=True, amp="bf16"),
        gpu_use=GpuUseSpec())
    assert pinned == JobSpec(
        name="pinned", cmdline=("*bench*",), env={"RANK": "[0-3]", "LOCAL_RANK": "*"},
        users=("root", "1234"), placement="exclusive", cpus=frozenset({4, 5, 6}), gpus=2,
        nofile=2048, exclusive=True, exclusive_scope="pid:1",
        torch=TorchSettings(persistent_workers=False, prefetch_factor=4, amp="off",
                            compile=True),
        gpu_use=GpuUseSpec(cmdline=("*bench*",), env={"TEAM": "a*"}, users=("alice",)))
    # the wire form of a rule's torch table (the `report` reply): only keys that are set
    assert pinned.torch.to_dict() == {"persistent_workers": False, "prefetch_factor": 4,
                                      "amp": "off", "compile": True}
    assert TorchSettings().to_dict() == {}
    # the typed policy and the plain one say the same
    assert p.data["leases"] == {"user_exclusive": True, "max_per_user": 64, "alloc_ttl": 0}
    assert p.data["job"][1]["torch"]["prefetch_factor"] == 4


def test_the_model_is_read_only(tmp_path: Path) -> None:
    write_policy(tmp_path, "site.toml", FULL)
    m = load_policy_dir(tmp_path, NodeFacts("n1")).model
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.limits = Limits(1)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.jobs[0].torch.amp = "fp16"  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.sysctl["vm.swappiness"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        m.jobs[1].env["X"] = "*"  # type: ignore[index]


def test_torch_table_merges_key_by_key(tmp_path: Path) -> None:
    write_policy(tmp_path, "10-a.toml", '[[job]]\nname = "t"\nmatch.cmdline = "*t*"\n'
                                        'workers = 4\ntorch = { num_workers = 4, amp = "fp16" }\n')
    write_policy(tmp_path, "20-b.toml", '[[job]]\nname = "t"\n[job.torch]\namp = "bf16"\n'
                                        "pin_memory = true\n")
    (job,) = load_policy_dir(tmp_path, NodeFacts("n1")).model.jobs
    assert job.workers == 4
    assert job.torch == TorchSettings(num_workers=4, pin_memory=True, amp="bf16")


def test_empty_policy_model(tmp_path: Path) -> None:
    write_policy(tmp_path, "a.toml", '[policy.match]\nhostname = "elsewhere"\n'
                                     '[limits]\nnofile = 5\n')
    m = load_policy_dir(tmp_path, NodeFacts("here")).model
    assert m == PolicyModel()
    assert m.leases == LeasePolicy(user_exclusive=False, max_per_user=64, alloc_ttl=86400)
    assert m.cpu.housekeeping == frozenset() and m.limits.nofile is None
    for name in SECTIONS:
        m.section(name)  # every tuner's section exists
    with pytest.raises(KeyError, match="'job'"):
        m.section("job")


@pytest.mark.parametrize("node", [NodeFacts("dgx-h100-01", ("NVIDIA H100 80GB HBM3",) * 8),
                                  NodeFacts("l40s-02", ("NVIDIA L40S",) * 8), NodeFacts("ws")])
def test_bundled_policies_typed(node: NodeFacts) -> None:
    p = load_policy_dir(REPO / "policies", node)
    m = p.model
    assert m.info.names == tuple(p.data["policy"]["names"])
    assert m.limits.nofile == 1048576 and m.vm.numa_balancing is False
    assert dict(m.sysctl) == p.data["sysctl"] and dict(m.nccl) == p.data["nccl"]
    assert [r.match for r in m.nic] == [e["match"] for e in p.data["nic"]]
    assert [j.name for j in m.jobs] == [j["name"] for j in p.data["job"]]
    assert m.jobs[0].rank and not m.jobs[0].cmdline  # ranks by environment and tree


def _put(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_tuners_plan_the_typed_sections_of_a_loaded_policy(tmp_path: Path) -> None:
    """The path the daemon takes: load, PolicyModel.section(name), tuner.plan(section)."""
    proc, sysfs, etc = tmp_path / "proc", tmp_path / "sys", tmp_path / "etc"
    _put(proc / "sys/net/core/somaxconn", "128\n")
    _put(proc / "sys/net/ipv4/tcp_rmem", "4096\t87380\t268435456\n")
    _put(sysfs / "class/net/ens1/mtu", "1500\n")
    _put(sysfs / "class/net/ens1/tx_queue_len", "1000\n")
    _put(sysfs / "class/net/ib0/mtu", "2044\n")
    _put(sysfs / "class/net/ib0/tx_queue_len", "1000\n")
    _put(sysfs / "block/nvme0n1/queue/scheduler", "[mq-deadline] none\n")
    _put(sysfs / "block/nvme0n1/queue/read_ahead_kb", "128\n")
    _put(sysfs / "kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n")
    _put(sysfs / "devices/system/cpu/cpu0/cpufreq/scaling_governor", "powersave\n")
    etc.mkdir()
    pol = tmp_path / "pol"
    write_policy(pol, "site.toml", FULL)
    m = load_policy_dir(pol, NodeFacts("n1")).model
    tuners = build_tuners(proc, sysfs, etc, gpu_unavailable="no GPUs in this test")
    plan = {c.key: (c.current, c.desired, c.available)
            for name in SECTIONS for c in tuners[name].plan(m.section(name))}
    assert plan == {
        "sysctl:net.core.somaxconn": ("128", "4096", True),
        "sysctl:net.ipv4.tcp_rmem": ("4096 87380 268435456", "4096 87380 268435456", True),
        "nic:ens1:mtu": ("1500", "9000", True),
        "nic:ib0:txqueuelen": ("1000", "10000", True),
        "block:nvme0n1:scheduler": ("mq-deadline", "none", True),
        "block:nvme0n1:read_ahead_kb": ("128", "4096", True),
        "vm:transparent_hugepage": ("always", "madvise", True),
        "vm:numa_balancing": (None, "0", False),  # not in this tree: not available
        "cpu:governor": ("powersave", "performance", True),
        "nccl:NCCL_SOCKET_IFNAME": (None, "=ens1f0", True),
        "nccl:NCCL_IB_DISABLE": (None, "0", True),
        "nccl:NCCL_NVLS_ENABLE": (None, "0", True),
        "gpu:*:persistence_mode": (None, "1", False),
        "gpu:*:power_limit_w": (None, "400", False),
    }
    assert tuners["nic"].mentions("nic:ens9:mtu", m.nic)
    assert not tuners["nic"].mentions("nic:ens9:txqueuelen", m.nic)


def test_rules_come_from_the_typed_jobs(tmp_path: Path) -> None:
    write_policy(tmp_path, "site.toml", FULL)
    rules = RuleSet.from_policy(load_policy_dir(tmp_path, NodeFacts("n1")).model.jobs).rules
    assert [r.name for r in rules] == ["torch-training", "pinned"]
    t, pinned = rules
    assert t.workers == 8 and t.torch.amp == "bf16" and t.placement == "gpu-local"
    assert pinned.cpus == frozenset({4, 5, 6}) and pinned.exclusive_scope == "pid:1"
    assert pinned.env == (("LOCAL_RANK", "*"), ("RANK", "[0-3]"))
    assert pinned.uids == {0, 1234}
    # the placement is the enum from the policy on (issue 33 item 6), spelt as before
    assert t.placement is Mode.GPU_LOCAL and pinned.placement is Mode.EXCLUSIVE
    assert str(pinned.placement) == "exclusive"
    assert pinned.matches("python bench.py", 1234, {"RANK": "2", "LOCAL_RANK": "0"})
    assert not pinned.matches("python bench.py", 1234, {"RANK": "7", "LOCAL_RANK": "0"})
    assert not pinned.matches("python bench.py", 999, {"RANK": "2", "LOCAL_RANK": "0"})
    assert not pinned.matches("python train.py", 1234, {"RANK": "2", "LOCAL_RANK": "0"})


def test_no_worker_processes_with_persistent_workers_off_is_valid(tmp_path: Path) -> None:
    write_policy(tmp_path, "a.toml", '[[job]]\nname = "t"\nmatch.cmdline = "*t*"\nworkers = 0\n'
                                     "torch = { num_workers = 0, persistent_workers = false }\n")
    (job,) = load_policy_dir(tmp_path, NodeFacts("n1")).model.jobs
    assert job.workers == 0
    assert job.torch == TorchSettings(num_workers=0, persistent_workers=False)


def test_the_placement_is_parsed_into_the_mode_once(tmp_path: Path) -> None:
    """The schema's choices are the enum's values (one cannot grow without the other);
    the loaded rule holds a Mode; text given to a rule is parsed on the way in, and an
    unknown one is refused there, naming it."""
    assert PLACEMENTS == MODES == tuple(m.value for m in Mode)
    write_policy(tmp_path, "site.toml", FULL)
    jobs = load_policy_dir(tmp_path, NodeFacts("n1")).model.jobs
    assert [type(j.placement) for j in jobs] == [Mode, Mode]
    assert JobSpec(name="j", placement="socket").placement is Mode.SOCKET
    with pytest.raises(UsageError, match="unknown placement mode 'gpu-near'"):
        JobSpec(name="j", placement="gpu-near")
