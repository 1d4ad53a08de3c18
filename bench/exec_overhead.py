"""What the exec watcher costs the daemon: idle, and under a burst of unrelated execs.

Daemon CPU time comes from /proc/DAEMONPID/stat (utime + stime):

* idle for ~10 s with a [[job]] rule loaded (watcher subscribed): target 0;
* a burst of ~1,000 unrelated execs/s (/bin/true via posix_spawn) for ~5 s,
  with each of three daemons in turn, in the same run:

  - ``bench rule``: a rule whose command-line glob never matches (plus an env
    key): the watcher reads each command line and rejects it;
  - ``bundled rule``: the bundled ``torch-training`` rule of policies/00-base.toml
    (``match.rank = true``, no command-line glob: every exec on the host is looked
    at by its environment), narrowed by one more env key, a random token of this
    run, so that on a shared machine it binds nobody's real training ranks (the
    token costs one more variable name to look for, nothing else);
  - ``watcher off``: no rules; the daemon does not subscribe at all -- the baseline.

  The burst generator's own CPU time (itself + its children) is printed for scale.
  ``--rounds N`` repeats the three arms N times (interleaved) and prints the median
  of each figure over the rounds (each round's arms against its own watcher-off).

    python bench/exec_overhead.py [--idle 10] [--burst 5] [--rate 1000] [--rounds 1]
                                  [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import statistics
import time
from typing import Any

from _leases_common import Daemon, bundled_torch_rule, cpu_seconds, write_json

RULE_POLICY = ('[policy]\nname = "bench"\n\n[[job]]\nname = "bench"\n'
               'match.cmdline = ["*tunerd_bench_never_matches_*"]\n'
               'match.env = { LOCAL_RANK = "*" }\n')
NO_RULES = '[policy]\nname = "bench"\n'


def burst(seconds: float, rate: int) -> dict[str, float]:
    """posix_spawn /bin/true at ``rate``/s for ``seconds`` (reaped as they exit, without
    waiting for each: a loaded machine still gets the rate); returns count and own CPU."""
    before_self = resource.getrusage(resource.RUSAGE_SELF)
    before_kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    n = 0
    live = 0  # spawned, not reaped yet: a slow exit does not hold up the next spawn
    env = {"PATH": "/usr/bin:/bin"}
    while True:
        now = time.monotonic()
        if now - t0 >= seconds:
            break
        due = int((now - t0) * rate)
        while n < due:
            os.posix_spawn("/bin/true", ["true"], env)
            n += 1
            live += 1
        while live and os.waitpid(-1, os.WNOHANG)[0]:
            live -= 1
        time.sleep(0.001)
    wall = time.monotonic() - t0
    for _ in range(live):
        os.waitpid(-1, 0)
    s = resource.getrusage(resource.RUSAGE_SELF)
    k = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (s.ru_utime - before_self.ru_utime + s.ru_stime - before_self.ru_stime
           + k.ru_utime - before_kids.ru_utime + k.ru_stime - before_kids.ru_stime)
    return {"execs": n, "wall_s": wall, "rate_per_s": n / wall, "generator_cpu_s": cpu}


def phase(d: Daemon, seconds: float, rate: int | None) -> dict[str, Any]:
    pid = d.proc.pid
    c0 = cpu_seconds(pid)
    if rate is None:
        time.sleep(seconds)
        out: dict[str, Any] = {"wall_s": seconds}
    else:
        out = burst(seconds, rate)
    time.sleep(0.3)  # let the daemon drain what is queued
    out["daemon_cpu_s"] = cpu_seconds(pid) - c0
    out["daemon_core_pct"] = 100 * out["daemon_cpu_s"] / out["wall_s"]
    out["daemon_ms_per_s"] = 1000 * out["daemon_cpu_s"] / out["wall_s"]
    return out


def arm(policy: str, a: argparse.Namespace, watched: bool) -> dict[str, Any]:
    """One daemon: idle, then a burst; with the watcher's counters when it watches."""
    res: dict[str, Any] = {}
    d = Daemon(policy)
    try:
        if not watched:
            res["idle"] = phase(d, a.idle, None)
            res["burst"] = phase(d, a.burst, a.rate)
            return res
        ev0 = d.status()["services"]["autobind"]["watcher"]["events"]
        res["idle"] = phase(d, a.idle, None)
        ev1 = d.status()["services"]["autobind"]["watcher"]["events"]
        st0 = d.status()["services"]["autobind"]["watcher"]
        res["burst"] = phase(d, a.burst, a.rate)
        st = d.status()["services"]["autobind"]
        res["burst"]["events_seen"] = st["watcher"]["events"] - ev1
        res["burst"]["batches"] = st["watcher"]["batches"] - st0["batches"]
        for key in ("wakeups", "exited_unread"):  # counters of this watcher, if it has them
            res["burst"][key] = st["watcher"].get(key, 0) - st0.get(key, 0)
        res["idle"]["events_seen"] = ev1 - ev0
        res["watcher"] = st["watcher"]
        res["matched"] = st["matched"]
    finally:
        d.stop()
    return res


