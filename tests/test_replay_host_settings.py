"""A replayed topology changes no host setting of the real machine unless asked
(issue 34 item 5).

`tunerd --topology dgx-h100.json` with the bundled policies matches
00-h100-training.toml by the replayed GPUs. The daemon here is the real process, a
`--scope-pid` test daemon as docs/install.md shows, but its /proc, /sys and /etc roots
(config keys proc_root, sys_root, etc_root) are a temporary tree seeded with this
host's current values, and it runs in a network namespace of its own: were the fix to
regress, the writes land in the tree (which is how the test sees them), never on the
host. The host's own values are read before and after as well.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.helpers import FIXTURES, REPO, DaemonProc

pytestmark = pytest.mark.root

BUNDLED = REPO / "tunerd" / "bundled_policies"
POLICIES = ("00-base.toml", "00-h100-training.toml")


def _sysctl_paths() -> list[str]:
    """/proc-relative files of every sysctl the replayed node's policies name."""
    keys: list[str] = []
    for name in POLICIES:
        keys += tomllib.loads((BUNDLED / name).read_text()).get("sysctl", {})
    return [f"sys/{k.replace('.', '/')}" for k in keys] + ["sys/kernel/numa_balancing"]


def _host_values() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for rel in _sysctl_paths():
        try:
            out[rel] = Path("/proc", rel).read_text()
        except OSError:
            out[rel] = None
    nccl = Path("/etc/nccl.conf")
    out["/etc/nccl.conf"] = (hashlib.sha256(nccl.read_bytes()).hexdigest()
                             if nccl.exists() else None)
    return out


def _tree(base: Path, host: dict[str, str | None]) -> tuple[Path, Path, Path]:
    """proc, sys and etc roots: the host's current sysctl values, an empty /etc."""
    proc, sys_, etc = base / "proc", base / "sys", base / "etc"
    for rel, value in host.items():
        if rel.startswith("sys/") and value is not None:
            f = proc / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(value)
    (sys_ / "class" / "net").mkdir(parents=True)
    etc.mkdir()
    return proc, sys_, etc


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _replay_daemon(daemon_factory, tmp: Path, *extra: str) -> tuple[DaemonProc, Path]:  # type: ignore[no-untyped-def]
    host = _host_values()
    roots = _tree(tmp / "roots", host)
    pol = tmp / "pol"
    pol.mkdir()
    for name in POLICIES:
        shutil.copy(BUNDLED / name, pol / name)
    conf = tmp / "tunerd.toml"
    conf.write_text(f'proc_root = "{roots[0]}"\nsys_root = "{roots[1]}"\n'
                    f'etc_root = "{roots[2]}"\nwatch_execs = false\n')
    d: DaemonProc = daemon_factory(policy_dir=pol, args=[
        "--topology", str(FIXTURES / "topologies" / "dgx-h100.json"), "--config", str(conf),
        *extra])
    real_argv = d.argv

    def in_netns() -> list[str]:  # the NIC and net.* writes of a regression: not the host's
        return ["unshare", "--net", "--", *real_argv()]

    d.argv = in_netns  # type: ignore[method-assign]
    return d, tmp / "roots"


def test_a_replayed_dgx_writes_no_host_setting(tmp_path: Path, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    host_before = _host_values()
    d, roots = _replay_daemon(daemon_factory, tmp_path)
    tree_before = _snapshot(roots)
    d.start()
    try:
        st = d.ctl("--json", "status").json()
        plan = d.ctl("plan")
        applied = d.ctl("apply")  # an explicit apply (root) writes nothing either
    finally:
        d.stop()
    assert "h100-training" in st["policy"]["names"], st["policy"]
    assert _snapshot(roots) == tree_before  # no write attempt reached the roots
    state = d.state_dir / "state.json"
    assert not state.exists() or '"originals": {}' in state.read_text().replace("\n", "")
    assert _host_values() == host_before  # and the host is as it was
    # status says plainly what it does: nothing written, and what it would manage
    host = st["services"]["host"]
    assert host["writes"]["written"] is False, host
    assert "topology replay" in host["writes"]["plan_only"], host
    assert host["summary"].startswith("planned only, nothing written to this machine")
    assert "sysctl (" in host["summary"] and "nccl (" in host["summary"], host["summary"]
    # plan shows what it would do, and says it is only a plan
    assert "sysctl:net.ipv4.tcp_max_syn_backlog" in plan.out, plan.out
    assert "planned only, nothing is written to this machine" in plan.out, plan.out
    assert "dry run: would set" in applied.out, applied.out


def test_apply_host_settings_writes_them(tmp_path: Path, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Asked with --apply-host-settings, the replayed policy's settings are written (to
    the temporary roots here): the check above can see a write."""
    host_before = _host_values()
    d, roots = _replay_daemon(daemon_factory, tmp_path, "--apply-host-settings")
    tree_before = _snapshot(roots)
    d.start()
    try:
        host = d.ctl("--json", "status").json()["services"]["host"]
        assert host["writes"]["written"] is True, host
        assert host["summary"].startswith("written to this machine: "), host["summary"]
    finally:
        d.stop()
    after = _snapshot(roots)
    assert after != tree_before
    assert after.get("etc/nccl.conf", "").count("NCCL_") >= 1, after.keys()
    assert after["proc/sys/net/ipv4/tcp_max_syn_backlog"].strip() == "8192"
    assert _host_values() == host_before


def test_a_plain_scoped_daemon_says_which_host_settings_it_writes(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A --scope-pid test daemon on this machine (no replay) writes the host settings of
    its policy: status says so, by section."""
    d = daemon_factory().start()
    host = d.ctl("--json", "status").json()["services"]["host"]
    assert host["writes"]["written"] is True and host["writes"]["plan_only"] is None
    assert host["summary"].startswith("written to this machine: "), host["summary"]
    out = d.ctl("status").out
    assert "host: written to this machine: " in out, out


def test_the_flag_is_documented() -> None:
    out = subprocess.run([sys.executable, "-m", "tunerd.daemon.main", "--help"],
                         capture_output=True, text=True, cwd=REPO, timeout=60).stdout
    assert "--apply-host-settings" in out
    docs = (REPO / "docs" / "install.md").read_text()
    assert "--apply-host-settings" in docs
