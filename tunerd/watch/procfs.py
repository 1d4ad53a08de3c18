"""Moved to :mod:`tunerd.procfs` (the one /proc reader); kept so that the daemon's
imports keep working until they are switched over, then deleted."""

from tunerd.procfs import (
    PROC,
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

__all__ = [
    "PROC",
    "children_map",
    "descendants",
    "list_pids",
    "list_tids",
    "read_cmdline",
    "read_environ",
    "read_ppid",
    "read_start_time",
    "read_uid",
]
