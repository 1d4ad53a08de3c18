"""NCCL settings in a managed block of /etc/nccl.conf (``nccl:<VAR>`` keys).

Only the lines between tunerd's marker lines are ever touched; the rest of the
file stays byte for byte (line endings, comments, a missing final newline).
The BEGIN marker records what tunerd had to add around the block, so that
removing the block gives back the exact original file even after a crash:
``[added-newline]`` (the file did not end with one) and ``[created-file]``
(there was no file: it is deleted when the block goes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.base.safefs import write_atomic
from tunerd.policy.typed import NcclValue
from tunerd.tuners.base import Change, SettingError, to_setting_value

BEGIN = "# BEGIN tunerd managed block: edit the policy, not these lines"
END = "# END tunerd managed block"
ADDED_NEWLINE = "[added-newline]"
CREATED_FILE = "[created-file]"
_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$")


@dataclass
class NcclConf:
    """The file split around the managed block."""

    before: str = ""
    block: dict[str, str] = field(default_factory=dict)
    after: str = ""
    flags: set[str] = field(default_factory=set)
    eol: str = "\n"
    has_block: bool = False
    exists: bool = False

    def outside_value(self, var: str) -> str | None:
        """The last value of ``var`` set outside the block (NCCL reads top to bottom)."""
        val = None
        for line in (self.before + self.after).splitlines():
            m = _ASSIGN.match(line)
            if m and m.group(1) == var:
                val = m.group(2).strip()
        return val

    def render(self) -> str | None:
        """The file text, or None when the file should not exist."""
        if not self.block:
            before = self.before
            if ADDED_NEWLINE in self.flags and before.endswith(self.eol):
                before = before[: -len(self.eol)]
            text = before + self.after
            return None if CREATED_FILE in self.flags and text == "" else text
        begin = " ".join([BEGIN, *sorted(self.flags)])
        body = "".join(f"{k}={v}{self.eol}" for k, v in self.block.items())
        return f"{self.before}{begin}{self.eol}{body}{END}{self.eol}{self.after}"


def parse_conf(text: str | None) -> NcclConf:
    if text is None:
        return NcclConf()
    eol = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\r\n").startswith(BEGIN)), None)
    if start is None:
        return NcclConf(before=text, eol=eol, exists=True)
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].rstrip("\r\n") == END), len(lines) - 1)
    head = lines[start].rstrip("\r\n")[len(BEGIN):]
    flags = {f for f in (ADDED_NEWLINE, CREATED_FILE) if f in head}
    block: dict[str, str] = {}
    for ln in lines[start + 1:end]:
        m = _ASSIGN.match(ln.rstrip("\r\n"))
        if m:
            block[m.group(1)] = m.group(2)
    return NcclConf(before="".join(lines[:start]), block=block, after="".join(lines[end + 1:]),
                    flags=flags, eol=eol, has_block=True, exists=True)


class NcclTuner:
    kind = "nccl"

    def __init__(self, etc_root: Path | str = "/etc") -> None:
        self.path = Path(etc_root) / "nccl.conf"

    def load(self) -> NcclConf:
        try:
            # surrogateescape: bytes that are not UTF-8 come back unchanged on write
            raw = self.path.read_bytes().decode("utf-8", "surrogateescape")
        except FileNotFoundError:
            return NcclConf()
        return parse_conf(raw)

    def store(self, conf: NcclConf, key: str, value: str | None) -> None:
        text = conf.render()
        try:
            if text is None:
                self.path.unlink(missing_ok=True)
                return
            try:
                mode = self.path.stat().st_mode & 0o7777
            except FileNotFoundError:
                mode = 0o644
            write_atomic(self.path, text.encode("utf-8", "surrogateescape"), mode=mode)
        except OSError as err:
            raise SettingError(key, value, err, str(self.path)) from err

    def current_of(self, conf: NcclConf, var: str) -> str | None:
        if var in conf.block:
            return conf.block[var]
        return conf.outside_value(var)

    def read(self, keys: Iterable[str] | None = None) -> dict[str, str | None]:
        conf = self.load()
        names = [k.partition(":")[2] for k in keys] if keys is not None else list(conf.block)
        return {f"nccl:{v}": self.current_of(conf, v) for v in names}

    def plan(self, desired: Mapping[str, NcclValue]) -> list[Change]:
        conf = self.load()
        return [Change(f"nccl:{var}", self.current_of(conf, var), to_setting_value(v),
                       path=str(self.path))
                for var, v in desired.items()]

    def apply(self, change: Change) -> None:
        var = change.key.partition(":")[2]
        conf = self.load()
        if not conf.has_block:
            if not conf.exists:
                conf.flags.add(CREATED_FILE)
            elif conf.before and not conf.before.endswith("\n"):
                conf.flags.add(ADDED_NEWLINE)
                conf.before += conf.eol
        conf.block[var] = change.desired or ""
        self.store(conf, change.key, change.desired)

    def save_original(self, change: Change) -> dict[str, Any]:
        # the original of a managed variable is its absence from the block
        conf = self.load()
        var = change.key.partition(":")[2]
        return {"value": conf.block.get(var), "in_block": var in conf.block}

    def revert(self, key: str, saved: dict[str, Any]) -> None:
        var = key.partition(":")[2]
        conf = self.load()
        if saved.get("in_block"):
            if conf.block.get(var) == saved.get("value"):
                return
            conf.block[var] = str(saved.get("value"))
            if not conf.has_block and not conf.exists:
                conf.flags.add(CREATED_FILE)
        elif var in conf.block:
            del conf.block[var]
        else:
            return
        self.store(conf, key, saved.get("value"))

    def mentions(self, key: str, desired: Mapping[str, NcclValue]) -> bool:
        return key.partition(":")[2] in desired


def match_ifnames(spec: str, names: Sequence[str]) -> list[str]:
    """NCCL_SOCKET_IFNAME's syntax: "a,b" prefixes, "=a,b" exact names, "^a" excludes
    (prefix or exact): which of ``names`` NCCL would use (doctor, the fleet facts)."""
    exclude = spec.startswith("^")
    s = spec[1:] if exclude else spec
    exact = s.startswith("=")
    pats = [p for p in (s[1:] if exact else s).split(",") if p]

    def hit(n: str) -> bool:
        return any(n == p if exact else n.startswith(p) for p in pats)

    return [n for n in names if hit(n) != exclude]
