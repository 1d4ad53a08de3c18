"""Reading policy files and sets of them: parse, validate, extends, match, merge.

A *set* is the files of one policy directory (or the files given together to
``tunerctl policy check``). Problems that concern several files of a set
(duplicate names, unknown or cyclic ``extends``) are found for the whole set,
whatever node it is loaded on, so ``policy check`` catches them offline.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tunerd.base.errors import Failed
from tunerd.base.modes import Mode
from tunerd.base.safefs import file_kind, read_trusted
from tunerd.policy.match import mismatch
from tunerd.policy.merge import merge_content
from tunerd.policy.model import NodeFacts, Policy, PolicyError
from tunerd.policy.provenance import Provenance, key_lines, render_key
from tunerd.policy.schema import INVALID, Problem, describe, key_path
from tunerd.policy.sections import FILE_SCHEMA, SECTION_DEFAULTS
from tunerd.policy.typed import DEFAULT_ALLOC_TTL, DEFAULT_MAX_PER_USER, build_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "BUNDLED_DIR",
    "FileReport",
    "NotRegularFile",
    "PolicyFile",
    "check_set",
    "load_set",
    "policy_files_in",
    "read_policy_bytes",
    "read_policy_file",
    "resolve",
]

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "bundled_policies"
MAX_FILE_BYTES = 1 << 20  # a policy is a few KiB; refuse to parse something huge
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_AT_LINE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_AT_END = re.compile(r"\s*\(at end of document\)$")


@dataclass
class PolicyFile:
    """One valid policy file: its identity, when it applies, and its content."""

    path: Path
    name: str
    extends: list[str]
    match: dict[str, Any] | None
    content: dict[str, Any]  # validated sections present in the file, plus "apply_once"
    lines: dict[tuple[Any, ...], int] = field(default_factory=dict)  # key path -> line


@dataclass
class FileReport:
    """What reading one file gave: the parsed file, or the problems (both for the set)."""

    path: Path
    name: str | None
    errors: list[str] = field(default_factory=list)
    parsed: PolicyFile | None = None
    extends: list[str] = field(default_factory=list)

    def add(self, problem: Problem) -> None:
        self.errors.append(f"{self.path}: {problem}")


class NotRegularFile(Exception):
    """A policy path that is a FIFO, device, socket or directory (or a symlink to one)."""


def read_policy_bytes(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, which must be a regular file (or a symlink to one).

    Anything else is refused before it is opened for reading: opening a FIFO blocks
    until a writer comes (it froze the daemon's loop on SIGHUP), and opening a
    device can have side effects. The path is opened with O_PATH, which neither
    reads nor blocks, its type checked on that descriptor, and only then the same
    inode is opened for reading through /proc/self/fd, so a rename between the
    check and the read cannot slip another file in. Raises NotRegularFile (the
    message names the file and its type) or OSError.
    """
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode)
            if os.path.islink(path):
                kind = f"a symlink to {kind}"
            raise NotRegularFile(f"not a regular file ({kind}); a policy must be a regular "
                                 "file or a symlink to one")
        try:
            rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            if os.path.isdir("/proc/self/fd"):
                raise
            rfd = _open_checked(path)  # no /proc (a bare chroot): check the opened file
    finally:
        os.close(fd)
    chunks: list[bytes] = []
    size = 0
    try:
        while size < limit:
            chunk = os.read(rfd, min(limit - size, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(rfd)
    return b"".join(chunks)


def _open_checked(path: Path) -> int:
    # O_NONBLOCK: a FIFO swapped in after the O_PATH check opens without waiting
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(f"not a regular file ({file_kind(mode)})")
    return fd


def policy_files_in(directory: Path) -> list[Path]:
    """``*.toml`` in name order. Hidden files (editor locks like ``.#x.toml``) are skipped."""
    try:
        entries = list(directory.iterdir())
    except OSError as err:
        raise PolicyError(f"{directory}: cannot read policy directory: {err.strerror}",
                          file=str(directory)) from err
    return sorted(p for p in entries if p.name.endswith(".toml") and not p.name.startswith("."))


def _syntax_problem(text: str, err: tomllib.TOMLDecodeError) -> Problem:
    msg = str(err)
    m = _AT_LINE.search(msg)
    if m:
        line, col = int(m.group(1)), int(m.group(2))
        lines = text.splitlines()
        near = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        where = f"line {line}, column {col}"
        tail = f" near {describe(near)}" if near else ""
        return Problem(where, f"TOML syntax error: {msg[:m.start()]}{tail}")
    m = _AT_END.search(msg)
    if m:
        line = text.count("\n") + 1
        return Problem(f"line {line} (end of file)", f"TOML syntax error: {msg[:m.start()]}")
    return Problem("", f"TOML syntax error: {msg}")


def read_policy_file(path: Path, text: str | None = None,
                     trusted: Collection[int] | None = None) -> FileReport:
    """Parse and validate one file on its own (set-level checks come later).

    ``trusted`` (the daemon's): the file, the dirs above it and a symlink's target
    must be owned by those uids and writable by no one else (safefs.read_trusted);
    ``tunerctl policy check`` of a user's own draft passes None."""
    report = FileReport(path=path, name=None)
    if text is None and trusted is not None:
        try:
            raw = read_trusted(path, "policy file", MAX_FILE_BYTES, trusted)
        except Failed as err:
            report.errors.append(err.message)
            return report
        except FileNotFoundError:
            report.add(Problem("", "cannot read: No such file or directory"))
            return report
        text = _utf8(report, raw)
        if text is None:
            return report
    if text is None:
        try:
            raw = read_policy_bytes(path, MAX_FILE_BYTES + 1)
        except NotRegularFile as err:
            report.add(Problem("", str(err)))
            return report
        except OSError as err:
            report.add(Problem("", f"cannot read: {err.strerror or err}"))
            return report
        if len(raw) > MAX_FILE_BYTES:
            report.add(Problem("", f"larger than {MAX_FILE_BYTES} bytes; not a policy file"))
            return report
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw[: err.start].count(b"\n") + 1
            report.add(Problem(f"line {line}", f"not UTF-8 text (byte {err.start})"))
            return report
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        report.add(_syntax_problem(text, err))
        return report
    except RecursionError:
        report.add(Problem("", "TOML syntax error: arrays or tables nested too deeply"))
        return report

    # best-effort identity even for a bad file, so other files of the set that
    # extend it get "that file is bad" instead of a second, misleading error
    meta = doc.get("policy") if isinstance(doc.get("policy"), dict) else {}
    given = meta.get("name")
    report.name = given if isinstance(given, str) and given else path.stem
    ext = meta.get("extends")
    if isinstance(ext, str):
        report.extends = [ext]
    elif isinstance(ext, list):
        report.extends = [e for e in ext if isinstance(e, str)]

    problems: list[Problem] = []
    valid = FILE_SCHEMA.check(doc, "", problems)
    if valid is not INVALID:
        _check_file(valid, path, problems)
    if problems:
        for p in problems:
            report.add(p)
        return report
    policy = valid.pop("policy", {})
    content = dict(valid)
    if policy.get("apply_once"):
        content["apply_once"] = policy["apply_once"]
    report.parsed = PolicyFile(path=path, name=report.name, extends=policy.get("extends", []),
                               match=policy.get("match"), content=content,
                               lines=key_lines(text))
    return report


def _check_file(doc: dict[str, Any], path: Path, problems: list[Problem]) -> None:
    """Rules across keys of one file, after every value passed its own check."""
    policy = doc.get("policy", {})
    if "name" not in policy and not _NAME_RE.fullmatch(path.stem):
        problems.append(Problem("policy.name", f"missing, and the file name {describe(path.stem)}"
                                               " is not a valid policy name"))
    match = policy.get("match", {})
    if "min_gpus" in match and "max_gpus" in match and match["min_gpus"] > match["max_gpus"]:
        problems.append(Problem("policy.match.max_gpus",
                                f"max_gpus = {match['max_gpus']} is below "
                                f"min_gpus = {match['min_gpus']}: no node can match"))
    for i, job in enumerate(doc.get("job", [])):
        where = key_path("job", i)
        if "match" in job and not any(job["match"].values()):
            problems.append(Problem(key_path(where, "match"),
                                    "needs cmdline, env or user: an empty match would bind "
                                    "every process"))
        torch = job.get("torch", {})
        if torch.get("num_workers") == 0:
            # torch.utils.data.DataLoader raises ValueError for these without workers
            clash = [k for k in ("persistent_workers", "prefetch_factor")
                     if k in torch and torch[k] is not False]
            for key in clash:
                problems.append(Problem(key_path(key_path(where, "torch"), key),
                                        f"{key} = {describe(torch[key])} needs worker "
                                        "processes, but num_workers = 0 (DataLoader "
                                        "refuses it)"))


@lru_cache(maxsize=1)
def _bundled_library() -> dict[str, FileReport]:
    """Bundled policies by name: ``extends`` falls back to them (e.g. ``base``)."""
    try:
        paths = policy_files_in(BUNDLED_DIR)
    except PolicyError:
        return {}
    out: dict[str, FileReport] = {}
    for p in paths:
        r = read_policy_file(p)
        if r.name:
            out.setdefault(r.name, r)
    return out


def check_set(reports: list[FileReport]) -> None:
    """Add set-level problems to the reports: duplicate names, bad ``extends``."""
    by_name: dict[str, FileReport] = {}
    for r in reports:
        if r.name is None:
            continue
        other = by_name.get(r.name)
        if other is not None:
            r.add(Problem("policy.name", f"{describe(r.name)} is already the name of "
                                         f"{other.path}"))
        else:
            by_name[r.name] = r

    def lookup(name: str) -> FileReport | None:
        return by_name.get(name) or _bundled_library().get(name)

    for r in reports:
        for i, name in enumerate(r.extends):
            target = lookup(name)
            where = key_path(key_path("policy", "extends"), i)
            if target is None:
                known = ", ".join(sorted(set(by_name) | set(_bundled_library()))) or "none"
                r.add(Problem(where, f"no policy named {describe(name)} (known: {known})"))
            elif target.parsed is None and target.path not in {x.path for x in reports}:
                r.add(Problem(where, f"bundled policy {describe(name)} is invalid: "
                                     f"{target.errors[0] if target.errors else '?'}"))
        cycle = _find_cycle(r, lookup)
        if cycle:
            r.add(Problem("policy.extends", "extends cycle: " + " -> ".join(cycle)))

    defined_jobs = {j["name"] for r in [*reports, *_bundled_library().values()] if r.parsed
                    for j in r.parsed.content.get("job", []) if "match" in j}
    for r in reports:
        if r.parsed is None:
            continue
        for i, job in enumerate(r.parsed.content.get("job", [])):
            if "match" not in job and job["name"] not in defined_jobs:
                r.add(Problem(key_path(key_path("job", i), "match"),
                              f"missing: no policy defines a rule named "
                              f"{describe(job['name'])} for this entry to override"))


def _find_cycle(start: FileReport, lookup: Any) -> list[str] | None:
    """The extends chain that leads from ``start`` back to itself, or None."""
    stack = [(n, [start.name, n]) for n in start.extends]
    seen: set[str] = set()
    while stack:
        name, chain = stack.pop()
        if name == start.name:
            return [str(c) for c in chain]
        if name in seen:
            continue
        seen.add(name)
        node = lookup(name)
        if node is not None:
            stack.extend((n, [*chain, n]) for n in node.extends)
    return None


def resolve(files: list[PolicyFile], facts: NodeFacts) -> Policy:
    """Merge the files that apply to ``facts`` (a set that passed ``check_set``).

    Files are merged in name order; a file's ``extends`` are merged just before it,
    regardless of their own ``[policy.match]`` (extending is an explicit request).
    Each policy is merged once, where it is first needed, so a base that also
    applies on its own never overrides a file that extends it.
    """
    by_name = {f.name: f for f in files}
    merged: dict[str, Any] = {}
    sources: list[str] = []
    names: list[str] = []
    notes: list[dict[str, str]] = []
    provenance = Provenance()

    def lookup(name: str) -> PolicyFile:
        f = by_name.get(name)
        if f is None:
            lib = _bundled_library().get(name)
            if lib is None or lib.parsed is None:  # check_set reports this first
                raise PolicyError(f"no valid policy named {name!r}")
            f = lib.parsed
        return f

    def include(f: PolicyFile, chain: tuple[str, ...]) -> None:
        nonlocal merged
        if f.name in names:
            return
        if f.name in chain:  # check_set reports this first
            raise PolicyError(f"{f.path}: policy.extends: extends cycle: "
                              + " -> ".join((*chain, f.name)))
        for parent in f.extends:
            include(lookup(parent), (*chain, f.name))
        content = f.content
        known_jobs = {j["name"] for j in merged.get("job", [])}
        orphans = [j for j in content.get("job", []) if "match" not in j
                   and j["name"] not in known_jobs]
        if orphans:
            content = dict(content, job=[j for j in content["job"] if j not in orphans])
            for j in orphans:
                notes.append({"file": str(f.path), "reason": f"job {j['name']!r} overrides a "
                              "rule that no policy applied on this node defines; ignored"})
        merged = merge_content(merged, content)
        provenance.add(str(f.path), f.name, content, f.lines)
        sources.append(str(f.path))
        names.append(f.name)

    for f in files:
        if mismatch(f.match, facts) is None:
            include(f, ())
    not_applied = [f for f in files if f.name not in names]
    skipped = [{"file": str(f.path), "reason": mismatch(f.match, facts) or "not applied"}
               for f in not_applied]
    warnings = bundled_override_warnings(provenance)
    if files and not names:
        warnings.append(no_match_warning(not_applied, facts))
    warnings += reach_warnings(merged.get("job", []))
    data = normalize(merged, names)
    return Policy(data=data, sources=sources, model=build_model(data, sources),
                  skipped=skipped + notes, warnings=warnings,
                  provenance=provenance.to_dict())


def is_bundled(name: str) -> bool:
    """A policy that ships with tunerd (``base``, ``default``, ...), wherever it is installed."""
    return name in _bundled_library()


def bundled_override_warnings(provenance: Provenance) -> list[str]:
    """A bundled policy that overrides, with another value, what a site file of the same
    directory set: the site file sorts before it (``10-site.toml`` before ``base.toml``)
    and loses silently. Bundled policies install as ``00-*.toml`` so that site files win."""
    out = []
    for key, old, new in provenance.overrides:
        if (old.value == new.value or not is_bundled(new.policy) or is_bundled(old.policy)
                or Path(old.file).parent != Path(new.file).parent):
            continue
        out.append(f"{new.where()}: bundled policy {new.policy!r} overrides "
                   f"{render_key(key)} = {json.dumps(old.value)} of {old.where()} with "
                   f"{json.dumps(new.value)}: {Path(new.file).name} sorts after "
                   f"{Path(old.file).name}. Install the bundled policies under names that "
                   f"sort first (00-{new.policy}.toml, as in policies/) so that site files win")
    return out


def _inline(match: dict[str, Any]) -> str:
    """A ``[policy.match]`` table on one line, as TOML: ``gpu_model = ["*H100*"], min_gpus = 8``."""
    return ", ".join(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in match.items())


def reach_warnings(jobs: list[dict[str, Any]]) -> list[str]:
    """Rules that move or reserve beyond the matched process act only for the users they
    name (tunerd.jobs.gate): one naming none acts for root's processes only."""
    return [f"job {j['name']!r} is exclusive (exclusive, placement = \"exclusive\" or "
            "exclusive_scope) and names no match.user: it acts only for root's processes; "
            "name the users it is for (match.user = [...])"
            for j in jobs
            if (j.get("exclusive") or j.get("placement") == Mode.EXCLUSIVE
                or j.get("exclusive_scope")) and not (j.get("match") or {}).get("user")]


def no_match_warning(files: list[PolicyFile], facts: NodeFacts) -> str:
    """Why a set that has files gives this node the empty policy: a node that silently
    runs no policy (an H100-only directory on an L40S node) must be noticed."""
    why = "; ".join(f"{f.path}: [policy.match] {_inline(f.match or {})} "
                    f"({mismatch(f.match, facts) or 'not applied'})" for f in files)
    return (f"no policy file matches this node ({facts.describe()}): running with an empty "
            f"policy (no host setting, no [[job]] rule, no default fd limit). Not applied: "
            f"{why}")


def normalize(merged: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``Policy.data``: every section present, defaults filled in, policy identity first."""
    data: dict[str, Any] = {
        "policy": {"name": names[-1] if names else "", "names": list(names),
                   "apply_once": list(merged.get("apply_once", []))},
    }
    for section, empty in SECTION_DEFAULTS.items():
        data[section] = copy.deepcopy(merged.get(section, empty))
    for job in data["job"]:
        job.setdefault("placement", "gpu-local")
        job["match"] = {"cmdline": [], "env": {}, "user": [], **job.get("match", {})}
    # the lease limits are always in force: show their values even when no file sets them
    data["leases"] = {"user_exclusive": False, "max_per_user": DEFAULT_MAX_PER_USER,
                      "alloc_ttl": DEFAULT_ALLOC_TTL, **data["leases"]}
    return data


def _utf8(report: FileReport, raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        report.add(Problem(f"line {line}", f"not UTF-8 text (byte {err.start})"))
        return None


def load_set(paths: list[Path], trusted: Collection[int] | None = None) -> list[FileReport]:
    reports = [read_policy_file(p, trusted=trusted) for p in paths]
    check_set(reports)
    return reports


def raise_for(reports: list[FileReport]) -> None:
    errors = [e for r in reports for e in r.errors]
    if not errors:
        return
    first = next(r for r in reports if r.errors)
    more = (f" (and {len(errors) - 1} more problem(s); `tunerctl policy check` lists them)"
            if len(errors) > 1 else "")
    raise PolicyError(errors[0] + more, file=str(first.path), errors=errors)
