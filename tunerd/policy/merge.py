"""Merging policy content: later overrides earlier, key by key.

- tables merge deeply (a later key replaces the same key, other keys stay);
- plain arrays and scalars are replaced;
- arrays of tables (``[[nic]]``, ``[[block]]``, ``[[job]]``) merge by their key
  (``match`` / ``name``): an entry with the key of an earlier one overrides it
  field by field, any other entry is appended;
- ``policy.apply_once`` accumulates (each file names the settings it owns).
"""

from __future__ import annotations

import copy
from typing import Any

from tunerd.policy.sections import ARRAY_KEYS

__all__ = ["merge_content", "merge_tables"]


def merge_tables(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new table: ``base`` deep-merged with ``over`` (``over`` wins)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_tables(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def merge_entries(base: list[dict[str, Any]], over: list[dict[str, Any]],
                  key: str) -> list[dict[str, Any]]:
    out = copy.deepcopy(base)
    index = {e[key]: i for i, e in enumerate(out) if key in e}
    for entry in over:
        i = index.get(entry.get(key))
        if i is None:
            index[entry.get(key)] = len(out)
            out.append(copy.deepcopy(entry))
        else:
            out[i] = merge_tables(out[i], entry)
    return out


def merge_content(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Merge one validated file's sections (``over``) onto the merged ``base``."""
    out = dict(base)
    for section, value in over.items():
        if section in ARRAY_KEYS:
            out[section] = merge_entries(base.get(section, []), value, ARRAY_KEYS[section])
        elif section == "apply_once":
            seen = list(base.get("apply_once", []))
            out["apply_once"] = seen + [g for g in value if g not in seen]
        elif isinstance(value, dict):
            out[section] = merge_tables(base.get(section, {}), value)
        else:
            out[section] = copy.deepcopy(value)
    return out
