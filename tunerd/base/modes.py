"""The placement mode: where a job's CPUs come from (tunerd.jobs.placement says how).

It lives in ``base`` so every layer that carries a mode (the policy's ``[[job]]
placement``, the rule matcher in ``watch``, the bind domain in ``jobs``) holds the
enum, not its text: text is parsed once, where it enters (``parse_mode``, the policy
schema's choices are ``MODES``). A ``TextEnum``: policy text, wire and state JSON
keep the spelling.
"""

from __future__ import annotations

from tunerd.base.errors import UsageError
from tunerd.base.strenum import TextEnum

__all__ = ["MODES", "Mode", "parse_mode"]


class Mode(TextEnum):
    """A placement mode; a str so policy text, wire and state JSON keep the same spelling."""

    GPU_LOCAL = "gpu-local"
    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"
    NONE = "none"


MODES: tuple[str, ...] = tuple(m.value for m in Mode)


def parse_mode(text: str) -> Mode:
    """``text`` as a Mode (a Mode is returned as it is); an unknown one is a
    UsageError (exit 2) naming it and the choices."""
    if type(text) is Mode:
        return text
    try:
        return Mode(text)
    except ValueError:
        raise UsageError(f"unknown placement mode {text!r} (one of {', '.join(MODES)})") \
            from None
