"""Render a dict as TOML (for ``tunerctl policy show``).

A policy is plain data (tables, arrays of tables, scalars), so a small writer is
enough; its output parses back with tomllib to the same data (tested). Values
TOML cannot hold (None) are left out.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["render_toml"]

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    # JSON string escapes are a subset of TOML basic-string escapes
    return json.dumps(s, ensure_ascii=False)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        items = [f"{_key(str(k))} = {_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    return _string(str(v))


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _emit_table(lines: list[str], path: list[str], table: dict[str, Any],
                header: str | None) -> None:
    scalars = [(k, v) for k, v in table.items()
               if v is not None and not isinstance(v, dict) and not _is_table_array(v)]
    subtables = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    arrays = [(k, v) for k, v in table.items() if _is_table_array(v)]
    if header is not None and (scalars or not (subtables or arrays)):
        if lines:
            lines.append("")
        lines.append(header)
    for k, v in scalars:
        lines.append(f"{_key(str(k))} = {_value(v)}")
    for k, v in subtables:
        sub = [*path, _key(str(k))]
        _emit_table(lines, sub, v, f"[{'.'.join(sub)}]")
    for k, v in arrays:
        sub = [*path, _key(str(k))]
        for entry in v:
            if lines:
                lines.append("")
            lines.append(f"[[{'.'.join(sub)}]]")
            # nested tables of an entry are written inline: simpler and still valid TOML
            for ek, ev in entry.items():
                if ev is not None:
                    lines.append(f"{_key(str(ek))} = {_value(ev)}")


def render_toml(data: dict[str, Any]) -> str:
    """TOML text for ``data``: top-level keys first, then tables, then arrays of tables."""
    lines: list[str] = []
    _emit_table(lines, [], data, None)
    return "\n".join(lines) + "\n"
