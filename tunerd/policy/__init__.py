"""Policy files: TOML -> validated model; match, extends, merge; JSON Schema export.

Public interface (used by the daemon and ``tunerctl policy``):

- ``NodeFacts``: what ``[policy.match]`` tables are tested against.
- ``load_policy_dir(directory, facts) -> Policy``; raises ``PolicyError`` naming the
  file, key path and value when any file of the directory is bad.
- ``Policy.model`` (the typed policy: ``tunerd.policy.typed.PolicyModel``, what
  services and tuners read), ``Policy.data`` / ``Policy.to_dict()`` (plain data, for
  ``policy show``), ``Policy.sources``, ``Policy.warnings``, ``Policy.describe()``.
- ``check_paths(paths)``: offline validation report for ``tunerctl policy check``.
- ``json_schema()``: JSON Schema of a policy file.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from tunerd.base.errors import Failed
from tunerd.base.safefs import check_dir
from tunerd.policy.loader import BUNDLED_DIR, load_set, policy_files_in, raise_for, resolve
from tunerd.policy.model import NodeFacts, Policy, PolicyError
from tunerd.policy.sections import json_schema

__all__ = [
    "NodeFacts",
    "Policy",
    "PolicyError",
    "bundled_default",
    "check_paths",
    "json_schema",
    "load_policy_dir",
]


def bundled_default() -> Path:
    """The daemon's fallback when the policy directory has no ``*.toml``."""
    return BUNDLED_DIR / "00-default.toml"


def load_policy_dir(directory: Path | None, facts: NodeFacts,
                    trusted: Collection[int] | None = None) -> Policy:
    """The merged policy for ``facts`` from every ``*.toml`` in ``directory``.

    A missing or empty directory means the bundled default. Any bad file makes the
    whole load fail (PolicyError), so that nothing of a half-valid set is applied.
    ``trusted`` (the daemon's: root, or its own uid): the directory, the dirs above it,
    each file and a symlink's target must be owned by one of those uids and writable
    by no one else, as sshd and sudo check theirs (tunerd.base.safefs); one that is not is
    a PolicyError naming the path and why.
    """
    paths: list[Path] = []
    if directory is not None and directory.is_dir():
        if trusted is not None:
            try:
                check_dir(directory, "policy directory", trusted)
            except Failed as err:
                raise PolicyError(err.message, file=str(directory)) from None
        paths = policy_files_in(directory)
    if not paths:
        paths = [bundled_default()]
    reports = load_set(paths, trusted if paths[0] != bundled_default() else None)
    raise_for(reports)
    return resolve([r.parsed for r in reports if r.parsed is not None], facts)


def check_paths(paths: list[Path], facts: NodeFacts | None = None) -> dict[str, Any]:
    """Validate files and directories offline.

    Each directory is one set (as the daemon would load it); the files named
    directly form one more set. For every set without errors, each file says
    whether it ``applies`` to ``facts`` (default: this host, no GPUs known) and,
    if not, the ``reason``; ``warnings`` holds what the daemon would warn about
    (no file matching this node). ``effective`` is the merged policy, when there
    is exactly one set and no error; otherwise None; ``provenance`` then says where each
    of its keys came from (as ``policy show --explain``).
    """
    facts = facts if facts is not None else NodeFacts()
    sets: list[list[Path]] = []
    loose: list[Path] = []
    rows: list[dict[str, Any]] = []
    for p in paths:
        if p.is_dir():
            try:
                files = policy_files_in(p)
            except PolicyError as err:
                rows.append({"file": str(p), "name": None, "errors": [err.message]})
                continue
            if files:
                sets.append(files)
            else:
                rows.append({"file": str(p), "name": None,
                             "errors": [f"{p}: no *.toml policy files in this directory"]})
        else:
            loose.append(p)
    if loose:
        sets.append(loose)
    effective: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None
    warnings: list[str] = []
    for files in sets:
        reports = load_set(files)
        policy = None
        if not any(r.errors for r in reports):
            policy = resolve([r.parsed for r in reports if r.parsed is not None], facts)
            warnings += policy.warnings
            if len(sets) == 1 and not rows:
                effective = policy.to_dict()
                provenance = policy.provenance
        else:  # the others still say whether they apply: resolved without the failed ones
            try:
                policy = resolve([r.parsed for r in reports
                                  if r.parsed is not None and not r.errors], facts)
            except PolicyError:  # one of them needs a failed one (extends)
                policy = None
        why = {s["file"]: s["reason"] for s in policy.skipped} if policy is not None else {}
        for r in reports:
            row: dict[str, Any] = {"file": str(r.path), "name": r.name, "errors": r.errors}
            if policy is not None and not r.errors:
                row["applies"] = str(r.path) in policy.sources
                if not row["applies"] and str(r.path) in why:
                    row["reason"] = why[str(r.path)]
            rows.append(row)
    return {"files": rows, "effective": effective, "provenance": provenance,
            "warnings": warnings}
