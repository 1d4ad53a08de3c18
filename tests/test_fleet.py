"""The fleet as one: 4 real daemons in their own network namespaces, one real Prometheus.

One module-scoped fleet (namespaces, daemons and Prometheus start once) serves every
test here: `tunerctl fleet check` finds exactly the injected differences, none in the
consistent part of the fleet (whose NCCL interfaces have different names with the same
MTU and subnet), the straggler of a two-node job, and every dashboard query returns data.

    n0  fab0    MTU 9000  driver 550  NCCL_IB_HCA=mlx5     group ok
    n1  ens1f0  MTU 9000  driver 550  NCCL_IB_HCA=mlx5     group ok (GPU 0 at PCIe x8)
    n2  fab0    MTU 1500  driver 535  NCCL_IB_HCA=mlx5     (MTU, driver: injected)
    n3  ens1f0  MTU 9000  driver 550  NCCL_IB_HCA=mlx5_0   (NCCL setting -> policy hash)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_helpers import NVML_535, NVML_550, Fleet, fleet_policy, start_fleet
from tests.helpers import REPO, wait_for
from tests.leases_helpers import kill, spawn

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

SPECS = [
    # n0 probes the test venv's (CPU) torch; the others a Python without torch (quick)
    {"nic": "fab0", "mtu": 9000, "ib_hca": "mlx5", "nvml": NVML_550, "group": "ok",
     "python": sys.executable},
    {"nic": "ens1f0", "mtu": 9000, "ib_hca": "mlx5", "nvml": NVML_550, "group": "ok",
     "pcie_x8": True},
    {"nic": "fab0", "mtu": 1500, "ib_hca": "mlx5", "nvml": NVML_535, "group": "odd"},
    {"nic": "ens1f0", "mtu": 9000, "ib_hca": "mlx5_0", "nvml": NVML_550, "group": "odd"},
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apt-get install prometheus)")
    f = start_fleet(SPECS, f"tunerd-f{os.getpid()}")
    try:
        yield f
    finally:
        f.stop()


def findings(f: Fleet, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    r = f.tunerctl("--json", "fleet", "check", "--prometheus", "http://127.0.0.1:9090", *args)
    assert r.rc in (0, 1), r
    return r.rc, json.loads(r.out)["findings"], r.out


def test_node_facts_are_exported(fleet: Fleet) -> None:
    info = {s["metric"]["instance"]: s["metric"] for s in fleet.series("tunerd_node_info")}
    n0, n2 = fleet.nodes[0].instance, fleet.nodes[2].instance
    assert info[n0]["class"] == "fleet-test/NVIDIA H100 80GB HBM3"
    assert (info[n0]["driver"], info[n0]["cuda"]) == ("550.54.15", "12.4")
    assert (info[n2]["driver"], info[n2]["cuda"]) == ("535.161.08", "12.2")
    assert info[n0]["torch"].startswith("2.")  # probed in `python -I`, never imported
    assert info[n2].get("torch", "") == ""  # no torch for /usr/bin/python3
    assert info[n0]["kernel"] == os.uname().release
    mtu = {(s["metric"]["instance"], s["metric"]["nic"]): (s["value"][1], s["metric"]["subnet"])
           for s in fleet.series('tunerd_nic_mtu{nccl="1"}')}
    assert mtu[(fleet.nodes[1].instance, "ens1f0")] == ("9000", "10.77.0.0/24")
    assert mtu[(n2, "fab0")] == ("1500", "10.77.0.0/24")
    nccl = {(s["metric"]["instance"], s["metric"]["key"]): s["metric"]["value"]
            for s in fleet.series("tunerd_nccl_setting_info")}
    assert nccl[(fleet.nodes[3].instance, "NCCL_IB_HCA")] == "mlx5_0"
    assert nccl[(n0, "NCCL_SOCKET_IFNAME")] == "fab,ens"


def test_fleet_check_names_exactly_the_injected_differences(fleet: Fleet) -> None:
    rc, found, out = findings(fleet, "--window", "10s")
    got = {(f["instance"], f["key"], f["value"], f["majority"]) for f in found
           if f["key"] != "straggler"}
    n2, n3 = fleet.nodes[2].instance, fleet.nodes[3].instance
    hashes = {s["metric"]["instance"]: s["metric"]["hash"]
              for s in fleet.series("tunerd_policy_info")}
    assert got == {(n2, "nccl_mtu", "1500", "9000"),
                   (n2, "driver_version", "535.161.08", "550.54.15"),
                   (n2, "cuda_version", "12.2", "12.4"),
                   (n3, "nccl:NCCL_IB_HCA", "mlx5_0", "mlx5"),
                   (n3, "policy_hash", hashes[n3], hashes[fleet.nodes[0].instance])}, out
    assert rc == 1
    human = fleet.tunerctl("fleet", "check", "--prometheus", "http://127.0.0.1:9090")
    assert human.rc == 1
    assert (f"{n2}: nccl_mtu = 1500 (class fleet-test/NVIDIA H100 80GB HBM3: majority 9000, "
            "3 of 4 nodes)") in human.out, human.out


def _alerts(fleet: Fleet, name: str) -> set[tuple[str, ...]]:
    """Pending or firing alerts of the shipped rules (their `for:` is minutes: pending)."""
    return {(a["metric"]["instance"], a["metric"].get("key") or a["metric"]["exported_job"],
             a["metric"].get("value", "")) for a in fleet.series(f'ALERTS{{alertname="{name}"}}')}


def test_the_shipped_rules_alert_on_the_same_nodes(fleet: Fleet) -> None:
    n2, n3 = fleet.nodes[2].instance, fleet.nodes[3].instance
    hashes = {s["metric"]["instance"]: s["metric"]["hash"]
              for s in fleet.series("tunerd_policy_info")}
    want = {(n2, "nccl_mtu", "1500"), (n2, "driver_version", "535.161.08"),
            (n2, "cuda_version", "12.2"), (n3, "nccl:NCCL_IB_HCA", "mlx5_0"),
            (n3, "policy_hash", hashes[n3])}
    wait_for(lambda: _alerts(fleet, "TunerdNodeDiffersFromItsClass") == want, 20,
             "the rules' alerts for exactly the injected differences", interval=0.5,
             detail=lambda: repr(_alerts(fleet, "TunerdNodeDiffersFromItsClass")))


def test_a_consistent_fleet_passes_though_nic_names_differ(fleet: Fleet) -> None:
    # n0 (fab0) and n1 (ens1f0): same MTU, subnet, settings, versions, policy
    rc, found, out = findings(fleet, "--match", 'group="ok"')
    assert (rc, found) == (0, []), out
    ok = fleet.tunerctl("fleet", "check", "--prometheus", "http://127.0.0.1:9090",
                        "--match", 'group="ok"')
    assert (ok.rc, ok.out) == (0, "2 node(s) in 1 class(es): consistent\n"), ok
    # grouped by a target label instead: the odd pair is a 2-node tie, each node named
    _rc, found, out = findings(fleet, "--class-label", "group")
    assert {f["class"] for f in found} == {"odd"}, out
    assert {f["majority"] for f in found} == {None}, out
    none = fleet.tunerctl("fleet", "check", "--prometheus", "http://127.0.0.1:9090",
                          "--match", 'group="nope"')
    assert none.rc == 1 and "has no tunerd_node_info series matching" in none.err, none
    bad = fleet.tunerctl("fleet", "check", "--prometheus", "http://127.0.0.1:9090",
                         "--match", "group}")
    assert bad.rc == 2 and "--match: not a list of PromQL label matchers" in bad.err, bad


def test_unreachable_prometheus_exits_1_not_the_daemons_3(fleet: Fleet) -> None:
    r = fleet.tunerctl("fleet", "check", "--prometheus", "http://127.0.0.1:1")
    assert r.rc == 1 and "cannot reach Prometheus at http://127.0.0.1:1" in r.err, r


def _report(fleet: Fleet, node: int, pid: int, rank: int, step: float,
            job: str = "llm-7b") -> None:
    from tunerd.wire.client import Client

    c = Client(str(fleet.nodes[node].daemon.socket), timeout=10)
    c.call("report", pid=pid, steps=100, step_time_s=step, samples_per_s=64 / step,
           rank=rank, local_rank=rank % 2, local_world_size=2, job=job)


def test_the_slow_node_of_a_two_node_job_is_named(fleet: Fleet) -> None:
    procs = [spawn(["sleep", "120"]) for _ in range(4)]
    try:
        # job llm-7b: ranks 0,1 on n0 at 0.50 s, ranks 2,3 on n1 at 0.65 s (+30 %)
        for i, p in enumerate(procs):
            _report(fleet, 0 if i < 2 else 1, p.pid, i, 0.50 if i < 2 else 0.65)

        def straggler() -> list[dict[str, Any]]:
            _rc, found, _ = findings(fleet, "--window", "5s")
            return [f for f in found if f["key"] == "straggler"]

        got = wait_for(straggler, 30, "the straggler finding", interval=1.0)
        wait_for(lambda: _alerts(fleet, "TunerdStraggler") == {
            (fleet.nodes[1].instance, "llm-7b", "")}, 20, "the TunerdStraggler alert",
            interval=0.5)
        assert [(f["instance"], f["job"]) for f in got] == [(fleet.nodes[1].instance, "llm-7b")]
        assert 1.1 < got[0]["ratio"] < 1.3
        # (the recorded GPU 1 is throttled, and this shared machine's PSI may be high too)
        assert {"rank 2,3 unbound", "GPU 0 PCIe link at x8 of x16",
                "GPU 1 throttled (sw_thermal)"} <= set(got[0]["causes"]), got
        # the rank series end with their processes
        for p in procs:
            kill(p)
        wait_for(lambda: not fleet.series("tunerd_rank_step_seconds"), 30,
                 "the rank series to end with the ranks", interval=1.0)
    finally:
        for p in procs:
            kill(p)


def test_promtool_checks_the_exposition(fleet: Fleet) -> None:
    r = fleet.in_monitor("python3", "-c", "import urllib.request,sys; sys.stdout.write("
                         f"urllib.request.urlopen('http://{fleet.nodes[0].instance}/metrics')"
                         ".read().decode())")
    assert r.rc == 0, r
    p = subprocess.run(["promtool", "check", "metrics"], input=r.out, capture_output=True,
                       text=True, timeout=60)
    # promtool lints names, units and help too: nothing to say about any series
    assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p.stdout + p.stderr
    assert "tunerd_node_info{" in r.out and "tunerd_nic_mtu{" in r.out


DASHBOARD = REPO / "deploy" / "grafana" / "tunerd.json"


def _dashboard_variables() -> dict[str, tuple[str, str]]:
    """Each query variable: (selector, label), as Grafana's label_values(selector, label)."""
    out = {}
    for v in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        # a constant (custom) variable would assume a scrape config: none may
        assert v["type"] in ("query", "datasource"), v
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
            assert m, v
            out[v["name"]] = (m.group(1), m.group(2))
    return out


