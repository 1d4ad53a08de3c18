"""A small declarative validator for parsed TOML, with JSON Schema export.

Each ``Spec`` checks one value, appends ``Problem``s (key path + message that
quotes the bad value) and returns the *normalized* value, or ``INVALID``.
The same objects describe themselves as JSON Schema, so the schema we export
can never drift from what the loader accepts. Kept dependency-free on purpose:
the daemon and ``tunerctl policy check`` import it on every start.
"""

from __future__ import annotations

import datetime
import json
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INVALID",
    "AnyOf",
    "Bool",
    "Enum",
    "Int",
    "Problem",
    "Spec",
    "Str",
    "StrList",
    "Table",
    "TableArray",
    "describe",
    "key_path",
    "toml_type",
]


class _Invalid:
    """Marker for "this value had a problem"; never ends up in a policy."""

    def __repr__(self) -> str:
        return "INVALID"


INVALID: Any = _Invalid()

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_repr = reprlib.Repr()
_repr.maxlevel = 2
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = 4
_repr.maxdict = 4


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def key_path(parent: str, key: str | int) -> str:
    """``nic[1].mtu`` / ``sysctl."net.core.rmem_max"`` (quoted like TOML when needed)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    part = key if _BARE_KEY.match(key) else json.dumps(key)
    return f"{parent}.{part}" if parent else part


def toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return "date-time"
    return type(value).__name__


def describe(value: Any) -> str:
    """The bad value, short and safe to print (bounded even for deep/huge values)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value if len(value) <= 80 else value[:77] + "..."
        return json.dumps(text)
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, (list, dict)):
        return f"{toml_type(value)} {_repr.repr(value)}"
    return str(value)[:80]


def _got(value: Any) -> str:
    """``got string "abc"`` / ``got array [1, 2]`` (containers name their type already)."""
    if isinstance(value, (list, dict)):
        return f"got {describe(value)}"
    return f"got {toml_type(value)} {describe(value)}"


class Spec:
    """One node of the schema."""

    description: str = ""

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        raise NotImplementedError

    def json_schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def accepts_type(self, value: Any) -> bool:
        """Whether ``value`` has a type this spec takes (used by AnyOf)."""
        return True

    def _doc(self, schema: dict[str, Any]) -> dict[str, Any]:
        if self.description:
            schema["description"] = self.description
        return schema


class Int(Spec):
    def __init__(self, lo: int | None = None, hi: int | None = None,
                 description: str = "") -> None:
        self.lo, self.hi, self.description = lo, hi, description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def _range(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"an integer in {self.lo}..{self.hi}"
        if self.lo is not None:
            return f"an integer >= {self.lo}"
        if self.hi is not None:
            return f"an integer <= {self.hi}"
        return "an integer"

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if not self.accepts_type(value):
            errs.append(Problem(path, f"expected {self._range()}, {_got(value)}"))
            return INVALID
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            errs.append(Problem(path, f"expected {self._range()}, got {describe(value)}"))
            return INVALID
        return value

    def json_schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "integer"}
        if self.lo is not None:
            s["minimum"] = self.lo
        if self.hi is not None:
            s["maximum"] = self.hi
        return self._doc(s)


class Bool(Spec):
    def __init__(self, description: str = "") -> None:
        self.description = description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, bool)

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if not isinstance(value, bool):
            errs.append(Problem(path, f"expected true or false, {_got(value)}"))
            return INVALID
        return value

    def json_schema(self) -> dict[str, Any]:
        return self._doc({"type": "boolean"})


