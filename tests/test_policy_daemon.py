"""Policies with the real daemon and the real CLI: start, SIGHUP reload, check, show."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tests.helpers import REPO, DaemonProc, run_ctl, wait_for, write_policy

GOOD = '[policy]\nname = "site"\n\n[limits]\nnofile = 65536\n'
BAD_MTU = '[policy]\nname = "site"\n\n[[nic]]\nmatch = "ens*"\nmtu = 100000\n'


def test_daemon_refuses_to_start_on_a_bad_policy(tmp_path: Path, daemon_factory) -> None:
    pdir = tmp_path / "pol"
    bad = write_policy(pdir, "10-site.toml", BAD_MTU)
    d: DaemonProc = daemon_factory(policy_dir=pdir)
    d.start(wait=False)
    assert d.proc is not None
    rc = d.proc.wait(timeout=30)
    assert rc != 0
    log = d.log()
    assert f"{bad}: nic[0].mtu" in log and "100000" in log, log
    assert not d.socket.exists()


def test_sighup_onto_a_bad_policy_keeps_the_old_one(tmp_path: Path, daemon_factory) -> None:
    pdir = tmp_path / "pol"
    site = write_policy(pdir, "10-site.toml", GOOD)
    d: DaemonProc = daemon_factory(policy_dir=pdir).start()

    show = d.ctl("--json", "policy", "show")
    assert show.rc == 0, show.err
    assert show.json()["limits"] == {"nofile": 65536}
    assert show.json()["sources"] == [str(site)]
    assert d.ctl("status").rc == 0

    site.write_text(BAD_MTU)
    d.signal(signal.SIGHUP)
    wait_for(lambda: d.ctl("--json", "status").json()["policy"]["error"] is not None, 20,
             "the reload to be rejected", detail=d.log)
    st = d.ctl("status")
    assert st.rc == 1  # a policy error is a problem `tunerctl status` reports
    assert f"{site}: nic[0].mtu" in st.out and "100000" in st.out, st.out
    assert "old policy kept" in st.out
    show = d.ctl("--json", "policy", "show")
    assert show.json()["limits"] == {"nofile": 65536}  # old policy still in force
    assert show.json()["nic"] == []
    assert "policy rejected" in d.log()
    # plan says its policy is the old one, and that the files were rejected: exit 1
    plan = d.ctl("plan")
    assert plan.rc == 1, plan
    assert "the policy files were rejected, this plan is of the last good policy" in plan.out
    assert f"{site}: nic[0].mtu" in plan.out, plan.out
    assert f"{site}: nic[0].mtu" in d.ctl("--json", "plan").json()["policy_error"]

    site.write_text(GOOD.replace("65536", "131072"))
    d.signal(signal.SIGHUP)
    wait_for(lambda: d.ctl("--json", "status").json()["policy"]["error"] is None, 20,
             "the fixed policy to load", detail=d.log)
    assert d.ctl("status").rc == 0
    plan = d.ctl("plan")
    assert plan.rc == 0 and "rejected" not in plan.out, plan
    show = d.ctl("policy", "show")
    assert show.rc == 0
    assert f"#   {site}" in show.out
    assert "[limits]\nnofile = 131072" in show.out, show.out
    assert d.ctl("--json", "policy", "show").json()["limits"] == {"nofile": 131072}


def test_policy_show_lists_files_not_applied(tmp_path: Path, daemon_factory) -> None:
    pdir = tmp_path / "pol"
    write_policy(pdir, "10-site.toml", GOOD)
    other = write_policy(pdir, "20-h100.toml", '[policy.match]\ngpu_model = "*H100*"\n'
                                               '[sysctl]\n"net.core.rmem_max" = 536870912\n')
    d: DaemonProc = daemon_factory(policy_dir=pdir).start()
    r = d.ctl("--json", "policy", "show")
    assert r.json()["skipped"][0]["file"] == str(other)
    assert r.json()["sysctl"] == {}
    human = d.ctl("policy", "show").out
    assert "# not applied:" in human and str(other) in human and "*H100*" in human


def test_policy_check_cli_exit_codes_and_json(tmp_path: Path) -> None:
    ok = run_ctl("policy", "check", str(REPO / "policies"))
    assert ok.rc == 0, ok.out + ok.err
    lines = ok.out.splitlines()
    assert len(lines) == 6 and all(ln.startswith("ok   ") for ln in lines)
    assert any("00-h100-training.toml" in ln for ln in lines)

    good = write_policy(tmp_path, "good.toml", GOOD)
    bad = write_policy(tmp_path, "bad.toml", BAD_MTU.replace('"site"', '"other"'))
    r = run_ctl("policy", "check", str(good), str(bad))
    assert r.rc == 1
    assert f"FAIL {bad}: nic[0].mtu: expected an integer in 68..65535, got 100000" in r.out
    assert f"ok   {good}" in r.out

    r = run_ctl("--json", "policy", "check", str(tmp_path))
    assert r.rc == 1
    rep = r.json()
    by_name = {Path(f["file"]).name: f for f in rep["files"]}
    assert by_name["good.toml"]["errors"] == [] and by_name["good.toml"]["name"] == "site"
    assert by_name["bad.toml"]["name"] == "other"
    assert "nic[0].mtu" in by_name["bad.toml"]["errors"][0]
    assert rep["effective"] is None

    r = run_ctl("--json", "policy", "check", str(good))
    assert r.rc == 0 and r.json()["effective"]["limits"] == {"nofile": 65536}

    syntax = write_policy(tmp_path / "s", "x.toml", "[limits\n")
    r = run_ctl("policy", "check", str(syntax))
    assert r.rc == 1 and f"FAIL {syntax}: line 1, column" in r.out

    missing = run_ctl("policy", "check", str(tmp_path / "nope"))
    assert missing.rc == 1 and "cannot read" in missing.out


def test_policy_check_as_another_node() -> None:
    r = run_ctl("policy", "check", str(REPO / "policies"), "--hostname", "dgx-h100-01",
                "--gpu-model", "NVIDIA H100 80GB HBM3", "--gpus", "8")
    assert r.rc == 0
    assert "h100-training', applies to this node" in r.out
    assert "pcie-gpu', not for this node" in r.out


def test_policy_schema_cli() -> None:
    r = run_ctl("policy", "schema")
    assert r.rc == 0
    schema = json.loads(r.out)
    assert "nic" in schema["properties"] and schema["type"] == "object"


def test_policy_check_as_a_recorded_node() -> None:
    r = run_ctl("--json", "policy", "check", str(REPO / "policies"), "--topology",
                str(REPO / "tests/fixtures/topologies/pcie-8gpu.json"))
    assert r.rc == 0, r.err
    assert r.json()["effective"]["policy"]["names"] == ["base", "default", "pcie-gpu"]
    bad = run_ctl("policy", "check", str(REPO / "policies"), "--topology", "/nonexistent.json")
    assert bad.rc == 2 and "/nonexistent.json" in bad.err


def test_daemon_replaying_a_dgx_h100_applies_the_h100_policy(daemon_factory) -> None:
    snap = REPO / "tests/fixtures/topologies/dgx-h100.json"
    d: DaemonProc = daemon_factory(policy_dir=REPO / "policies",
                                   args=["--topology", str(snap), "--dry-run"]).start()
    show = d.ctl("--json", "policy", "show").json()
    assert show["policy"]["names"] == ["base", "default", "h100-training"]
    assert show["sysctl"]["net.ipv4.tcp_congestion_control"] == "bbr"
    assert show["nic"] == [{"match": "en*np*", "mtu": 9000}]
    assert [Path(s["file"]).name for s in show["skipped"]] == [
        "00-grace-blackwell.toml", "00-hgx-training.toml", "00-pcie-gpu.toml"]


H100_ONLY = ('[policy]\nname = "h100"\n[policy.match]\ngpu_model = "*H100*"\nmin_gpus = 8\n'
             '[sysctl]\n"net.core.rmem_max" = 536870912\n')


def test_policy_check_warns_when_no_file_matches_this_node(tmp_path: Path) -> None:
    h100 = write_policy(tmp_path / "pol", "20-h100.toml", H100_ONLY)
    r = run_ctl("policy", "check", str(tmp_path / "pol"), "--hostname", "laptop")
    assert r.rc == 0, r  # checking an H100 file on a laptop is legitimate
    assert (f"ok   {h100} (policy 'h100', not for this node: no GPU model matches ['*H100*'] "
            "(node has no GPU))") in r.out, r.out
    warn = [ln for ln in r.out.splitlines() if ln.startswith("WARN ")]
    assert len(warn) == 1, r.out
    assert warn[0].startswith("WARN no policy file matches this node (hostname 'laptop', "
                              "no GPU): running with an empty policy"), warn
    assert f'{h100}: [policy.match] gpu_model = ["*H100*"], min_gpus = 8' in warn[0]
    rep = run_ctl("--json", "policy", "check", str(tmp_path / "pol"), "--hostname", "laptop")
    assert rep.rc == 0
    assert rep.json()["warnings"] == [warn[0][len("WARN "):]]
    assert rep.json()["effective"]["sysctl"] == {}
    # on a node it is meant for: no warning
    ok = run_ctl("--json", "policy", "check", str(tmp_path / "pol"), "--gpu-model",
                 "NVIDIA H100 80GB HBM3", "--gpus", "8")
    assert ok.rc == 0 and ok.json()["warnings"] == []
    assert ok.json()["files"][0]["applies"] is True


def test_policy_show_warns_when_no_file_matches(tmp_path: Path, daemon_factory) -> None:
    pdir = tmp_path / "pol"
    h100 = write_policy(pdir, "20-h100.toml", H100_ONLY)
    d: DaemonProc = daemon_factory(policy_dir=pdir).start()
    show = d.ctl("--json", "policy", "show").json()
    (w,) = show["warnings"]
    assert w.startswith("no policy file matches this node (hostname ") and str(h100) in w
    human = d.ctl("policy", "show").out
    assert f"# WARNING: {w}" in human, human
    assert "#   (none)" in human


# -- a FIFO named *.toml (issue 9: it froze the loop on SIGHUP and hung `policy check`) ----
def test_policy_check_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    pdir = tmp_path / "pol"
    good = write_policy(pdir, "00-good.toml", GOOD)
    fifo = pdir / "50-fifo.toml"
    os.mkfifo(fifo)
    # the old CLI blocked in open() forever: the timeout turns that into a failure
    r = run_ctl("policy", "check", str(pdir), timeout=30)
    assert r.rc == 1, r
    assert f"FAIL {fifo}: not a regular file (a FIFO); " in r.out, r.out
    assert f"ok   {good}" in r.out
    r = run_ctl("--json", "policy", "check", str(fifo), timeout=30)
    assert r.rc == 1 and "not a regular file (a FIFO)" in r.json()["files"][0]["errors"][0]


def test_sighup_onto_a_fifo_keeps_the_daemon_responsive(tmp_path: Path, daemon_factory) -> None:
    pdir = tmp_path / "pol"
    write_policy(pdir, "10-site.toml", GOOD)
    d: DaemonProc = daemon_factory(policy_dir=pdir).start()
    fifo = pdir / "50-fifo.toml"
    os.mkfifo(fifo)
    d.signal(signal.SIGHUP)
    wait_for(lambda: d.ctl("--json", "status", timeout=10).json()["policy"]["error"] is not None,
             20, "the reload to be rejected", detail=d.log)
    st = d.ctl("--json", "status", timeout=10).json()
    assert f"{fifo}: not a regular file (a FIFO)" in st["policy"]["error"]
    show = d.ctl("--json", "policy", "show", timeout=10)
    assert show.rc == 0 and show.json()["limits"] == {"nofile": 65536}  # old policy kept
    # the loop still serves (a blocked open() would time these out) and stops on SIGTERM
    t0 = time.monotonic()
    for _ in range(5):
        assert d.ctl("--json", "status", timeout=10).rc == 1  # 1: the policy error
    assert time.monotonic() - t0 < 30
    assert d.stop(timeout=15) == 0
