"""The real daemon applies, verifies and reverts host settings inside a network namespace.

Policies here hold only per-namespace settings (veth MTU, net.* sysctls) and an
/etc in a temp dir, so the host itself is never changed (checked at the end).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, run_as, wait_for, write_policy
from tests.host_helpers import (
    NsDaemonProc,
    add_veth,
    make_daemon,
    netns,
    ns_link,
    ns_mtu,
    ns_set_sysctl,
    ns_sysctl,
    sh,
)

# host_untouched: a few host values are compared before and after the whole module
pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

POLICY = """
[policy]
name = "netns-test"

[sysctl]
"net.core.somaxconn" = 1024
"net.ipv4.tcp_rmem" = "4096 87380 268435456"

[[nic]]
match = "veth*"
mtu = 9000
txqueuelen = 4321

[nccl]
NCCL_SOCKET_IFNAME = "=veth0"
"""


# A fresh namespace copies tcp_rmem/tcp_wmem from the host (Linux >= 4.15): a host tuned
# by 00-h100-training.toml already holds POLICY's tcp_rmem. Values a test must change
# are chosen against what the namespace holds (the first that differs), never assumed.
RMEM = ("4096 87380 268435456", "4096 131072 33554432")


def other_than(current: str, *choices: str) -> str:
    """The first of ``choices`` that differs from ``current``."""
    return next(c for c in choices if c != current)


def policy_for(ns: str) -> tuple[str, str]:
    """POLICY with a tcp_rmem the namespace does not hold yet, and that value."""
    rmem = other_than(ns_sysctl(ns, "net.ipv4.tcp_rmem"), *RMEM)
    return POLICY.replace(RMEM[0], rmem), rmem


@contextlib.contextmanager
def fresh_ns() -> Iterator[str]:
    with netns() as name:
        add_veth(name, "veth0", "veth1")
        yield name


@pytest.fixture
def ns() -> Iterator[str]:
    with fresh_ns() as name:
        yield name


def originals(ns: str) -> dict[str, object]:
    return {"somaxconn": ns_sysctl(ns, "net.core.somaxconn"),
            "tcp_rmem": ns_sysctl(ns, "net.ipv4.tcp_rmem"),
            "veth0": (ns_mtu(ns, "veth0"), ns_link(ns, "veth0")["txqlen"]),
            "veth1": (ns_mtu(ns, "veth1"), ns_link(ns, "veth1")["txqlen"])}


def start(daemons: list[NsDaemonProc], tmp: Path, policy: str, ns: str,
          **config: object) -> NsDaemonProc:
    d = make_daemon(tmp, policy, ns=ns, **config)
    daemons.append(d)
    return d.start()  # type: ignore[return-value]


def test_apply_at_start_plan_verify_revert(tmp_path: Path, ns: str,
                                           daemons: list[NsDaemonProc]) -> None:
    apply_plan_verify_revert(tmp_path, ns, daemons)


def apply_plan_verify_revert(tmp_path: Path, ns: str, daemons: list[NsDaemonProc]) -> None:
    orig = originals(ns)
    assert orig["somaxconn"] != "1024" and orig["veth0"] != (9000, 4321)
    policy, rmem = policy_for(ns)
    d = start(daemons, tmp_path / "d", policy, ns)
    wait_for(lambda: ns_mtu(ns, "veth1") == 9000, 10, "veth1 MTU 9000", detail=d.log)
    assert ns_sysctl(ns, "net.core.somaxconn") == "1024"
    assert ns_sysctl(ns, "net.ipv4.tcp_rmem") == rmem
    assert ns_link(ns, "veth0")["txqlen"] == 4321
    conf = (tmp_path / "d/etc/nccl.conf").read_text()
    assert "NCCL_SOCKET_IFNAME==veth0" in conf

    # originals are in state.json, keyed KIND:NAME[:ATTR]
    saved = json.loads((d.state_dir / "state.json").read_text())["host"]["originals"]
    assert saved["sysctl:net.core.somaxconn"]["value"] == orig["somaxconn"]
    assert saved["nic:veth0:mtu"]["value"] == str(orig["veth0"][0])  # type: ignore[index]

    r = d.ctl("plan")
    assert (r.rc, r.out.strip()) == (0, "nothing to change"), r
    r = d.ctl("verify")
    assert r.rc == 0 and r.out.startswith("no drift"), r
    r = d.ctl("--json", "verify")
    assert r.rc == 0 and r.json()["drift"] == [] and r.json()["checked"] == 7

    r = d.ctl("revert")
    assert r.rc == 0, r
    assert f"restored nic:veth0:mtu: 9000 -> {orig['veth0'][0]}" in r.out  # type: ignore[index]
    assert "restored sysctl:net.core.somaxconn: 1024 -> " in r.out
    assert f"restored sysctl:net.ipv4.tcp_rmem: {rmem} -> {orig['tcp_rmem']}" in r.out
    assert originals(ns) == orig
    assert not (tmp_path / "d/etc/nccl.conf").exists()  # tunerd created it: removed
    # after a revert the daemon no longer enforces: verify reports, plan shows the way back
    r = d.ctl("verify")
    assert r.rc == 1 and f"drift: sysctl:net.core.somaxconn: current {orig['somaxconn']}" \
        in r.out, r
    r = d.ctl("--json", "plan")
    assert {c["key"] for c in r.json()["changes"]} >= {"nic:veth0:mtu", "nccl:NCCL_SOCKET_IFNAME"}
    r = d.ctl("apply")
    assert r.rc == 0 and "nic:veth0:mtu: 1500 -> 9000" in r.out, r
    assert ns_mtu(ns, "veth0") == 9000
    st = d.ctl("status").out  # read back right after the apply, not at the next verify
    assert "; no drift; enforcing" in st and "drifted" not in st, st


def test_new_veth_gets_its_mtu_from_the_uevent(tmp_path: Path, ns: str,
                                               daemons: list[NsDaemonProc]) -> None:
    # verify_interval 600 s: only the kernel uevent path can set the new NIC in time
    d = start(daemons, tmp_path / "d", POLICY, ns)
    wait_for(lambda: ns_mtu(ns, "veth0") == 9000, 10, "veth0 MTU 9000", detail=d.log)
    add_veth(ns, "veth7", "peer7")  # the peer does not match veth*: left alone
    t0 = time.monotonic()
    wait_for(lambda: ns_mtu(ns, "veth7") == 9000, 10, "the new veth7 to get MTU 9000",
             interval=0.005, detail=d.log)
    elapsed = time.monotonic() - t0
    assert ns_mtu(ns, "peer7") == 1500
    assert "uevent add veth7: set nic:veth7:mtu: 1500 -> 9000" in d.log()
    # quiet machine: well under 0.1 s; a loaded shared one gets slack, still far from 600 s
    assert elapsed < 5.0


# sysctl -> values to choose from: the first the namespace does not hold is written
KILL9_CHOICES = {
    "net.core.somaxconn": ("1111", "1112"),
    "net.ipv4.tcp_rmem": RMEM,
    "net.ipv4.tcp_wmem": ("4096 65536 268435456", "4096 65536 33554432"),
    "net.ipv4.tcp_fin_timeout": ("17", "18"), "net.ipv4.tcp_keepalive_time": ("333", "334"),
    "net.ipv4.tcp_max_syn_backlog": ("2222", "2223"),
    "net.ipv4.ip_local_port_range": ("20000 60000", "20001 60000"),
    "net.ipv4.tcp_mtu_probing": ("1", "2")}


def test_kill9_mid_apply_then_revert_restores_originals(tmp_path: Path, ns: str,
                                                        daemons: list[NsDaemonProc]) -> None:
    kill9_mid_apply_then_revert(tmp_path, ns, daemons)


def kill9_mid_apply_then_revert(tmp_path: Path, ns: str,
                                daemons: list[NsDaemonProc]) -> None:
    for i in range(2, 8):
        add_veth(ns, f"veth{i}a", f"veth{i}b")
    names = list(KILL9_CHOICES)
    before = {n: ns_sysctl(ns, n) for n in names}
    wanted = {n: other_than(before[n], *KILL9_CHOICES[n]) for n in names}
    links = ["veth0", "veth1"] + [f"veth{i}{s}" for i in range(2, 8) for s in "ab"]
    mtus = {ifname: ns_mtu(ns, ifname) for ifname in links}
    assert all(before[n] != v for n, v in wanted.items())
    policy = "[policy]\nname = 'many'\n[sysctl]\n" + "".join(
        f'"{n}" = "{v}"\n' for n, v in wanted.items()) + (
        '[[nic]]\nmatch = "veth*"\nmtu = 9000\n')

    d = make_daemon(tmp_path / "d", policy, ns=ns, debug_apply_delay=0.15)
    daemons.append(d)
    d.start(wait=False)

    def changed() -> int:
        return sum(ns_sysctl(ns, n) != before[n] for n in names)

    wait_for(lambda: changed() >= 2, 20, "two sysctls applied", detail=d.log)
    d.kill9()
    n_applied = changed() + sum(ns_mtu(ns, i) == 9000 for i in links)
    assert 2 <= n_applied < len(names) + len(links), "the kill came after the apply finished"

    # restart without the delay: it applies everything again, keeping the first originals
    d.config.pop("debug_apply_delay")
    d.start()
    wait_for(lambda: all(ns_mtu(ns, i) == 9000 for i in links), 10, "MTU 9000 on every veth",
             detail=d.log)
    assert all(ns_sysctl(ns, n) == v for n, v in wanted.items())
    r = d.ctl("--json", "revert")
    assert r.rc == 0, r
    assert len(r.json()["restored"]) == len(names) + len(links)
    assert {n: ns_sysctl(ns, n) for n in names} == before
    assert {i: ns_mtu(ns, i) for i in links} == mtus
    state = json.loads((d.state_dir / "state.json").read_text())
    assert state["host"]["originals"] == {}


def test_reload_reverts_a_removed_setting(tmp_path: Path, ns: str,
                                          daemons: list[NsDaemonProc]) -> None:
    reload_reverts_a_removed_setting(tmp_path, ns, daemons)


def reload_reverts_a_removed_setting(tmp_path: Path, ns: str,
                                     daemons: list[NsDaemonProc]) -> None:
    orig = originals(ns)
    policy, rmem = policy_for(ns)
    d = start(daemons, tmp_path / "d", policy, ns)
    wait_for(lambda: ns_sysctl(ns, "net.ipv4.tcp_rmem") == rmem, 10, "tcp_rmem applied",
             detail=d.log)
    wait_for(lambda: ns_mtu(ns, "veth0") == 9000, 10, "veth0 MTU 9000", detail=d.log)
    smaller = policy.replace(f'"net.ipv4.tcp_rmem" = "{rmem}"\n', "")
    assert smaller != policy
    smaller = smaller[: smaller.index("[[nic]]")]  # no NIC settings any more
    write_policy(d.policy_dir, "50-host.toml", smaller)
    d.signal(signal.SIGHUP)
    wait_for(lambda: ns_mtu(ns, "veth0") == orig["veth0"][0],  # type: ignore[index]
             10, "veth0 MTU reverted", detail=d.log)
    wait_for(lambda: ns_sysctl(ns, "net.ipv4.tcp_rmem") == orig["tcp_rmem"], 10,
             "tcp_rmem reverted", detail=d.log)
    assert ns_link(ns, "veth1")["txqlen"] == orig["veth1"][1]  # type: ignore[index]
    assert ns_sysctl(ns, "net.core.somaxconn") == "1024"  # still in the policy
    assert "policy no longer names" in d.log()
    r = d.ctl("--json", "revert")
    assert [x["key"] for x in r.json()["restored"]] == ["sysctl:net.core.somaxconn"]


def test_verify_names_drift_and_periodic_verify_fixes_it(tmp_path: Path, ns: str,
                                                         daemons: list[NsDaemonProc]) -> None:
    d = start(daemons, tmp_path / "slow", POLICY, ns)  # verify_interval 600 s
    wait_for(lambda: ns_mtu(ns, "veth0") == 9000, 10, "veth0 MTU 9000", detail=d.log)
    ns_set_sysctl(ns, "net.core.somaxconn", "77")
    r = d.ctl("verify")
    assert r.rc == 1, r
    assert r.out.strip() == "drift: sysctl:net.core.somaxconn: current 77, policy wants 1024"
    r = d.ctl("--json", "verify")
    assert r.rc == 1 and [(c["key"], c["current"], c["desired"]) for c in r.json()["drift"]] == [
        ("sysctl:net.core.somaxconn", "77", "1024")]
    d.cleanup()

    fast = start(daemons, tmp_path / "fast", POLICY, ns, verify_interval=0.3)
    wait_for(lambda: ns_sysctl(ns, "net.core.somaxconn") == "1024", 10, "somaxconn 1024",
             detail=fast.log)
    ns_set_sysctl(ns, "net.core.somaxconn", "78")
    wait_for(lambda: ns_sysctl(ns, "net.core.somaxconn") == "1024", 10,
             "the periodic verify to correct somaxconn", detail=fast.log)
    assert "drift: sysctl:net.core.somaxconn is 78, policy wants 1024; re-applying" in fast.log()
    assert fast.ctl("verify").rc == 0


def test_apply_once_setting_is_not_drift_corrected(tmp_path: Path, ns: str,
                                                   daemons: list[NsDaemonProc]) -> None:
    policy = POLICY.replace(
        'name = "netns-test"',
        'name = "netns-test"\napply_once = ["sysctl:net.core.*", "nic:veth1:txqueuelen"]')
    sh("ip", "-n", ns, "link", "set", "veth1", "txqueuelen", "4321")  # in sync when first seen
    d = start(daemons, tmp_path / "d", policy, ns, verify_interval=0.3)
    wait_for(lambda: ns_sysctl(ns, "net.core.somaxconn") == "1024", 10, "somaxconn 1024",
             detail=d.log)
    ns_set_sysctl(ns, "net.core.somaxconn", "99")  # the operator takes it over
    sh("ip", "-n", ns, "link", "set", "veth1", "txqueuelen", "50")
    # a triple the kernel accepts (min <= default <= max: Linux 6.18 refuses others with
    # EINVAL, and sh() raises), unlike the policy's, so the periodic verify has drift to fix
    ns_set_sysctl(ns, "net.ipv4.tcp_rmem", "4096 65536 4194304")
    wait_for(lambda: ns_sysctl(ns, "net.ipv4.tcp_rmem") == "4096 87380 268435456", 10,
             "the periodic verify to correct tcp_rmem", detail=d.log)
    time.sleep(0.7)
    assert ns_sysctl(ns, "net.core.somaxconn") == "99"
    assert ns_link(ns, "veth1")["txqlen"] == 50
    assert ns_link(ns, "veth0")["txqlen"] == 4321  # not apply_once: enforced
    r = d.ctl("verify")
    assert r.rc == 0 and "sysctl:net.core.somaxconn: apply_once, already applied" in r.out, r
    assert "nic:veth1:txqueuelen: apply_once, already applied" in r.out, r


def test_refused_settings_are_reported_and_the_others_applied(
        tmp_path: Path, ns: str, daemons: list[NsDaemonProc]) -> None:
    # a macvlan cannot take an MTU above its lower device's (9000 here): EINVAL
    sh("ip", "-n", ns, "link", "add", "link", "veth0", "name", "mv0", "type", "macvlan")
    policy = """