class Str(Spec):
    """A string; optional regex (with a human description), custom check, normalizer.

    ``convert`` may raise ValueError with a message; it returns the normalized value
    (for example a cpulist rewritten the way the kernel prints it).
    """

    def __init__(self, pattern: str | None = None, what: str = "a string",
                 convert: Callable[[str], Any] | None = None, max_len: int = 4096,
                 allow_empty: bool = False, description: str = "") -> None:
        self.pattern = re.compile(pattern) if pattern else None
        self.what = what
        self.convert = convert
        self.max_len = max_len
        self.allow_empty = allow_empty
        self.description = description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, str)

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if not isinstance(value, str):
            errs.append(Problem(path, f"expected {self.what}, {_got(value)}"))
            return INVALID
        if not value and not self.allow_empty:
            errs.append(Problem(path, f"expected {self.what}, got an empty string"))
            return INVALID
        if len(value) > self.max_len:
            errs.append(Problem(path, f"longer than {self.max_len} characters: "
                                      f"{describe(value)}"))
            return INVALID
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            # newlines would let a value inject lines into sysctl/nccl.conf files
            errs.append(Problem(path, f"control characters are not allowed: {describe(value)}"))
            return INVALID
        if self.pattern is not None and not self.pattern.fullmatch(value):
            errs.append(Problem(path, f"expected {self.what}, got {describe(value)}"))
            return INVALID
        if self.convert is not None:
            try:
                return self.convert(value)
            except ValueError as err:
                errs.append(Problem(path, f"{err} (got {describe(value)})"))
                return INVALID
        return value

    def json_schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "string", "maxLength": self.max_len}
        if not self.allow_empty:
            s["minLength"] = 1
        if self.pattern is not None:
            s["pattern"] = f"^(?:{self.pattern.pattern})$"
        return self._doc(s)


class Enum(Spec):
    def __init__(self, choices: tuple[str, ...], description: str = "") -> None:
        self.choices, self.description = choices, description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, str)

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if not isinstance(value, str) or value not in self.choices:
            shown = _got(value) if not isinstance(value, str) else f"got {describe(value)}"
            errs.append(Problem(path, f"expected one of {', '.join(self.choices)}; {shown}"))
            return INVALID
        return value

    def json_schema(self) -> dict[str, Any]:
        return self._doc({"type": "string", "enum": list(self.choices)})


class StrList(Spec):
    """A string or an array of strings, normalized to a list (globs, names)."""

    def __init__(self, item: Str, max_items: int = 256, description: str = "") -> None:
        self.item, self.max_items, self.description = item, max_items, description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, (str, list))

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if isinstance(value, str):
            one = self.item.check(value, path, errs)
            return INVALID if one is INVALID else [one]
        if not isinstance(value, list):
            errs.append(Problem(path, f"expected {self.item.what} or an array of them, "
                                      f"{_got(value)}"))
            return INVALID
        if len(value) > self.max_items:
            errs.append(Problem(path, f"more than {self.max_items} items"))
            return INVALID
        out = [self.item.check(v, key_path(path, i), errs) for i, v in enumerate(value)]
        return INVALID if any(v is INVALID for v in out) else out

    def json_schema(self) -> dict[str, Any]:
        item = self.item.json_schema()
        return self._doc({"anyOf": [item, {"type": "array", "items": item,
                                           "maxItems": self.max_items}]})


class AnyOf(Spec):
    """The first spec whose type fits checks the value (e.g. integer or string)."""

    def __init__(self, *specs: Spec, what: str, description: str = "") -> None:
        self.specs, self.what, self.description = specs, what, description

    def accepts_type(self, value: Any) -> bool:
        return any(s.accepts_type(value) for s in self.specs)

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        for spec in self.specs:
            if spec.accepts_type(value):
                return spec.check(value, path, errs)
        errs.append(Problem(path, f"expected {self.what}, {_got(value)}"))
        return INVALID

    def json_schema(self) -> dict[str, Any]:
        return self._doc({"anyOf": [s.json_schema() for s in self.specs]})


