"""Subordinate uids (``/etc/subuid``) count as the user they belong to.

With ``newuidmap`` installed (rootless containers), a user's processes in her own user
namespace run as her subordinate uids on the host: 65,536 uids that are all hers. For
the per-user limits (``[leases] max_per_user``, ``max_connections_per_user``, the log
lines a user's requests may cause) each of them counts as her (issue 28, found 9: 4
subuids held 256 leases against a limit of 64).

The file is read again when it changes (its size, mtime or inode), at most 1 MiB of
it; a line that is not ``USER:FIRST:COUNT`` is skipped. USER is a name (looked up in
the user database when read) or a uid.
"""

from __future__ import annotations

import bisect
import logging
import os
import pwd
from pathlib import Path

from tunerd.base.errors import Failed
from tunerd.base.safefs import read_regular

__all__ = ["DEFAULT_SUBUID", "SubIds"]

log = logging.getLogger("tunerd")

DEFAULT_SUBUID = Path("/etc/subuid")
MAX_BYTES = 1 << 20


class SubIds:
    def __init__(self, path: Path = DEFAULT_SUBUID) -> None:
        self.path = path
        self._sig: tuple[int, int, int] | None = None
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, int]] = []  # (first, end, owner), sorted

    def owner(self, uid: int) -> int:
        """The uid whose subordinate ``uid`` is (``uid`` itself when none's)."""
        self.refresh()
        return self.owner_cached(uid)

    def owner_cached(self, uid: int) -> int:
        """As ``owner``, without looking whether the file changed (in a loop)."""
        i = bisect.bisect_right(self._starts, uid) - 1
        if i >= 0:
            first, end, who = self._ranges[i]
            if first <= uid < end:
                return who
        return uid

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            sig = None
        else:
            sig = (st.st_size, st.st_mtime_ns, st.st_ino)
        if sig == self._sig:
            return
        self._sig = sig
        ranges: list[tuple[int, int, int]] = []
        if sig is not None:
            try:
                text = read_regular(self.path, MAX_BYTES).decode("utf-8", "replace")
            except Failed as err:
                log.warning("subordinate uids not read: %s", err.message)
                text = ""
            for line in text.splitlines():
                parts = line.strip().split(":")
                if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                    continue
                who = _uid(parts[0])
                first, count = int(parts[1]), int(parts[2])
                if who is not None and count > 0 and first > 0:
                    ranges.append((first, first + count, who))
        ranges.sort()
        self._ranges = ranges
        self._starts = [r[0] for r in ranges]


def _uid(user: str) -> int | None:
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None
