"""Other users' command lines, shown to a non-root caller only as /proc shows them.

With /proc mounted ``hidepid=1``/``2`` (``noaccess``/``invisible``/``ptraceable``) a
user cannot read another user's ``/proc/PID/cmdline``; the daemon, which can, must
not hand it over in ``jobs``, ``leases`` or ``top``. The mount options are read from
the daemon's own ``/proc/self/mountinfo`` (``gid=`` names the group exempted); the
peer's groups from ``/proc/PEER/status``. Without hidepid every user may read every
command line, and replies show them as they are.
"""

from __future__ import annotations

import os
from typing import Any

from tunerd.adapters import procfs

__all__ = ["HIDDEN", "ProcVisibility"]

HIDDEN = "(hidden: /proc is mounted hidepid)"
# what a non-owner may not see where /proc hides it: command lines, the names a user
# chose (comm, a run's command), environment-derived values (a rank's ``why`` names
# its launcher and TORCHELASTIC_RUN_ID; ``notes`` quote ignored environment values)
_USER_TEXT = ("cmdline", "cmd", "comm", "tag", "why")
_USER_LISTS = ("notes",)
_LEVELS = {"0": 0, "off": 0, "1": 1, "noaccess": 1, "2": 2, "invisible": 2,
           "4": 4, "ptraceable": 4}


def hidepid(proc_root: str = "/proc") -> tuple[int, int | None]:
    """(hidepid level, exempt gid) of the procfs mounted at ``proc_root``, as this
    process sees it; (0, None) if it cannot tell."""
    try:
        with open(f"{proc_root}/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0, None
    level, gid = 0, None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] != "proc":
            continue
        if fields[4] != proc_root:
            continue
        level, gid = 0, None  # the last mount at the path is the one in force
        for opt in rfields[2].split(","):
            key, _, val = opt.partition("=")
            if key == "hidepid":
                level = _LEVELS.get(val, 2)
            elif key == "gid" and val.isdigit():
                gid = int(val)
    return level, gid


def _groups(pid: int, proc_root: str) -> set[int]:
    try:
        with open(f"{proc_root}/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:] if g.isdigit()}
    except OSError:
        pass
    return set()


class ProcVisibility:
    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc = proc_root

    def sees_all(self, peer: Any) -> tuple[bool, int]:
        """(whether ``peer`` may read every process's cmdline, hidepid level)."""
        if peer.is_root:
            return True, 0
        level, gid = hidepid(self.proc)
        if level == 0:
            return True, 0
        if gid is not None and (peer.gid == gid or gid in _groups(peer.pid, self.proc)):
            return True, level
        return False, level

    def uid_sees_all(self, uid: int) -> bool:
        """Whether a connection owned by ``uid`` (no process known: an HTTP client on
        this host) may read every process's text: root, no hidepid, or a member of
        the mount's ``gid=`` group (from the group database)."""
        if uid == 0:
            return True
        level, gid = hidepid(self.proc)
        if level == 0:
            return True
        if gid is None:
            return False
        import pwd

        try:
            pw = pwd.getpwuid(uid)
            return gid in os.getgrouplist(pw.pw_name, pw.pw_gid)
        except (KeyError, OSError):
            return False

    def redact(self, peer: Any, records: list[dict[str, Any]],
               uid_key: str = "uid") -> list[dict[str, Any]]:
        """``records`` with other users' user text hidden where /proc hides it from
        ``peer``."""
        ok, _ = self.sees_all(peer)
        if ok:
            return records
        out = []
        for rec in records:
            uid = rec[uid_key] if uid_key in rec else self.owner(rec.get("pid"))
            if uid == peer.uid:
                out.append(rec)
                continue
            rec = dict(rec)
            for k in _USER_TEXT:
                if rec.get(k) is not None:
                    rec[k] = HIDDEN
            for k in _USER_LISTS:
                if rec.get(k):
                    rec[k] = [HIDDEN]
            if rec.get("origin") in ("cli", "run") and rec.get("name") is not None:
                rec["name"] = HIDDEN  # a run's name is its command's
            out.append(rec)
        return out

    def owner(self, pid: Any) -> int | None:
        """The uid of a record that names only its pid (None: gone, or no pid): a
        record of a process that is gone is nobody's, and stays hidden."""
        if not isinstance(pid, int) or isinstance(pid, bool):
            return None
        return procfs.read_uid(pid, self.proc)