def _dashboard_queries() -> dict[str, str]:
    """Every panel's query (and every query variable's selector), variables filled in
    as Grafana does with "All" selected."""
    dash = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"node", "class", "job"} <= names
    _dashboard_variables()
    out: dict[str, str] = {}
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out[f"{p['title']} ({t['refId']})"] = t["expr"]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
            assert m, v
            out[f"variable {v['name']}"] = m.group(1)
    return {k: e.replace("$class", ".*").replace("$node", ".*").replace("$job", ".*")
            .replace("$scrape_job", ".*") for k, e in out.items()}


def test_every_dashboard_query_parses_and_returns_data(fleet: Fleet, tmp_path: Path) -> None:
    queries = _dashboard_queries()
    assert len(queries) >= 20
    # promtool parses each: as recording rules of a rules file
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text("groups:\n  - name: dashboard\n    rules:\n" + "".join(
        f"      - record: dashboard:q{i}\n        expr: {json.dumps(e)}\n"
        for i, e in enumerate(queries.values())))
    p = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    # a two-node job whose ranks report, so that the per-job panels have data
    procs = [spawn(["sleep", "120"]) for _ in range(2)]
    try:
        for i, pr in enumerate(procs):
            _report(fleet, i, pr.pid, i, 0.5 + 0.2 * i, job="dash")

        def empty() -> list[str]:
            answers = fleet.query(*queries.values())
            bad = [k for k, a in zip(queries, answers, strict=True)
                   if a["status"] != "success" or not a["data"]["result"]]
            return bad

        wait_for(lambda: not empty(), 30, "every dashboard query to return data",
                 interval=1.0, detail=lambda: repr(empty()))
        # ... and every variable resolves under this default scrape config (honor_labels
        # false: the rank's own `job` label is stored as exported_job): the label it
        # takes its values from is on the series, with the values the fleet has
        variables = _dashboard_variables()
        answers = fleet.query(*(sel.replace("$class", ".*") for sel, _ in variables.values()))
        got = {name: {a["metric"].get(label) for a in ans["data"]["result"]} - {None}
               for (name, (_, label)), ans in zip(variables.items(), answers, strict=True)}
        assert "dash" in got["job"], got
        assert got["scrape_job"] == {"tunerd"}, got
        assert {n.instance for n in fleet.nodes} <= got["node"], got
        assert all(got.values()), got
    finally:
        for pr in procs:
            kill(pr)


