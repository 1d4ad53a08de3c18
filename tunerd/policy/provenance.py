"""Where each effective policy value came from: the file and line that set it, and
the earlier files it overrode (``tunerctl policy show --explain``).

tomllib keeps no positions, and the TOML libraries that round-trip (tomlkit) keep
whitespace and comments but no line numbers either, so the line of a key is found
by a light scan of the file's text: table headers (``[a.b]``, ``[[job]]``) and
``key =`` lines, dotted and quoted keys included, multi-line strings skipped. A
value whose key the scan cannot place (an inline table's inner key) gets the line
of the closest enclosing key it did place.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tunerd.policy.sections import ARRAY_KEYS

__all__ = ["Origin", "Provenance", "key_lines", "render_key"]

_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(rf"^\s*({_DOTTED})\s*=")
_PARTS = re.compile(_PART)

Path_ = tuple[Any, ...]


def _split(dotted: str) -> list[str]:
    out = []
    for p in _PARTS.findall(dotted):
        if p[:1] in "\"'":
            p = p[1:-1].encode().decode("unicode_escape") if p[0] == '"' else p[1:-1]
        out.append(p)
    return out


def key_lines(text: str) -> dict[Path_, int]:
    """Line (1-based) of every table header and key of a TOML text, by key path.

    ``[[job]]`` entries are numbered in file order: ``("job", 0, "match", "cmdline")``.
    """
    lines: dict[Path_, int] = {}
    arrays: dict[Path_, int] = {}  # array-of-tables path -> index of its current entry
    table: Path_ = ()
    in_string: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if in_string is not None:
            if line.count(in_string) % 2:
                in_string = None
            continue
        header = _HEADER.match(line)
        if header:
            parts = _split(header.group(2))
            path: list[Any] = []
            for i, part in enumerate(parts):
                path.append(part)
                if tuple(path) in arrays and i < len(parts) - 1:
                    path.append(arrays[tuple(path)])
            key = tuple(path)
            if header.group(1) == "[[":
                arrays[key] = arrays.get(key, -1) + 1
                key = (*key, arrays[key])
            table = key
            lines.setdefault(key, n)
            continue
        m = _KEY.match(line)
        if m:
            lines.setdefault((*table, *_split(m.group(1))), n)
            rest = line[m.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2:
                    in_string = quote
    return lines


def render_key(path: Path_) -> str:
    """``limits.nofile``, ``sysctl."net.core.rmem_max"``, ``job["torch-training"].nofile``."""
    out = ""
    for i, part in enumerate(path):
        if i and path[i - 1] in ARRAY_KEYS and i == 1:
            out += f'["{part}"]'
            continue
        text = str(part)
        if not re.fullmatch(r"[A-Za-z0-9_-]+", text):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        out += ("." if out else "") + text
    return out


def _leaves(value: Any, merged: Path_, infile: Path_) -> Iterator[tuple[Path_, Path_, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*merged, k), (*infile, k))
    else:
        yield merged, infile, value


def content_leaves(content: dict[str, Any]) -> Iterator[tuple[Path_, Path_, Any]]:
    """(path in the merged policy, path in the file, value) of every value a file sets.

    ``[[job]]``/``[[nic]]``/``[[block]]`` entries are identified by their merge key
    in the merged policy (``job["torch-training"]``) and by their index in the file.
    """
    for section, value in content.items():
        if section == "apply_once":
            continue  # accumulates over files: nothing is overridden
        if section in ARRAY_KEYS:
            key = ARRAY_KEYS[section]
            for i, entry in enumerate(value):
                for k, v in entry.items():
                    if k != key:
                        yield from _leaves(v, (section, entry.get(key), k), (section, i, k))
        else:
            yield from _leaves(value, (section,), (section,))


@dataclass
class Origin:
    """Who set one effective value, and whom it overrode (earliest first)."""

    file: str
    line: int | None
    value: Any
    policy: str
    overrode: list[Origin] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.file, "line": self.line, "value": self.value,
                             "policy": self.policy}
        if self.overrode:
            d["overrode"] = [o.to_dict() for o in self.overrode]
        return d


class Provenance:
    """Fed each file as it is merged (in merge order); keeps the origin of every key."""

    def __init__(self) -> None:
        self.origins: dict[Path_, Origin] = {}
        # (key, the origin that was overridden, the origin that overrode it)
        self.overrides: list[tuple[Path_, Origin, Origin]] = []

    def add(self, file: str, policy: str, content: dict[str, Any],
            lines: dict[Path_, int]) -> None:
        for merged, infile, value in content_leaves(content):
            line = None
            for end in range(len(infile), 0, -1):
                line = lines.get(infile[:end])
                if line is not None:
                    break
            new = Origin(file=file, line=line, value=value, policy=policy)
            old = self.origins.get(merged)
            if old is not None:
                new.overrode = [*old.overrode, Origin(old.file, old.line, old.value, old.policy)]
                self.overrides.append((merged, old, new))
            self.origins[merged] = new

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {render_key(k): o.to_dict() for k, o in self.origins.items()}
