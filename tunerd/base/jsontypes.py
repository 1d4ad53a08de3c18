"""JSON as a type: what ``json.dumps`` writes and ``json.loads`` gives back.

``JSONValue`` is any JSON value, ``JSONObject`` one object (str keys). Values made
by tunerd for a reply, a status or a state file are typed as these; untyped JSON
read back (``json.load`` gives it untyped) enters through ``json_object`` only, and a
reader narrows each value it uses (``isinstance``) before it trusts its type.
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["JSONObject", "JSONScalar", "JSONValue", "json_object"]

JSONScalar: TypeAlias = str | int | float | bool | None
JSONValue: TypeAlias = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject: TypeAlias = dict[str, JSONValue]


def json_object(raw: object) -> JSONObject | None:
    """``raw`` as read from JSON (untyped) when it is an object with str keys, else None.

    The wire translation: nothing deeper is checked here (``json.load`` makes only
    JSON values); the reader narrows each value it takes out.
    """
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        return None
    out: JSONObject = raw
    return out
