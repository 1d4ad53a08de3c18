"""Render the deploy files the way kubectl and helm would, for the deploy tests.

- ``kustomize()``: ``kubectl kustomize deploy/kubernetes`` where kubectl is installed
  (scripts/test.sh installs it); otherwise a small renderer that does what this base
  uses (resources, namespace, labels, configMapGenerator without name hash), and the
  test says which one ran.
- ``helm_template()``: helm cannot be installed here, so the chart's templates are
  rendered by a small renderer of the subset of Go templates they use:
  ``{{ .Values.a.b }}``, ``{{ .Release.Namespace }}``, ``{{- toYaml X | nindent N }}``
  and one level of ``{{- if X }} ... {{- end }}``. A template using anything else
  fails the render (an unknown action is an error, not passed through).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes"
CHART_DIR = ROOT / "deploy" / "helm" / "tunerd"


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomize() -> tuple[list[dict[str, Any]], str]:
    """The rendered objects and which renderer made them ("kubectl" or "fallback")."""
    exe = kubectl()
    if exe is not None:
        out = subprocess.run([exe, "kustomize", str(KUSTOMIZE_DIR)], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        return [d for d in yaml.safe_load_all(out) if d], "kubectl"
    return _kustomize_fallback(), "fallback"


def _kustomize_fallback() -> list[dict[str, Any]]:
    k = yaml.safe_load((KUSTOMIZE_DIR / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for res in k["resources"]:
        docs += [d for d in yaml.safe_load_all((KUSTOMIZE_DIR / res).read_text()) if d]
    assert k["generatorOptions"]["disableNameSuffixHash"] is True
    for gen in k["configMapGenerator"]:
        data = {Path(f).name: (KUSTOMIZE_DIR / f).read_text() for f in gen["files"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": gen["name"]}, "data": data})
    pairs: dict[str, str] = {}
    for lab in k.get("labels", []):
        pairs.update(lab["pairs"])
    for d in docs:
        md = d.setdefault("metadata", {})
        if d["kind"] != "Namespace":
            md["namespace"] = k["namespace"]
        md.setdefault("labels", {}).update(pairs)
    return docs


_ACTION = re.compile(r"(\s*)\{\{(-?)\s*(.*?)\s*(-?)\}\}")


def _lookup(ctx: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("."), f"unsupported template reference {ref!r}"
    v: Any = ctx
    for part in ref[1:].split("."):
        v = v[part]
    return v


def _render(text: str, ctx: dict[str, Any]) -> str:
    # one level of {{- if X }} ... {{- end }}
    def cond(m: re.Match[str]) -> str:
        return m.group(2) if _lookup(ctx, m.group(1)) else ""

    text = re.sub(r"\{\{-? if (\S+) \}\}(.*?)\{\{-? end \}\}", cond, text, flags=re.S)

    def action(m: re.Match[str]) -> str:
        space, trim_left, expr, _ = m.groups()
        lead = "" if trim_left else space
        mm = re.fullmatch(r"toYaml (\S+) \| nindent (\d+)", expr)
        if mm:
            dumped = yaml.safe_dump(_lookup(ctx, mm.group(1)), sort_keys=False,
                                    default_flow_style=False).rstrip("\n")
            pad = " " * int(mm.group(2))
            return lead + "\n" + "\n".join(pad + line if line else line
                                           for line in dumped.split("\n"))
        assert re.fullmatch(r"\.[A-Za-z0-9_.]+", expr), f"unsupported action {expr!r}"
        v = _lookup(ctx, expr)
        return lead + (str(v).lower() if isinstance(v, bool) else str(v))

    return _ACTION.sub(action, text)


def helm_template(values: dict[str, Any] | None = None,
                  namespace: str = "tunerd") -> list[dict[str, Any]]:
    """Objects the chart renders with ``values`` (default: its values.yaml)."""
    vals = values if values is not None else yaml.safe_load(
        (CHART_DIR / "values.yaml").read_text())
    ctx = {"Values": vals, "Release": {"Namespace": namespace, "Name": "tunerd"}}
    docs: list[dict[str, Any]] = []
    for t in sorted((CHART_DIR / "templates").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(_render(t.read_text(), ctx)) if d]
    return docs
