"""contrib/prometheus: the alerting rules pass `promtool test rules`, and every tunerd
metric they use is really exported, and really moves, by a running daemon."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProc, wait_for, write_policy
from tests.leases_helpers import DGX_H100, kill, rule_policy, spawn, unique_sleeper

RULES_DIR = REPO / "contrib" / "prometheus"
RULES = RULES_DIR / "tunerd-alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool not installed (apt-get install prometheus)")
ALERTS = {"TunerdDown", "TunerdPolicyRejected", "TunerdDriftNotCorrected",
          "TunerdHostSettingWriteFailing", "TunerdRuleBindFailures", "TunerdGpuThrottled",
          "TunerdGpuXidErrors", "TunerdJobFdLimitNearlyExhausted",
          "TunerdFdLimitNearlyExhausted"}


def _promtool(*args: str) -> str:
    assert PROMTOOL is not None
    p = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=RULES_DIR,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@needs_promtool
def test_rules_are_valid_and_pass_their_promtool_unit_tests() -> None:
    assert "SUCCESS: 9 rules found" in _promtool("check", "rules", RULES.name)
    assert "SUCCESS" in _promtool("test", "rules", "tunerd-alerts.test.yml")
    # every alert has a unit test that expects it to fire
    tests = (RULES_DIR / "tunerd-alerts.test.yml").read_text()
    defined = set(re.findall(r"^\s+- alert: (\w+)", RULES.read_text(), re.M))
    assert defined == ALERTS
    for name in ALERTS:
        assert re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests), name


def _metric_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^(tunerd_\w+?)(?:\{| )", text, re.M)}


def _used_by_rules() -> set[str]:
    return set(re.findall(r"\btunerd_\w+", RULES.read_text()))


def _replay_gpu_exposition(tmp_path: Path) -> str:
    """The Monitor in-process on recorded NVML data: the GPU series a GPU node exports."""
    from tests.monitor_helpers import TelemetryReplay
    from tests.test_monitor_service import make_monitor
    from tunerd.adapters import nvml

    with nvml.use_backend(TelemetryReplay()):
        mon = make_monitor(tmp_path)

        async def go() -> None:
            await mon.start()
            await mon.cycle()
            await mon.stop()

        asyncio.run(go())
    return mon.exposition()


@pytest.mark.root
def test_every_metric_the_rules_use_is_exported(daemon_factory: Any, tmp_path: Path) -> None:
    d: DaemonProc = daemon_factory().start()
    p = spawn(["sleep", "30"])
    try:
        r = d.ctl("bind", str(p.pid), "--cpus", "0")
        assert r.rc == 0, r.err
        # a bound job's fd series appear once the monitor has sampled it
        names = wait_for(lambda: (n := _metric_names(d.ctl("metrics").out))
                         >= {"tunerd_job_open_fds", "tunerd_job_max_fds"} and n, 15,
                         "the job's fd series")
        assert names, d.ctl("metrics").out
    finally:
        kill(p)
    names |= _metric_names(_replay_gpu_exposition(tmp_path))
    # counters are exported as NAME_total; the rules use that name
    missing = {n for n in _used_by_rules() if n not in names}
    assert not missing, f"rules use metrics tunerd does not export: {sorted(missing)}"


@pytest.mark.root
def test_health_metrics_follow_the_daemon(daemon_factory: Any, tmp_path: Path) -> None:
    exe = unique_sleeper(tmp_path, f"alert_fail_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "too-big"\nmatch.cmdline = '
                      f'["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\ngpus = 9\n')
    d: DaemonProc = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()

    def metric(name: str) -> float | None:
        m = re.search(rf"^{name} (\S+)$", d.ctl("metrics").out, re.M)
        return None if m is None else float(m.group(1))

    assert metric("tunerd_policy_rejected") == 0.0
    assert metric("tunerd_host_enforcing") == 1.0
    assert metric("tunerd_host_settings_failed") == 0.0
    assert metric("tunerd_host_settings_drifted") == 0.0
    assert metric("tunerd_rule_bind_failures_total") == 0.0
    p = spawn([str(exe), "30"], {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""})
    try:
        wait_for(lambda: metric("tunerd_rule_bind_failures_total") == 1.0, 10,
                 "tunerd_rule_bind_failures_total 1")
        assert metric("tunerd_rule_matches_total") == 1.0
    finally:
        kill(p)
    write_policy(pol, "00-test.toml", "[policy\n")  # a syntax error: the reload is refused
    d.signal(signal.SIGHUP)
    wait_for(lambda: metric("tunerd_policy_rejected") == 1.0, 10, "tunerd_policy_rejected 1")
    write_policy(pol, "00-test.toml", '[policy]\nname = "fixed"\n')
    d.signal(signal.SIGHUP)
    wait_for(lambda: metric("tunerd_policy_rejected") == 0.0, 10, "tunerd_policy_rejected 0")


@needs_promtool
@pytest.mark.root
def test_a_real_prometheus_fires_tunerd_down_for_a_stopped_node(daemon_factory: Any,
                                                               tmp_path: Path) -> None:
    """The scrape config the README shows, the rules file as shipped, a real Prometheus."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    import json
    import urllib.request

    from tests.monitor_helpers import free_port

    d: DaemonProc = daemon_factory(args=["--metrics-listen", "127.0.0.1:0"]).start()
    port = d.ctl("--json", "status").json()["services"]["monitor"]["metrics_port"]
    dead = free_port()  # a second "node" whose tunerd is not running
    rules = tmp_path / "tunerd-alerts.yml"
    # same rules, with `for:` shortened so the test does not wait 5 minutes
    rules.write_text(RULES.read_text().replace("for: 5m", "for: 2s"))
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: [{rules}]\n"
        "scrape_configs:\n  - job_name: tunerd\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port}', '127.0.0.1:{dead}']\n")
    web = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - owned by the process
    prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=log, stderr=subprocess.STDOUT)

    def firing() -> set[str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/alerts",
                                        timeout=5) as r:
                alerts = json.load(r)["data"]["alerts"]
        except OSError:
            return set()
        return {f"{a['labels']['alertname']}@{a['labels']['instance']}" for a in alerts
                if a["state"] == "firing"}

    try:
        got = wait_for(lambda: f"TunerdDown@127.0.0.1:{dead}" in (f := firing()) and f, 60,
                       "TunerdDown firing for the stopped node", interval=0.5,
                       detail=lambda: (tmp_path / "prometheus.log").read_text()[-3000:])
        assert f"TunerdDown@127.0.0.1:{port}" not in got  # the running node is not down
    finally:
        prom.terminate()
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()