def test_a_single_process_job_reporting_steps_is_in_the_job_variable_and_panels(
        fleet: Fleet) -> None:
    """A plain `python train.py` bound on a node and reporting steps through StepReporter
    (no launcher: no job id, no rank) is a job of the dashboard too: the `job`
    variable lists it under the default scrape config, and with it selected the job
    panels have its series."""
    from tunerd.wire.client import Client

    node = fleet.nodes[2]
    p = spawn(["sleep", "120"])
    try:
        r = node.daemon.ctl("bind", str(p.pid), "--cpus", "0")
        assert r.rc == 0, r
        Client(str(node.daemon.socket), timeout=10).call(
            "report", pid=p.pid, steps=10, step_time_s=0.25, samples_per_s=128.0)
        selector, label = _dashboard_variables()["job"]

        def listed() -> set[str]:
            [ans] = fleet.query(selector)
            return {a["metric"].get(label) for a in ans["data"]["result"]
                    if a["metric"].get("instance") == node.instance} - {None}

        [name] = wait_for(listed, 30, "the single-process job in the job variable",
                          interval=1.0)
        dash = json.loads(DASHBOARD.read_text())
        panels = {t["expr"].replace("$job", re.escape(name)): p["title"]
                  for p in dash["panels"] for t in p.get("targets", [])
                  if "$job" in t["expr"] and "tunerd_rank_bound" not in t["expr"]}
        assert len(panels) >= 3, panels

        def empty() -> list[str]:
            return [title for (expr, title), a in zip(panels.items(),
                                                     fleet.query(*panels), strict=True)
                    if a["status"] != "success" or not a["data"]["result"]]

        wait_for(lambda: not empty(), 30, f"the job panels to show job {name!r}",
                 interval=1.0, detail=lambda: repr(empty()))
    finally:
        kill(p)


def test_a_fixed_node_drops_out_after_its_reload(fleet: Fleet) -> None:
    """Last (it changes the fleet): n3 gets the fleet's policy; SIGHUP; it agrees again."""
    import signal

    from tests.helpers import write_policy

    n3 = fleet.nodes[3]
    write_policy(n3.daemon.policy_dir, "50-host.toml", fleet_policy("mlx5"))
    n3.daemon.signal(signal.SIGHUP)

    def n3_keys() -> set[str]:
        return {f["key"] for f in findings(fleet)[1] if f["instance"] == n3.instance}

    wait_for(lambda: not n3_keys(), 30, "n3's findings to go after its reload", interval=1.0,
             detail=lambda: repr(n3_keys()))
    # (straggler findings of the earlier tests' jobs stay in the 5 m window: not counted)
    assert {f["instance"] for f in findings(fleet)[1]
            if f["key"] != "straggler"} == {fleet.nodes[2].instance}
