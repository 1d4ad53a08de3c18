"""tunerctl policy check|show|schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Group

DEFAULT_POLICY_DIR = Path("/etc/tunerd/policies")


@click.group(cls=Group)
def policy() -> None:
    """Validate policy files, or show the policy in force."""


def _human_check(report: dict[str, Any]) -> str:
    lines: list[str] = []
    for f in report["files"]:
        if f["errors"]:
            first, *rest = f["errors"]
            lines.append(f"FAIL {first}")
            lines.extend(f"     {e}" for e in rest)
        else:
            note = ""
            if "applies" in f:
                note = ", applies to this node" if f["applies"] else ", not for this node"
                if f.get("reason"):
                    note += f": {f['reason']}"
            lines.append(f"ok   {f['file']} (policy {f['name']!r}{note})")
    lines.extend(f"WARN {w}" for w in report.get("warnings") or [])
    return "\n".join(lines)


@policy.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--topology", "snapshot", type=click.Path(path_type=Path, dir_okay=False),
              help="Match as the node of this snapshot (tunerctl topology --save).")
@click.option("--hostname", help="Match as this hostname (default: this host's).")
@click.option("--gpu-model", "gpu_model", help="Match as a node with this GPU model.")
@click.option("--gpus", type=click.IntRange(0, 1024),
              help="Number of GPUs of --gpu-model (default 1).")
@click.option("--explain", is_flag=True,
              help="Also list, for every key of the effective policy, the file:line that "
                   "set it and the files it overrode (as `policy show --explain`).")
def check(paths: tuple[Path, ...], snapshot: Path | None, hostname: str | None,
          gpu_model: str | None, gpus: int | None, explain: bool) -> int:
    """Validate policy files offline (no daemon needed). Exit 1 on any error.

    PATHs are files or directories (default /etc/tunerd/policies); each directory is
    checked as the daemon would load it. For a single set without errors, the
    policy this node would get is computed too (see --json "effective"); GPUs are
    not probed: the node has none unless --topology or --gpu-model says otherwise.
    A set of which no file matches the node is a warning (WARN, exit 0): checking
    files meant for other nodes is legitimate.
    """
    from tunerd.policy import NodeFacts, check_paths

    ctx = get_ctx()
    targets = list(paths) or [DEFAULT_POLICY_DIR]
    facts = NodeFacts()
    if snapshot is not None:
        from tunerd.topology import read_snapshot

        facts = NodeFacts.from_topology(read_snapshot(snapshot))
    if hostname is not None:
        facts = NodeFacts(hostname=hostname, gpu_models=facts.gpu_models)
    if gpu_model is not None or gpus:
        count = gpus if gpus is not None else 1
        facts = NodeFacts(hostname=facts.hostname,
                          gpu_models=(gpu_model or "unknown GPU",) * count)
    report = check_paths(targets, facts)

    def human(r: dict[str, Any]) -> str:
        text = _human_check(r)
        if explain and r.get("provenance") is not None:
            text += "\n\n" + _human_explain({"provenance": r["provenance"]})
        return text

    ctx.emit(report, human)
    return 1 if any(f["errors"] for f in report["files"]) else 0


def _drop_empty(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v not in ({}, [], None, "")}


def _on_disk_lines(r: dict[str, Any]) -> list[str]:
    """The note that the files on disk are not what is in force (a rejected edit)."""
    d = r.get("on_disk")
    if not d:
        return []
    lines = ["# NOTE: the policy files on disk differ from the policy in force shown here:"]
    lines += [f"#   changed since it was loaded: {f}" for f in d.get("changed") or []]
    lines += [f"#   not in force: {f}" for f in d.get("new") or []]
    if d.get("rejected"):
        lines.append(f"#   the last reload was rejected: {d['rejected']}")
    return lines


def _human_show(r: dict[str, Any]) -> str:
    from tunerd.policy.render import render_toml

    lines = [*_on_disk_lines(r), "# policy files applied, in merge order:"]
    lines += [f"#   {s}" for s in r.get("sources") or []] or ["#   (none)"]
    if r.get("skipped"):
        lines.append("# not applied:")
        lines += [f"#   {s['file']}: {s['reason']}" for s in r["skipped"]]
    lines += [f"# WARNING: {w}" for w in r.get("warnings") or []]
    data = {k: v for k, v in r.items()
            if k not in ("sources", "skipped", "warnings", "on_disk")}
    body = {k: (_drop_empty(v) if isinstance(v, dict) else v) for k, v in data.items()}
    body = _drop_empty(body)
    return "\n".join(lines) + "\n\n" + render_toml(body).rstrip("\n")


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:59] + "\u2026"


def _human_explain(r: dict[str, Any]) -> str:
    lines = [*_on_disk_lines(r),
             "# every key a policy file sets: the file:line that set it (last wins), and the"
             " earlier files it overrode", "# (keys not listed have their defaults)"]
    lines += [f"# WARNING: {w}" for w in r.get("warnings") or []]
    for key, o in (r.get("provenance") or {}).items():
        lines.append(f"{key} = {_short(o['value'])}")
        where = f"{o['file']}:{o['line']}" if o.get("line") else o["file"]
        lines.append(f"    set by    {where} (policy {o['policy']!r})")
        for old in o.get("overrode") or []:
            at = f"{old['file']}:{old['line']}" if old.get("line") else old["file"]
            same = " (same value)" if old["value"] == o["value"] else ""
            lines.append(f"    overrode  {at} = {_short(old['value'])}{same}")
    if not r.get("provenance"):
        lines.append("(no policy file sets any key)")
    return "\n".join(lines)


@policy.command()
@click.option("--explain", is_flag=True,
              help="For every key: the file and line that set it, and the files it overrode.")
def show(explain: bool) -> None:
    """The effective merged policy for this node (from the daemon)."""
    ctx = get_ctx()
    if explain:
        ctx.emit(ctx.call("policy.show", explain=True), _human_explain)
    else:
        ctx.emit(ctx.call("policy.show"), _human_show)


@policy.command()
def schema() -> None:
    """Print the JSON Schema of a policy file (for editors and CI)."""
    from tunerd.policy import json_schema

    click.echo(json.dumps(json_schema(), indent=2))
