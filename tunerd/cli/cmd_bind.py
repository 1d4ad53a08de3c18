"""tunerctl bind | unbind | jobs.

On the start-up path of job prologs: imports click, the stdlib,
tunerd.cli.context and tunerd.cli.types only (tunerd.base.cpulist, stdlib-only, is
imported when a list is parsed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import CPULIST, PID, Command, CountType, plural


def _human_bind(r: dict[str, Any]) -> str:
    where = []
    if r.get("cpus") is not None:
        where.append(f"cpus {r['cpus']}")
    if r.get("mems") is not None:
        moved = r.get("pages_moved")
        where.append(f"mems {r['mems']}"
                     + (f" ({plural(moved, 'page')} moved)" if moved else ""))
    if r.get("gpus"):
        where.append("gpus " + ",".join(str(g) for g in r["gpus"]))
    threads = r.get("threads")
    head = f"bound pid {r['pid']}" + (
        f" ({plural(threads, 'thread')})" if isinstance(threads, int) else "")
    if r.get("dry_run"):
        head = f"dry run: would bind pid {r['pid']}"
    text = head + (" to " + ", ".join(where) if where else "")
    nof = r.get("nofile")
    if isinstance(nof, dict):
        text += f"; nofile {nof.get('old')} -> {nof.get('new')}"
    return "\n".join([text, *(f"note: {n}" for n in r.get("notes") or [])])


@click.command(cls=Command)
@click.argument("pid", type=PID)
@click.option("--cpus", type=CPULIST, help="CPUs to run on (cpulist, e.g. 2-5,8).")
@click.option("--mems", type=CPULIST, help="NUMA nodes for memory (cpulist); moves pages.")
@click.option("--gpus", type=CPULIST, help="GPUs the process uses: place near them.")
@click.option("--nofile", type=CountType(), help="RLIMIT_NOFILE to set.")
@click.option("--exclusive", is_flag=True, help="Do not share the CPUs with other jobs.")
def bind(pid: int, cpus: str | None, mems: str | None, gpus: str | None,
         nofile: int | None, exclusive: bool) -> int:
    """Pin a running process (all its threads) and set its limits.

    With no --cpus/--mems: near the GPUs it uses (needs GPU placement).
    """
    ctx = get_ctx()
    args: dict[str, Any] = {"pid": pid, "cpus": cpus, "mems": mems, "gpus": gpus,
                            "nofile": nofile}
    if exclusive:
        args["exclusive"] = True
    ctx.emit(ctx.call("bind", **args), _human_bind)
    return 0


@click.command(cls=Command)
@click.argument("pid", type=PID)
def unbind(pid: int) -> int:
    """Restore what bind changed."""
    ctx = get_ctx()

    def human(r: dict[str, Any]) -> str:
        threads = r.get("threads")
        what = plural(threads, "thread") if isinstance(threads, int) else "its threads"
        return "\n".join([f"unbound pid {r['pid']}: restored {what}",
                          *(f"note: {n}" for n in r.get("notes") or [])])

    ctx.emit(ctx.call("unbind", pid=pid), human)
    return 0


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def live_name(pid: int, cmdline: str = "") -> str:
    """The process's name as ps shows it now (/proc/PID/comm), else its argv[0]'s; printable
    characters only (a process chooses its own name)."""
    from tunerd.base.procpath import pid_path  # not on the bind path's start-up

    try:
        with open(pid_path(pid, "comm"), encoding="utf-8", errors="replace") as f:
            name = f.read().strip()
    except OSError:  # past hidepid=2 another user's comm is not readable either
        if cmdline.startswith("(hidden:"):  # the daemon's mark: "(hidden: /proc is ...)"
            return "(hidden)"
        name = os.path.basename(cmdline.split(" ", 1)[0]) if cmdline else ""
    return "".join(c if c.isprintable() else "?" for c in name)[:16] or "-"


def _human_jobs(r: dict[str, Any]) -> str:
    rows = [("PID", "NAME", "RULE", "CPUS", "MEMS", "GPUS", "NOFILE", "THREADS", "ORIGIN",
             "LEASE")]
    replay_only = False
    for j in r.get("jobs") or []:
        origin = str(j.get("origin") or "")
        if j.get("applied") is False:  # placed on a replayed topology, nothing applied
            origin += "*"
            replay_only = True
        rule = str(j.get("name") or "-")[:24] if j.get("origin") == "rule" else "-"
        rows.append((str(j["pid"]), live_name(int(j["pid"]), str(j.get("cmdline") or "")), rule,
                     j.get("cpus") or "-",
                     j.get("mems") or "-", ",".join(map(str, j.get("gpus") or [])) or "-",
                     str(j.get("nofile") or "-"), str(j.get("threads") or "-"),
                     origin, str(j.get("lease") or "-")))
    out = ["no bound processes"] if len(rows) == 1 else _table(rows)
    if replay_only:
        out.append("* placed on the replayed topology only: nothing applied "
                   "(`tunerctl --json jobs` has each explanation)")
    why = [f"  {j['pid']}: {j['why']}" for j in r.get("jobs") or [] if j.get("why")]
    alone = [f"  {x['pid']}: {x['why']}" for x in r.get("left_alone") or []]
    if why:
        out += ["", "taken as (by the daemon's intake):", *why]
    if alone:
        out += ["", "matched a rule but left alone:", *alone]
    ext = r.get("external") or []
    if ext:
        erows = [("PID", "CPUS", "JOB", "PLACED BY")]
        erows += [(str(x["pid"]), str(x.get("cpus") or "-"), str(x.get("job") or "-"),
                   str(x.get("placed_by") or "-")) for x in ext]
        out += ["", "external holders (ranks that pinned themselves; others avoid "
                "their CPUs):", *_table(erows)]
    leases = r.get("leases") or []
    if leases:
        lrows = [("LEASE", "USER", "GPUS", "CPUS", "PID", "TAG", "EXCLUSIVE")]
        for x in leases:
            lrows.append((str(x["id"]), str(x.get("user") or x.get("uid")),
                          ",".join(map(str, x.get("gpus") or [])) or "-",
                          str(x.get("cpus") or "-"), str(x.get("pid") or "-"),
                          str(x.get("tag") or "-"), "yes" if x.get("exclusive") else "no"))
        out += ["", *_table(lrows)]
    return "\n".join(out)


@click.command(cls=Command)
def jobs() -> int:
    """Bound processes and leases."""
    ctx = get_ctx()
    ctx.emit(ctx.call("jobs"), _human_jobs)
    return 0
