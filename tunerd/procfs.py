"""The one reader of /proc/PID (placeholder on main until the procfs branch lands)."""

from __future__ import annotations

from dataclasses import dataclass

from tunerd.errors import NoSuchProcess
from tunerd.watch.procfs import (  # noqa: F401
    PROC,
    _read,
    children_map,
    descendants,
    list_pids,
    list_tids,
    read_cmdline,
    read_environ,
    read_ppid,
    read_start_time,
    read_uid,
)


@dataclass(frozen=True)
class Stat:
    comm: str
    state: str
    ppid: int
    num_threads: int
    start_time: int


class Process:
    def __init__(self, pid: int, proc: str = PROC) -> None:
        self.pid = pid
        self.proc = proc

    def stat(self) -> Stat:
        raw = _read(f"{self.proc}/{self.pid}/stat")
        if raw is None:
            raise NoSuchProcess(f"no process with pid {self.pid}", pid=self.pid)
        comm = raw[raw.find(b"(") + 1:raw.rfind(b")")].decode(errors="replace")
        f = raw[raw.rfind(b")") + 2:].split()
        return Stat(comm, f[0].decode(), int(f[1]), int(f[17]), int(f[19]))

    def uids(self) -> tuple[int, int]:
        raw = _read(f"{self.proc}/{self.pid}/status")
        if raw is None:
            raise NoSuchProcess(f"no process with pid {self.pid}", pid=self.pid)
        for line in raw.decode(errors="replace").splitlines():
            if line.startswith("Uid:"):
                parts = line.split()
                return int(parts[1]), int(parts[2])
        raise NoSuchProcess(f"process {self.pid} has exited", pid=self.pid)


def read_comm(pid: int, proc: str = PROC) -> str | None:
    raw = _read(f"{proc}/{pid}/comm")
    return raw.decode(errors="replace").strip() if raw is not None else None
