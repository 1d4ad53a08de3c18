"""Global (non-namespaced) host settings through the real daemon, on a temporary tree.

Only one test touches a real global value (kernel.printk_ratelimit_burst, +1),
and restores it in a finally.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.host_helpers import NsDaemonProc, make_daemon
from tests.test_host_tuners import ODD_FILES, put
from tunerd.tuners.base import bracketed, normalize

# host_untouched: a few host values are compared before and after the whole module
pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

POLICY = """
[policy]
name = "global-test"

[sysctl]
"vm.swappiness" = 10
"kernel.numa_balancing" = 0

[[block]]
match = "nvme*"
scheduler = "none"
read_ahead_kb = 4096
nr_requests = 1023

[cpu]
governor = "performance"
housekeeping = "0"

[vm]
transparent_hugepage = "never"
transparent_hugepage_defrag = "defer"
numa_balancing = false

[nccl]
NCCL_IB_HCA = "mlx5"
NCCL_DEBUG = "WARN"

[gpu]
persistence_mode = true
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A fake /proc, /sys and /etc: one NVMe, two CPUs with cpufreq, THP, an odd nccl.conf."""
    root = tmp_path / "tree"
    put(root / "proc/sys/vm/swappiness", "60\n")
    put(root / "proc/sys/kernel/numa_balancing", "1\n")
    put(root / "sys/block/nvme0n1/queue/scheduler", "[mq-deadline] none\n")
    put(root / "sys/block/nvme0n1/queue/read_ahead_kb", "128\n")
    put(root / "sys/block/nvme0n1/queue/nr_requests", "255\n")
    put(root / "sys/block/sda/queue/scheduler", "[bfq] none\n")
    for cpu in (0, 1):
        put(root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", "powersave\n")
    put(root / "sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    put(root / "sys/kernel/mm/transparent_hugepage/defrag",
        "always defer defer+madvise [madvise] never\n")
    (root / "etc").mkdir()
    (root / "etc/nccl.conf").write_bytes(ODD_FILES["crlf"])
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def values(root: Path) -> dict[str, str]:
    """Every value in the tree as the tuners parse it ("[madvise] never" -> "madvise")."""
    out = {}
    for k, v in snapshot(root).items():
        text = v.decode(errors="replace")
        out[k] = text if k.startswith("etc/") else (
            bracketed(text) if "[" in text else normalize(text) or "")
    return out


def tree_daemon(tmp_path: Path, tree: Path, daemons: list[NsDaemonProc], policy: str = POLICY,
                **config: object) -> NsDaemonProc:
    d = make_daemon(tmp_path / "d", policy, ns=None, proc_root=tree / "proc",
                    sys_root=tree / "sys", etc_root=tree / "etc", **config)
    daemons.append(d)
    return d


def test_global_settings_apply_verify_revert_on_a_temp_tree(
        tmp_path: Path, tree: Path, daemons: list[NsDaemonProc]) -> None:
    before = snapshot(tree)
    values_before = values(tree)
    assert values_before["sys/block/nvme0n1/queue/scheduler"] == "mq-deadline"
    d = tree_daemon(tmp_path, tree, daemons).start()
    text = {k: v.decode(errors="replace").strip() for k, v in snapshot(tree).items()}
    assert text["proc/sys/vm/swappiness"] == "10"
    assert text["proc/sys/kernel/numa_balancing"] == "0"
    assert text["sys/block/nvme0n1/queue/scheduler"] == "none"
    assert text["sys/block/nvme0n1/queue/read_ahead_kb"] == "4096"
    assert text["sys/block/nvme0n1/queue/nr_requests"] == "1023"
    assert text["sys/block/sda/queue/scheduler"] == "[bfq] none"  # not matched
    assert text["sys/devices/system/cpu/cpu1/cpufreq/scaling_governor"] == "performance"
    assert text["sys/kernel/mm/transparent_hugepage/enabled"] == "never"
    assert text["sys/kernel/mm/transparent_hugepage/defrag"] == "defer"
    nccl = (tree / "etc/nccl.conf").read_bytes()
    assert nccl.startswith(ODD_FILES["crlf"]) and b"NCCL_IB_HCA=mlx5\r\n" in nccl

    r = d.ctl("--json", "plan")
    assert r.rc == 0 and r.json()["changes"] == []
    # no NVIDIA driver here: the GPU setting is "not available", never an error
    (gpu,) = [c for c in r.json()["unavailable"] if c["key"].startswith("gpu:")]
    assert gpu["key"] == "gpu:*:persistence_mode" and gpu["reason"]
    assert "gpu:*:persistence_mode: not available: " in d.ctl("plan").out

    (tree / "sys/block/nvme0n1/queue/read_ahead_kb").write_text("256")
    r = d.ctl("verify")
    assert (r.rc, r.out.splitlines()[0]) == (
        1, "drift: block:nvme0n1:read_ahead_kb: current 256, policy wants 4096")

    r = d.ctl("revert")
    assert r.rc == 0 and "restored block:nvme0n1:scheduler: none -> mq-deadline" in r.out, r
    assert values(tree) == values_before
    assert snapshot(tree).keys() == before.keys()
    assert (tree / "etc/nccl.conf").read_bytes() == ODD_FILES["crlf"]


def test_dry_run_plans_and_writes_nothing(tmp_path: Path, tree: Path,
                                          daemons: list[NsDaemonProc]) -> None:
    before = snapshot(tree)
    d = tree_daemon(tmp_path, tree, daemons)
    snap = Path(__file__).parent / "fixtures/topologies/dgx-h100.json"
    d.extra_args += ["--dry-run", "--topology", str(snap)]
    d.start()
    # a replayed topology's GPUs are not this machine's: nothing planned for them
    assert "gpu:*:persistence_mode: not available: topology replay" in d.ctl("plan").out
    r = d.ctl("--json", "apply")
    assert r.rc == 0 and r.json()["dry_run"] and r.json()["changed"] == []
    assert {c["key"] for c in r.json()["would_change"]} >= {"sysctl:vm.swappiness",
                                                             "cpu:governor", "nccl:NCCL_DEBUG"}
    assert "dry run: would set vm:transparent_hugepage: madvise -> never" in d.ctl("apply").out
    assert snapshot(tree) == before
    assert "dry run (policy): would set sysctl:vm.swappiness: 60 -> 10" in d.log()
    assert not (d.state_dir / "state.json").exists()


def test_one_real_global_sysctl_round_trip(tmp_path: Path, tree: Path,
                                           daemons: list[NsDaemonProc]) -> None:
    """kernel.printk_ratelimit_burst (+1, harmless) on the real /proc, restored in finally."""
    real = Path("/proc/sys/kernel/printk_ratelimit_burst")
    orig = real.read_text().strip()
    policy = ('[policy]\nname = "real"\n[sysctl]\n'
              f'"kernel.printk_ratelimit_burst" = {int(orig) + 1}\n')
    d = make_daemon(tmp_path / "d", policy, ns=None, sys_root=tree / "sys")
    daemons.append(d)
    try:
        d.start()
        assert real.read_text().strip() == str(int(orig) + 1)
        state = json.loads((d.state_dir / "state.json").read_text())
        assert state["host"]["originals"]["sysctl:kernel.printk_ratelimit_burst"] == {
            "value": orig}
        r = d.ctl("revert")
        assert r.rc == 0 and (f"restored sysctl:kernel.printk_ratelimit_burst: {int(orig) + 1} "
                              f"-> {orig}") in r.out, r
        assert real.read_text().strip() == orig
    finally:
        d.cleanup()
        real.write_text(orig)