ARMS = ("bench_rule", "bundled_rule", "watcher_off")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--idle", type=float, default=10.0)
    ap.add_argument("--burst", type=float, default=5.0)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    policies = {"bench_rule": RULE_POLICY,
                "bundled_rule": bundled_torch_rule(secrets.token_hex(16)),
                "watcher_off": NO_RULES}
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in ARMS}
    for _ in range(a.rounds):
        for name in ARMS:
            rounds[name].append(arm(policies[name], a, name != "watcher_off"))
    load = os.getloadavg()
    for name in ARMS[:2]:  # per round, against the same round's watcher-off burst
        for r, off_r in zip(rounds[name], rounds["watcher_off"], strict=True):
            b = r["burst"]
            extra = b["daemon_cpu_s"] - off_r["burst"]["daemon_ms_per_s"] / 1000 * b["wall_s"]
            b["us_per_exec_over_off"] = 1e6 * max(extra, 0) / max(b["execs"], 1)

    def med(name: str, ph: str, key: str) -> float:
        return statistics.median(r[ph][key] for r in rounds[name])

    res: dict[str, Any] = {"rounds": rounds, "loadavg": load, "median": {
        name: {ph: {k: med(name, ph, k) for k in rounds[name][0][ph]
                    if isinstance(rounds[name][0][ph][k], (int, float))}
               for ph in ("idle", "burst")} for name in ARMS}}
    w = rounds["bench_rule"][-1]["watcher"]
    print(f"exec watcher ({w['mode']}, kernel event filter {w['kernel_event_filter']}); "
          f"{a.rounds} round(s), medians; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}:")
    for name in ARMS:
        m = res["median"][name]
        i, b = m["idle"], m["burst"]
        seen = (f"; {i['events_seen']:.0f} exec events from other processes"
                if "events_seen" in i else "")
        print(f"  {name:12s} idle : daemon CPU {i['daemon_ms_per_s']:5.1f} ms/s{seen}")
        line = (f"  {name:12s} burst: {b['execs']:.0f} execs at {b['rate_per_s']:.0f}/s: "
                f"daemon CPU {b['daemon_ms_per_s']:5.1f} ms/s")
        if name != "watcher_off":
            line += (f" ({b['us_per_exec_over_off']:.1f} us per exec over watcher "
                     f"off; {b['events_seen']:.0f} events, {b['batches']:.0f} batch pauses, "
                     f"{b['wakeups']:.0f} single wake-ups, {b['exited_unread']:.0f} exited "
                     "unread)")
        else:
            line += (f"; generator {100 * b['generator_cpu_s'] / b['wall_s']:.0f}% of a core")
        print(line)
    bound = sum(r["matched"] for name in ARMS[:2] for r in rounds[name])
    print(f"  processes the rules matched (must be 0): {bound}")
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
