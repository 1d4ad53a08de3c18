#!/usr/bin/env python3
"""Exec storm: daemon CPU per exec of a command with a 1 MiB command line.

Two real daemons run side by side through the same storm:

* ``rules``: the bundled torch rule (the ``[[job]]`` of policies/00-base.toml:
  ``match.cmdline = ["*torchrun*", "*train*.py*"]``, ``match.env = {LOCAL_RANK}``),
  with one more env key, a random token only this run knows: on a shared machine
  the bundled rule alone would bind other people's training processes. The cost
  of a storm exec is the same (the command line is read and matched; where it
  matches, the environment is read and LOCAL_RANK looked up);
* ``baseline``: no rules (it does not even subscribe to exec events).

Both with metrics off and no host settings in their policy; neither binds anything
(no storm process has LOCAL_RANK). Each round execs ``--execs`` processes
``/bin/sh -c 'read x' sh ARG...`` whose arguments add up to 1 MiB, each kept
alive ~50 ms (so the daemon reads a live process, as it would a real job), then
reads each daemon's CPU from outside: the sum of the first field (ns on CPU) of
/proc/PID/task/*/schedstat. Kinds of storm:

* ``short``: the same command with a 20-byte command line, for scale: what any
  exec costs the watcher (mostly the wake-up of the daemon's event loop);
* ``unrelated``: 1 MiB; the command line matches no glob (read, rejected);
* ``cmdline-match``: 1 MiB with ``train.py`` in the first argument: the command line
  matches, so the environment is read too (and rejected: no LOCAL_RANK).

``extra`` = rules - baseline; ``1MiB - short`` is what the length of the command
line itself costs. ``ms/event`` divides the rules daemon's CPU by every exec event it
handled, which on a shared machine includes other users' execs.

Also printed, measured in this process on one such live process: the matcher alone,
as the daemon had it (the whole command line read, fnmatch.translate regexes)
against RuleSet.match (bounded read, linear globs), CPU per call.

    python bench/exec_storm.py [--rounds 5] [--execs 100] [--json FILE]

Root only (the proc connector needs CAP_NET_ADMIN). Figures from a shared or
loaded machine are not figures for the README: re-measure on a quiet one.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from collections import deque
from typing import Any

from _leases_common import REPO, Daemon, bundled_torch_rule, task_ns, write_json

ARG = "x" * 65_535  # 16 arguments of 64 KiB (one argument may be at most 128 KiB)
SIZE = 1 << 20
KINDS = ("short", "unrelated", "cmdline-match")


def storm_argv(kind: str) -> list[str]:
    if kind == "short":
        return ["/bin/sh", "-c", "read x", "sh"]
    first = "train.py" if kind == "cmdline-match" else "job.sh"
    return ["/bin/sh", "-c", "read x", "sh", first, *[ARG] * 16]


def storm(kind: str, n: int, gap_s: float, alive_s: float = 0.05) -> float:
    """``n`` execs, each process kept alive ``alive_s``; returns the wall time."""
    argv = storm_argv(kind)
    env = {"PATH": "/usr/bin:/bin"}  # no LOCAL_RANK: nothing gets bound
    live: deque[tuple[float, subprocess.Popen[bytes]]] = deque()
    t0 = time.monotonic()

    def end(p: subprocess.Popen[bytes]) -> None:
        assert p.stdin is not None
        p.stdin.close()  # `read x` returns: sh exits
        p.wait()

    for _ in range(n):
        p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        live.append((time.monotonic(), p))
        while live and time.monotonic() - live[0][0] > alive_s:
            end(live.popleft()[1])
        time.sleep(gap_s)
    while live:
        t, p = live.popleft()
        time.sleep(max(0.0, alive_s - (time.monotonic() - t)))
        end(p)
    return time.monotonic() - t0


def watcher_events(d: Daemon) -> int:
    w = d.status()["services"]["autobind"]["watcher"]
    return int(w["events"])


def matched(d: Daemon) -> int:
    return int(d.status()["services"]["autobind"]["matched"])


def ping_ms(d: Daemon) -> float:
    from tunerd.wire.client import Client

    t = time.perf_counter()
    with Client(str(d.socket)) as c:
        c.call("ping")
    return (time.perf_counter() - t) * 1000


def matcher_alone(kind: str, calls: int = 30) -> dict[str, float]:
    """CPU per match call in this process: the old way against RuleSet.match."""
    sys.path.insert(0, str(REPO))
    from types import MappingProxyType

    from tunerd.policy.typed import JobSpec
    from tunerd.watch.rules import RuleSet

    globs = ["*torchrun*", "*train*.py*"]
    any_re = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))
    rules = RuleSet.from_policy((JobSpec(name="torch-training", cmdline=tuple(globs),
                                         env=MappingProxyType({"LOCAL_RANK": "*"})),))

    def old(pid: int) -> bool:
        # the daemon before: 4 KiB, then the whole of it again in 64 KiB reads; one
        # regex of every glob; the environment (up to 1 MiB) after a command-line match
        chunks = []
        with open(f"/proc/{pid}/cmdline", "rb", buffering=0) as f:
            while b := f.read(65536):
                chunks.append(b)
        text = b"".join(chunks).rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
        if not any_re.match(text):
            return False
        with open(f"/proc/{pid}/environ", "rb", buffering=0) as f:
            env = f.read(SIZE)
        return b"LOCAL_RANK=" in env

    p = subprocess.Popen(storm_argv(kind), env={"PATH": "/usr/bin:/bin"},
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.1)
        out: dict[str, float] = {}
        for name, fn in (("old_us", old), ("new_us", rules.match)):
            per: list[float] = []
            for _ in range(calls):
                t = time.thread_time_ns()
                fn(p.pid)
                per.append((time.thread_time_ns() - t) / 1000)
            out[name] = statistics.median(per)
        out["ratio"] = out["old_us"] / out["new_us"]
        return out
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execs", type=int, default=100, help="execs per round and kind")
    ap.add_argument("--gap", type=float, default=0.005, help="seconds between two spawns")
    ap.add_argument("--json")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("exec_storm: needs root (the proc connector needs CAP_NET_ADMIN)")
        return 2
    res: dict[str, Any] = {"command_line_bytes": len(" ".join(storm_argv("unrelated"))),
                           "execs_per_round": a.execs, "rounds": a.rounds, "kinds": {}}
    started: list[Daemon] = []
    try:
        # inside try: a daemon started before one that fails to start is stopped too
        rules = Daemon(bundled_torch_rule(secrets.token_hex(16)))
        started.append(rules)
        base = Daemon('[policy]\nname = "bench"\n')
        started.append(base)
        for kind in KINDS:
            rows = []
            for _ in range(a.rounds):
                ev0 = watcher_events(rules)
                c_rules, c_base = task_ns(rules.proc.pid), task_ns(base.proc.pid)
                wall = storm(kind, a.execs, a.gap)
                time.sleep(0.2)  # let the daemon drain its queue
                d_rules = task_ns(rules.proc.pid) - c_rules
                d_base = task_ns(base.proc.pid) - c_base
                events = watcher_events(rules) - ev0
                rows.append({"wall_s": wall, "events": events,
                             "rules_ms_per_exec": d_rules / 1e6 / a.execs,
                             "rules_ms_per_event": d_rules / 1e6 / max(events, 1),
                             "baseline_ms_per_exec": d_base / 1e6 / a.execs,
                             "extra_ms_per_exec": (d_rules - d_base) / 1e6 / a.execs})
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            med["ratio"] = (med["rules_ms_per_exec"] / med["baseline_ms_per_exec"]
                            if med["baseline_ms_per_exec"] > 0 else float("inf"))
            med["ping_ms_after"] = statistics.median(ping_ms(rules) for _ in range(5))
            med["matcher_alone"] = matcher_alone(kind)
            res["kinds"][kind] = {"rounds": rows, "median": med}
        res["bound_by_rules"] = matched(rules)
    finally:
        for d in started:
            d.stop()

    rate = a.execs / statistics.median(r["wall_s"] for k in res["kinds"].values()
                                       for r in k["rounds"])
    print(f"exec storm: {a.rounds} rounds x {a.execs} execs (~{rate:.0f}/s) of a "
          f"{res['command_line_bytes'] / 2**20:.2f} MiB command line, each alive ~50 ms; "
          "daemon CPU from /proc/PID/task/*/schedstat (medians over rounds)")
    print(f"  {'storm':14s} {'rules ms/exec':>14s} {'baseline':>9s} {'extra':>8s} "
          f"{'ratio':>6s} {'events':>7s} {'ms/event':>9s} {'ping ms':>8s}")
    for kind, r in res["kinds"].items():
        m = r["median"]
        print(f"  {kind:14s} {m['rules_ms_per_exec']:14.3f} {m['baseline_ms_per_exec']:9.3f} "
              f"{m['extra_ms_per_exec']:8.3f} {m['ratio']:6.1f} {m['events']:7.0f} "
              f"{m['rules_ms_per_event']:9.3f} {m['ping_ms_after']:8.2f}")
    short = res["kinds"]["short"]["median"]["extra_ms_per_exec"]
    for kind in KINDS[1:]:
        m = res["kinds"][kind]["median"]
        print(f"  {kind}: 1 MiB - short = {m['extra_ms_per_exec'] - short:+.3f} ms per exec")
    print("  matcher alone, one live process, CPU per call in this process:")
    for kind, r in res["kinds"].items():
        m = r["median"]["matcher_alone"]
        print(f"    {kind:14s} whole read + translate regex {m['old_us']:8.1f} us; "
              f"RuleSet.match {m['new_us']:6.1f} us; ratio {m['ratio']:.1f}")
    print(f"  processes the rule matched (must be 0): {res['bound_by_rules']}")
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
