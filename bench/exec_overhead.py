"""What the exec watcher costs the daemon: idle, and under a burst of unrelated execs.

Daemon CPU time comes from /proc/DAEMONPID/stat (utime + stime):

* idle for ~10 s with a [[job]] rule loaded (watcher subscribed): target 0;
* a burst of ~1,000 unrelated execs/s (/bin/true via posix_spawn) for ~5 s,
  once with the rule (watcher on) and once with no rules (watcher off: the
  daemon does not subscribe at all) -- the baseline. The burst generator's
  own CPU time (itself + its children) is printed for scale.

    python bench/exec_overhead.py [--idle 10] [--burst 5] [--rate 1000] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any

from _leases_common import Daemon, cpu_seconds, write_json

RULE_POLICY = ('[policy]\nname = "bench"\n\n[[job]]\nname = "bench"\n'
               'match.cmdline = ["*tunerd_bench_never_matches_*"]\n'
               'match.env = { LOCAL_RANK = "*" }\n')
NO_RULES = '[policy]\nname = "bench"\n'


def burst(seconds: float, rate: int) -> dict[str, float]:
    """posix_spawn /bin/true at ``rate``/s for ``seconds``; returns count and own CPU."""
    before_self = resource.getrusage(resource.RUSAGE_SELF)
    before_kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    n = 0
    env = {"PATH": "/usr/bin:/bin"}
    while True:
        now = time.monotonic()
        if now - t0 >= seconds:
            break
        due = int((now - t0) * rate)
        while n < due:
            pid = os.posix_spawn("/bin/true", ["true"], env)
            os.waitpid(pid, 0)
            n += 1
        time.sleep(0.001)
    wall = time.monotonic() - t0
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
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--idle", type=float, default=10.0)
    ap.add_argument("--burst", type=float, default=5.0)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--json")
    a = ap.parse_args()
    res: dict[str, Any] = {}
    d = Daemon(RULE_POLICY)
    try:
        ev0 = d.status()["services"]["autobind"]["watcher"]["events"]
        res["idle_watcher_on"] = phase(d, a.idle, None)
        ev1 = d.status()["services"]["autobind"]["watcher"]["events"]
        res["burst_watcher_on"] = phase(d, a.burst, a.rate)
        st = d.status()["services"]["autobind"]["watcher"]
        res["burst_watcher_on"]["events_seen"] = st["events"] - ev1
        res["idle_watcher_on"]["events_seen"] = ev1 - ev0
        res["watcher"] = st
    finally:
        d.stop()
    d = Daemon(NO_RULES)
    try:
        res["idle_watcher_off"] = phase(d, a.idle, None)
        res["burst_watcher_off"] = phase(d, a.burst, a.rate)
    finally:
        d.stop()

    on, off = res["burst_watcher_on"], res["burst_watcher_off"]
    print(f"exec watcher ({res['watcher']['mode']}, kernel event filter "
          f"{res['watcher']['kernel_event_filter']}):")
    for name in ("idle_watcher_on", "idle_watcher_off"):
        r = res[name]
        seen = (f"; {r['events_seen']} exec events from other processes on the host"
                if "events_seen" in r else "")
        print(f"  {name:18s}: daemon CPU {r['daemon_cpu_s'] * 1000:.0f} ms over "
              f"{r['wall_s']:.0f} s ({r['daemon_core_pct']:.2f}% of a core){seen}")
    for name, r in (("burst_watcher_on", on), ("burst_watcher_off", off)):
        print(f"  {name:18s}: {r['execs']} execs at {r['rate_per_s']:.0f}/s: daemon CPU "
              f"{r['daemon_cpu_s'] * 1000:.0f} ms = {r['daemon_core_pct']:.2f}% of a core; "
              f"generator {100 * r['generator_cpu_s'] / r['wall_s']:.0f}% of a core")
    print(f"  exec events the daemon handled during the burst: {on.get('events_seen')} "
          f"(host-wide, incl. other users' execs) with {res['watcher']['batches']} batch pauses")
    extra = on["daemon_core_pct"] - off["daemon_core_pct"]
    print(f"  watcher cost during the burst: {extra:+.2f}% of a core "
          f"({1e6 * max(on['daemon_cpu_s'] - off['daemon_cpu_s'], 0) / max(on['execs'], 1):.1f}"
          " us per exec)")
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
