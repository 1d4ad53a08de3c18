"""The Kubernetes deploy files: kustomize base, Helm chart, image build file.

Rendered for real with ``kubectl kustomize`` (a small renderer where kubectl is
missing, tests/k8s_render.py); the chart with a small template renderer (helm cannot
be installed here). Validated with kubernetes-validate --strict (its library: the CLI
would load the schemas once per file) for 1.30-1.33, yamllint,
a small schema for the Prometheus operator's ServiceMonitor/PodMonitor, and checks
of each point the DaemonSet must have.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s_render import CHART_DIR, KUSTOMIZE_DIR, ROOT, helm_template, kustomize
from tunerd.daemon.config import DaemonConfig

K8S_VERSIONS = ("1.30", "1.31", "1.32", "1.33")
BIN = Path(sys.executable).parent

# The part of the Prometheus operator's CRDs (monitoring.coreos.com/v1) these files use
_ENDPOINT = {
    "type": "object", "additionalProperties": False, "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": {"type": "string", "pattern": "^(0|([0-9]+(ms|s|m|h))+)$"},
        "scrapeTimeout": {"type": "string", "pattern": "^(0|([0-9]+(ms|s|m|h))+)$"},
        "relabelings": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"sourceLabels": {"type": "array", "items": {"type": "string"}},
                           "targetLabel": {"type": "string"},
                           "action": {"type": "string"}, "regex": {"type": "string"},
                           "replacement": {"type": "string"}}}},
    },
}
_SELECTOR = {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
             "properties": {"matchLabels": {"type": "object",
                                            "additionalProperties": {"type": "string"}}}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False,
                "properties": {"matchNames": {"type": "array", "items": {"type": "string"}},
                               "any": {"type": "boolean"}}}


def _monitor_schema(kind: str, endpoints: str) -> dict[str, Any]:
    return {
        "type": "object", "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name"]},
            "spec": {"type": "object", "additionalProperties": False,
                     "required": ["selector", endpoints],
                     "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                                    endpoints: {"type": "array", "minItems": 1,
                                                "items": _ENDPOINT}}},
        },
    }


MONITOR_SCHEMAS = {"ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
                   "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints")}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    docs, how = kustomize()
    if how != "kubectl":
        print("kubectl not installed: kustomize base rendered by tests/k8s_render.py")
    return docs


@pytest.fixture(scope="module")
def chart() -> list[dict[str, Any]]:
    return helm_template()


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def validate(docs: list[dict[str, Any]]) -> None:
    """kubernetes-validate --strict (in process: one schema load per version) of the
    core objects, for every supported version; raises on the first error."""
    core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com")]
    for v in K8S_VERSIONS:
        for d in core:
            kubernetes_validate.validate(d, v, strict=True)


def test_kustomize_base_validates_strict_for_1_30_to_1_33(
        rendered: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == ["ConfigMap", "ConfigMap", "DaemonSet", "Namespace", "PodMonitor",
                     "Service", "ServiceAccount", "ServiceMonitor"]
    validate(rendered)
    # strict: a misspelt field fails (the check can fail)
    bad = copy.deepcopy(by_kind(rendered, "DaemonSet")[0])
    bad["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    for kind, schema in MONITOR_SCHEMAS.items():
        (mon,) = by_kind(rendered, kind)
        jsonschema.validate(mon, schema)


def test_monitor_schema_rejects_a_wrong_monitor(rendered: list[dict[str, Any]]) -> None:
    (mon,) = by_kind(rendered, "ServiceMonitor")
    bad = copy.deepcopy(mon)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, MONITOR_SCHEMAS["ServiceMonitor"])
    bad = copy.deepcopy(mon)
    bad["spec"]["endpoint"] = bad["spec"].pop("endpoints")  # a typo the CRD would drop
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, MONITOR_SCHEMAS["ServiceMonitor"])


def test_yaml_files_pass_yamllint_strict() -> None:
    p = subprocess.run([str(BIN / "yamllint"), "--strict", "-c",
                        str(ROOT / "deploy" / ".yamllint"), str(KUSTOMIZE_DIR),
                        str(CHART_DIR / "values.yaml"), str(CHART_DIR / "Chart.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def unit_capabilities() -> set[str]:
    text = (ROOT / "systemd" / "tunerd.service").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("CapabilityBoundingSet=")]
    return {c.removeprefix("CAP_") for c in line.split("=", 1)[1].split()}


def check_daemonset(docs: list[dict[str, Any]]) -> None:
    """Every point the DaemonSet must have (issue 17, Deliver 1)."""
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    sc = ctr["securityContext"]
    # GPU nodes only, and it tolerates the GPU taint
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists"
               for t in pod["tolerations"])
    assert pod["hostPID"] is True
    # the capabilities the systemd unit keeps, and no more; not privileged
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == unit_capabilities()
    # mounts: run and state dirs, /sys, /proc, pod-resources (ro), policies (dir, ro)
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    host = {m["mountPath"]: vols[m["name"]].get("hostPath", {}).get("path")
            for m in ctr["volumeMounts"]}
    assert host["/run/tunerd"] == "/run/tunerd"
    # the node lock: the host's own file (pod and host exclude each other), in root-only /run
    assert host["/run/tunerd.lock"] == "/run/tunerd.lock" == str(DaemonConfig().node_lock)
    assert host["/var/lib/tunerd"] == "/var/lib/tunerd"
    assert host["/host/sys"] == "/sys" and host["/host/proc"] == "/proc"
    assert host["/var/lib/kubelet/pod-resources"] == "/var/lib/kubelet/pod-resources"
    assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    pol = mounts["/etc/tunerd/policies"]
    assert vols[pol["name"]]["configMap"]["name"] == "tunerd-policies"
    assert pol["readOnly"] is True
    assert all("subPath" not in m and "subPathExpr" not in m for m in ctr["volumeMounts"])
    assert pod["priorityClassName"] == "system-node-critical"
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    # probes on the health endpoint of the metrics port
    for probe in ("livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert any(p["name"] == "metrics" for p in ctr["ports"])
    # Burstable: requests set and below the limits
    res = ctr["resources"]
    assert res["requests"] != res["limits"]
    assert _cpu(res["requests"]["cpu"]) < _cpu(res["limits"]["cpu"])
    # the config tunerd is started with names the mounted host roots
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "tunerd-config"]
    assert 'proc_root = "/host/proc"' in cm["data"]["tunerd.toml"]
    # the read-only root filesystem: every path tunerd writes is a mount
    writable = {m["mountPath"] for m in ctr["volumeMounts"] if not m.get("readOnly")}
    assert sc["readOnlyRootFilesystem"] is True
    assert {"/run/tunerd", "/var/lib/tunerd", "/var/lib/tunerd-etc", "/tmp"} <= writable
    assert 'etc_root = "/var/lib/tunerd-etc"' in cm["data"]["tunerd.toml"]
    assert "--config=/etc/tunerd/config/tunerd.toml" in ctr["args"]


def _cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_daemonset_has_every_required_point(rendered: list[dict[str, Any]]) -> None:
    check_daemonset(rendered)
    (svc,) = by_kind(rendered, "Service")
    (ds,) = by_kind(rendered, "DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_policy_configmap_passes_policy_check(rendered: list[dict[str, Any]],
                                              tmp_path: Path) -> None:
    (cm,) = [d for d in rendered if d["metadata"]["name"] == "tunerd-policies"]
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
    p = subprocess.run([str(BIN / "tunerctl"), "policy", "check", *map(str,
                        sorted(tmp_path.glob("*.toml")))], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def _schema() -> dict[str, Any]:
    return dict(json.loads((CHART_DIR / "values.schema.json").read_text()))


def test_chart_renders_the_same_daemonset_and_validates(rendered: list[dict[str, Any]],
                                                        chart: list[dict[str, Any]]) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.validate(values, _schema())
    validate(chart)
    check_daemonset(chart)
    for kind, schema in MONITOR_SCHEMAS.items():
        (mon,) = by_kind(chart, kind)
        jsonschema.validate(mon, schema)
    # the defaults give what the kustomize base gives
    (a,) = by_kind(rendered, "DaemonSet")
    (b,) = by_kind(chart, "DaemonSet")
    assert a["spec"] == b["spec"]
    pa = next(d for d in rendered if d["metadata"]["name"] == "tunerd-policies")["data"]
    pb = next(d for d in chart if d["metadata"]["name"] == "tunerd-policies")["data"]
    assert pa == pb
    # a values change reaches the objects; switched-off monitors are not rendered
    values["metrics"].update(port=9500, serviceMonitor=False, podMonitor=False)
    other = helm_template(values, namespace="gpu-ops")
    assert not by_kind(other, "ServiceMonitor") and not by_kind(other, "PodMonitor")
    (ds,) = by_kind(other, "DaemonSet")
    ctr = ds["spec"]["template"]["spec"]["containers"][0]
    assert ctr["ports"][0]["containerPort"] == 9500
    assert "--metrics-listen=$(HOST_IP):9500" in ctr["args"]
    assert ds["metadata"]["namespace"] == "gpu-ops"


@pytest.mark.parametrize("change", [
    {"metrics": {"port": 0}},
    {"tolerations": []},
    {"policies": {"../escape.toml": "x"}},
    {"resources": {"requests": {"cpu": "1"}}},
    {"privileged": True},
])
def test_chart_schema_rejects_bad_values(change: dict[str, Any]) -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for k, v in change.items():
        values[k] = v
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, _schema())


def test_containerfile_installs_the_project_and_runs_the_daemon() -> None:
    text = (ROOT / "deploy" / "container" / "Containerfile").read_text()
    assert re.search(r"^FROM \S+ AS build$", text, re.M)
    assert "tunerd[kubernetes]" in text
    assert re.search(r'^ENTRYPOINT \["tunerd"\]$', text, re.M)
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for name in src.split():
            assert (ROOT / name).exists(), f"Containerfile copies {name}, which is missing"


def test_the_daemonset_config_is_a_valid_tunerd_config(rendered: list[dict[str, Any]],
                                                       chart: list[dict[str, Any]],
                                                       tmp_path: Path) -> None:
    from tunerd.daemon.config import load_config

    for docs in (rendered, chart):
        (cm,) = [d for d in docs if d["metadata"]["name"] == "tunerd-config"]
        f = tmp_path / "tunerd.toml"
        f.write_text(cm["data"]["tunerd.toml"])
        cfg = load_config(f, {})
        assert str(cfg.pod_resources_socket) == "/var/lib/kubelet/pod-resources/kubelet.sock"
        assert (str(cfg.proc_root), str(cfg.sys_root)) == ("/host/proc", "/host/sys")