class Table(Spec):
    """A TOML table with known ``fields``, or an open map (``values`` + ``key``).

    ``flatten``: nested tables are folded into dotted keys, so that an unquoted
    ``net.core.rmem_max = 1`` under ``[sysctl]`` (which TOML reads as nested
    tables) means the same as the quoted key.
    """

    def __init__(self, fields: Mapping[str, Spec] | None = None, *,
                 required: tuple[str, ...] = (), values: Spec | None = None,
                 key: Str | None = None, flatten: bool = False, max_keys: int = 1024,
                 description: str = "") -> None:
        self.fields = dict(fields or {})
        self.required = required
        self.values = values
        self.key = key
        self.flatten = flatten
        self.max_keys = max_keys
        self.description = description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, dict)

    def _flat(self, value: dict[str, Any], prefix: str = "",
              depth: int = 0) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            name = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and depth < 16:
                out.extend(self._flat(v, name, depth + 1))
            else:
                out.append((name, v))
        return out

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if not isinstance(value, dict):
            errs.append(Problem(path, f"expected a table, {_got(value)}"))
            return INVALID
        items = self._flat(value) if self.flatten else list(value.items())
        if len(items) > self.max_keys:
            errs.append(Problem(path, f"more than {self.max_keys} keys"))
            return INVALID
        out: dict[str, Any] = {}
        bad = False
        for k, v in items:
            sub = key_path(path, k)
            spec = self.fields.get(k)
            if spec is None and self.values is not None:
                if self.key is not None:
                    before = len(errs)
                    self.key.check(k, sub, errs)
                    if len(errs) > before:
                        bad = True
                        continue
                spec = self.values
            if spec is None:
                known = ", ".join(self.fields) or "none"
                errs.append(Problem(sub, f"unknown key {describe(k)} (known keys: {known})"))
                bad = True
                continue
            nv = spec.check(v, sub, errs)
            if nv is INVALID:
                bad = True
            else:
                out[k] = nv
        for k in self.required:
            if k not in value:
                errs.append(Problem(key_path(path, k), "missing (required)"))
                bad = True
        return INVALID if bad else out

    def json_schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "object"}
        if self.fields:
            s["properties"] = {k: v.json_schema() for k, v in self.fields.items()}
        if self.required:
            s["required"] = list(self.required)
        if self.values is not None:
            extra = self.values.json_schema()
            if self.key is not None and self.key.pattern is not None:
                s["patternProperties"] = {f"^(?:{self.key.pattern.pattern})$": extra}
                s["additionalProperties"] = False
            else:
                s["additionalProperties"] = extra
        else:
            s["additionalProperties"] = False
        return self._doc(s)


class TableArray(Spec):
    """An array of tables (``[[nic]]``); ``unique`` names the key that must not repeat."""

    def __init__(self, item: Table, unique: str | None = None, max_items: int = 1024,
                 description: str = "") -> None:
        self.item, self.unique, self.max_items = item, unique, max_items
        self.description = description

    def accepts_type(self, value: Any) -> bool:
        return isinstance(value, list)

    def check(self, value: Any, path: str, errs: list[Problem]) -> Any:
        if not isinstance(value, list):
            errs.append(Problem(path, f"expected an array of tables, {_got(value)}"))
            return INVALID
        if len(value) > self.max_items:
            errs.append(Problem(path, f"more than {self.max_items} entries"))
            return INVALID
        out: list[Any] = []
        seen: dict[Any, int] = {}
        bad = False
        for i, v in enumerate(value):
            sub = key_path(path, i)
            nv = self.item.check(v, sub, errs)
            if nv is INVALID:
                bad = True
                continue
            if self.unique is not None and self.unique in nv:
                k = nv[self.unique]
                if k in seen:
                    errs.append(Problem(key_path(sub, self.unique),
                                        f"duplicate {self.unique} {describe(k)} "
                                        f"(already used by {key_path(path, seen[k])})"))
                    bad = True
                    continue
                seen[k] = i
            out.append(nv)
        return INVALID if bad else out

    def json_schema(self) -> dict[str, Any]:
        return self._doc({"type": "array", "items": self.item.json_schema(),
                          "maxItems": self.max_items})