[policy]
name = "partly-bad"
[sysctl]
"net.ipv4.tcp_no_such_knob" = 1
"net.core.somaxconn" = 1024
[[nic]]
match = "veth*"
mtu = 9000
[[nic]]
match = "mv*"
mtu = 9500
txqueuelen = 777
"""
    d = start(daemons, tmp_path / "d", policy, ns)
    wait_for(lambda: ns_mtu(ns, "veth1") == 9000, 10, "veth1 MTU 9000", detail=d.log)
    assert ns_sysctl(ns, "net.core.somaxconn") == "1024"
    assert ns_link(ns, "mv0")["txqlen"] == 777  # the other setting of the same NIC applied
    assert ns_mtu(ns, "mv0") == 1500
    r = d.ctl("apply")
    assert r.rc == 1, r
    assert ("error: nic:mv0:mtu = '9500': EINVAL Invalid argument "
            "(/sys/class/net/mv0/mtu) [errno 22]") in r.out, r
    assert "error: sysctl:net.ipv4.tcp_no_such_knob = '1': ENOENT" in r.out
    errs = {e["key"]: e for e in d.ctl("--json", "apply").json()["errors"]}
    assert (errs["nic:mv0:mtu"]["errno"], errs["nic:mv0:mtu"]["value"]) == (22, "9500")
    assert errs["sysctl:net.ipv4.tcp_no_such_knob"]["errno"] == 2
    st = d.ctl("status")
    assert "nic:mv0:mtu = '9500': EINVAL" in st.out
    assert d.ctl("verify").rc == 1
    # nothing was changed for the refused ones, so there is nothing to restore for them
    r = d.ctl("--json", "revert")
    assert sorted(x["key"] for x in r.json()["restored"]) == [
        "nic:mv0:txqueuelen", "nic:veth0:mtu", "nic:veth1:mtu", "sysctl:net.core.somaxconn"]
    assert (ns_mtu(ns, "veth0"), ns_link(ns, "mv0")["txqlen"]) == (1500, 1000)


def test_unprivileged_user_may_plan_but_not_apply_or_revert(
        tmp_path: Path, ns: str, daemons: list[NsDaemonProc],
        unpriv_user: tuple[int, int]) -> None:
    d = start(daemons, tmp_path / "d", POLICY, ns)
    uid, gid = unpriv_user

    def ctl(*args: str) -> int:
        from tunerd.cli.main import main

        return main(["--socket", str(d.socket), *args])

    assert run_as(uid, gid, ctl, "plan") == 0
    assert run_as(uid, gid, ctl, "verify") == 0
    assert run_as(uid, gid, ctl, "apply") == 4
    assert run_as(uid, gid, ctl, "revert") == 4
    assert ns_mtu(ns, "veth0") == 9000  # the refused revert changed nothing


def test_the_netns_checks_pass_on_a_host_tuned_by_the_h100_policy(tmp_path: Path) -> None:
    """The guard: the host carries 00-h100-training.toml's tcp_rmem/tcp_wmem (restored in
    the finally, whatever happens), and the checks above run in namespaces made then
    (which copy those values from the host)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    sysctl = tomllib.loads((REPO / "policies/00-h100-training.toml").read_text())["sysctl"]
    wanted = {n: " ".join(str(sysctl[n]).split())
              for n in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")}
    paths = {n: Path("/proc/sys", n.replace(".", "/")) for n in wanted}
    saved = {n: p.read_text() for n, p in paths.items()}
    try:
        for n, p in paths.items():
            p.write_text(wanted[n] + "\n")
        checks = (apply_plan_verify_revert, kill9_mid_apply_then_revert,
                  reload_reverts_a_removed_setting)
        for i, check in enumerate(checks):
            with fresh_ns() as name:
                assert {n: ns_sysctl(name, n) for n in wanted} == wanted  # copied
                made: list[NsDaemonProc] = []
                try:
                    check(tmp_path / str(i), name, made)
                finally:
                    for d in made:
                        d.cleanup()
    finally:
        for n, p in paths.items():
            p.write_text(saved[n])
    assert {n: p.read_text() for n, p in paths.items()} == saved
