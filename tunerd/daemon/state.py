"""STATE_DIR/state.json: leases, bindings and the original value of every host setting.

Written atomically (temp file, fsync, rename, fsync of the directory) *before*
the host is changed, so that ``revert`` works after a crash or ``kill -9``.
Each component owns one top-level section (``bindings``, ``leases``,
``originals``, ...).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from tunerd.safefs import write_atomic

log = logging.getLogger("tunerd.state")

SCHEMA_VERSION = 1


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {"version": SCHEMA_VERSION}
        self.load_error: str | None = None

    def load(self) -> None:
        """Read the file; a missing file is an empty state.

        A corrupt file is kept aside (never silently overwritten: it may hold
        the only record of original host settings) and the error is reported.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
        except ValueError as err:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            self.load_error = f"{self.path} was corrupt ({err}); kept as {aside}"
            log.error("%s", self.load_error)
            return
        self.data = data
        self.data.setdefault("version", SCHEMA_VERSION)

    def section(self, name: str, default: Any = None) -> Any:
        """The component-owned section ``name``, created from ``default`` if absent."""
        if name not in self.data:
            self.data[name] = {} if default is None else default
        return self.data[name]

    def save(self, sync_dir: bool = True) -> None:
        """Write atomically and durably: temp file, fsync, rename, fsync dir.

        ``sync_dir=False`` skips the directory fsync (about half the cost): the
        file's data is still on disk before the rename, so after a power loss the
        name holds either the previous or the new complete file. For records that
        die with the machine anyway (bindings of running processes) that is enough.
        """
        # compact: json.dumps with indent= uses the pure-Python encoder, ~5x slower on the
        # write-ahead path of every bind (jq . state.json reads it fine)
        payload = json.dumps(self.data, separators=(",", ":"), sort_keys=True).encode()
        write_atomic(self.path, payload, sync_dir=sync_dir)
