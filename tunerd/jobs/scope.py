"""A daemon's scope: the process subtree its [[job]] rules may bind (``scope_pid``).

A test daemon is told the pid of its test run (``tunerd --scope-pid PID``): automatic
binding (the exec watcher, the /proc rescans, cpuset re-binds) then touches only that
process and its descendants, and leaves everyone else's processes alone, so a test
suite on a busy node never moves another user's job. Such a daemon takes no node-wide
claim (tunerd.daemon.runtime.NodeClaim).

The check walks parents up to pid 1 through /proc/PID/stat, one read per ancestor,
and remembers the verdict of each process it decided (a slot of its record in the
node's ledger, checked by its start time), so a burst of execs under one launcher
reads the launcher's chain once. It runs only for a process a rule matched.
"""

from __future__ import annotations

from tunerd.adapters import procfs
from tunerd.base.errors import Failed
from tunerd.jobs.ledger import Ledger, ProcKey, Slot

__all__ = ["IN_SCOPE", "ProcessScope"]

_CACHE_MAX = 8192  # verdicts kept; dropped whole when full
IN_SCOPE = Slot[bool]("in-scope")  # whether the process is in the daemon's scope


class ProcessScope:
    """The subtree of ``root`` (pid and its start time, so a reused pid is not it).
    Its verdicts are in ``ledger`` (the daemon's; one scope per ledger, as a daemon
    has one)."""

    def __init__(self, root: int, proc: str = procfs.PROC,
                 ledger: Ledger | None = None) -> None:
        start = procfs.read_start_time(root, proc)
        if start is None:
            raise Failed(f"--scope-pid {root}: no such process", pid=root)
        self.root = root
        self.root_start = start
        self.proc = proc
        self.out_of_scope = 0  # processes a rule matched, left alone as outside
        self.ledger = ledger if ledger is not None else Ledger(proc)  # own: tests
        self._kept = 0  # verdicts put since the last clear (never less than are held)

    def _stat(self, pid: int) -> procfs.Stat | None:
        try:
            return procfs.parse_stat(procfs.read_bytes(f"{self.proc}/{pid}/stat"))
        except (OSError, ValueError, IndexError):
            return None

    def contains(self, pid: int) -> bool:
        """Whether ``pid`` is the root or one of its descendants (a process that is
        gone, or whose chain cannot be read, is outside)."""
        chain: list[ProcKey] = []
        verdict = False
        cur = pid
        for _ in range(4096):  # a chain longer than pid_max's depth is not real
            st = self._stat(cur)
            if st is None:
                break
            key = ProcKey(cur, st.start_time)
            known = self.ledger.get(cur, IN_SCOPE, start=st.start_time)
            if known is not None:
                verdict = known
                break
            chain.append(key)
            if key == (self.root, self.root_start):
                verdict = True
                break
            if cur <= 1 or st.ppid <= 0:
                break
            cur = st.ppid
        if self._kept + len(chain) > _CACHE_MAX:
            self.ledger.clear(IN_SCOPE)
            self._kept = 0
        self._kept += len(chain)
        for key in chain:
            self.ledger.put(key, IN_SCOPE, verdict)
        return verdict

    def admits(self, pid: int) -> bool:
        """``contains``, counting what it leaves out (status: out of scope)."""
        if self.contains(pid):
            return True
        self.out_of_scope += 1
        return False

    def status(self) -> dict[str, int]:
        return {"pid": self.root, "out_of_scope": self.out_of_scope}
