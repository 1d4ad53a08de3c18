"""Exec-to-bound latency of automatic binding ([[job]] rules), measured from outside.

A launcher starts N matching processes one after another (subprocess.Popen
returns once the child has exec'd) and then polls /proc/PID/status every 0.1 ms
(as fast as it can with --spin) until Cpus_allowed_list equals the CPU set the rule gives that rank;
after 1 s the process counts as "never bound". The placement is real: a
snapshot of this machine plus two recorded GPUs local to its first and last
CPU, so rank 0 -> first CPU, rank 1 -> last CPU, applied for real.

Two series per run: starts back to back (the next one as soon as the last
was seen bound and killed) and starts 50 ms apart. Runs twice: as installed
(RUNTIME_DIR on tmpfs, as /run is, STATE_DIR on the VM's disk: every first bind
writes the binding's originals to RUNTIME_DIR/state.json before changing the
process, written but not fsync'd), and with both dirs on the disk, to show what a
runtime dir on disk would cost. Baseline
in the same run: the launcher pins the process itself right after the exec
(the cost of the measurement).

    python bench/autobind.py [--n 200] [--compare-realtime] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _leases_common import Daemon, snapshot_with_gpus_here, summary, write_json

GIVE_UP = 1.0
SPACING = 0.05  # seconds between starts in the "spaced" series
# Between two reads of /proc/PID/status the launcher sleeps this long (0.1 ms resolution).
# A launcher that spins instead takes one of this VM's two CPUs away from the daemon and
# the starting process, and measures its own contention (--spin shows it).
POLL_SLEEP = 0.0001


def allowed(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return None
    i = data.find(b"Cpus_allowed_list:")
    return data[i + 18:data.index(b"\n", i)].strip().decode()


def measure(exe: Path, n: int, expected: dict[int, str], pin_self: bool, gap: float = 0.0,
            seen: dict[int, tuple[int, int]] | None = None) -> tuple[list[float], int]:
    """``seen``: pid -> (Popen returned, seen bound), CLOCK_MONOTONIC ns, for the timeline."""
    lat: list[float] = []
    missed = 0
    for i in range(n):
        if gap:
            time.sleep(gap)
        rank = i % 2
        p = subprocess.Popen([str(exe), "30"], env={**os.environ, "LOCAL_RANK": str(rank)})
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        if pin_self:
            os.sched_setaffinity(p.pid, {int(expected[rank])})
        want = expected[rank]
        while True:
            if allowed(p.pid) == want:
                lat.append((time.perf_counter() - t0) * 1000)
                if seen is not None:
                    seen[p.pid] = (t0_ns, time.monotonic_ns())
                break
            if time.perf_counter() - t0 > GIVE_UP:
                missed += 1
                break
            if POLL_SLEEP:
                time.sleep(POLL_SLEEP)
        p.kill()
        p.wait()
    return lat, missed


def timeline(outside: dict[int, tuple[int, int]],
             inside: list[list[int]]) -> dict[str, dict[str, float]]:
    """Each spaced start cut into steps, the launcher's clock and the daemon's being the
    same (CLOCK_MONOTONIC): Popen returned -> the kernel stamped the proc connector's exec
    event -> the watcher thread read it -> the main thread's CPUs set -> the launcher saw
    them. The daemon's status keeps its last 256 binds (``timeline_ns``)."""
    steps: dict[str, list[float]] = {"popen_returned_to_exec_event": [],
                                     "event_to_watcher_read": [], "read_to_cpus_set": [],
                                     "cpus_set_to_seen": []}
    for pid, stamped, read, cpus_set in inside:
        if pid not in outside:
            continue
        t0, seen = outside[pid]
        for key, (a, b) in zip(steps, ((t0, stamped), (stamped, read), (read, cpus_set),
                                       (cpus_set, seen)), strict=True):
            steps[key].append((b - a) / 1e6)
    return {k: summary(v) for k, v in steps.items() if v}


def one_run(exe: Path, snap: Path, expected: dict[int, str], n: int,
            root: Path | None, state_dir: Path | None = None,
            config: str | None = None) -> dict[str, Any]:
    policy = ('[policy]\nname = "bench"\n\n[[job]]\nname = "bench"\n'
              f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n')
    d = Daemon(policy, snap, root=root, state_dir=state_dir, config=config)
    try:
        measure(exe, 10, expected, False)  # warm-up (imports, caches)
        lat, missed = measure(exe, n, expected, False)
        outside: dict[int, tuple[int, int]] = {}
        spaced, spaced_missed = measure(exe, n, expected, False, SPACING, outside)
        st = d.status()["services"]["autobind"]
    finally:
        d.stop()
    return {"daemon_side_ms": st["latency_ms"],
            "exec_to_bound_ms": summary(lat), "never_bound": missed,
            "spaced_exec_to_bound_ms": summary(spaced), "spaced_never_bound": spaced_missed,
            "watcher": st["watcher"], "failed": st["failed"], "last_error": st["last_error"],
            "spaced_timeline_ms": timeline(outside, st.get("timeline_ns") or []),
            "bound_in_watcher": st.get("bound_in_watcher"),
            "left_to_loop": st.get("left_to_loop")}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--compare-realtime", action="store_true",
                    help="a third run, as installed but with exec_watch_realtime = false")
    ap.add_argument("--spin", action="store_true",
                    help="poll /proc without sleeping (costs the daemon a CPU on small VMs)")
    a = ap.parse_args()
    global POLL_SLEEP
    if a.spin:
        POLL_SLEEP = 0.0
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-autobind-"))
    exe = tmp / f"bench_train_{os.getpid()}"
    shutil.copy("/bin/sleep", exe)
    snap, lo, hi = snapshot_with_gpus_here(tmp / "snap.json")
    expected = {0: str(lo), 1: str(hi)}
    try:
        state = Path(tempfile.mkdtemp(prefix="tunerd-bench-state-"))
        state.chmod(0o700)
        shutil.rmtree(state)  # the daemon makes it (0700, root-owned)
        tmpfs = one_run(exe, snap, expected, a.n, Path("/dev/shm"), state)
        disk = one_run(exe, snap, expected, a.n, None)
        nice = (one_run(exe, snap, expected, a.n, Path("/dev/shm"),
                        config="exec_watch_realtime = false\n") if a.compare_realtime else None)
        base, base_missed = measure(exe, a.n, expected, True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"n": a.n, "all_on_disk": disk, "as_installed": tmpfs, "realtime_off": nice,
           "baseline_self_pin_ms": summary(base), "baseline_missed": base_missed}
    w = disk["watcher"]
    print(f"automatic binding, {a.n} process starts per run ({w['mode']}, kernel event "
          f"filter: {w.get('kernel_event_filter')}, watcher thread: "
          f"{w.get('thread_policy')}); exec->bound:")
    runs = [("runtime tmpfs, state disk", tmpfs), ("runtime+state on disk   ", disk)]
    if nice is not None:
        runs.append(("as installed, no SCHED_FIFO", nice))
    for name, r in runs:
        for series, key, miss in (("back-to-back", "exec_to_bound_ms", "never_bound"),
                                  (f"{SPACING * 1000:.0f} ms apart", "spaced_exec_to_bound_ms",
                                   "spaced_never_bound")):
            s = r[key]
            print(f"  {name}, {series:12s}: median {s['median']:.2f} ms  p95 {s['p95']:.2f} ms"
                  f"  p99 {s['p99']:.2f} ms  max {s['max']:.2f} ms  never bound {r[miss]}")
        if r["failed"]:
            print(f"  {name}: {r['failed']} bind(s) failed, the last: {r['last_error']}")
        s = r["daemon_side_ms"]
        print(f"  {name}, inside the daemon (exec event handled -> bound, n={s['n']}, "
              f"{r['bound_in_watcher']} in the watcher's thread, others: {r['left_to_loop']}): "
              f"median {s['median']:.2f} ms  p99 {s['p99']:.2f} ms"
              + (f"; steps (median ms): {s['bind_first_steps_median']}"
                 if s.get("bind_first_steps_median") else ""))
        tl = r.get("spaced_timeline_ms") or {}
        if tl:
            print(f"  {name}, {SPACING * 1000:.0f} ms apart, step by step (median / p99 ms, "
                  f"n={min(v['n'] for v in tl.values())}): "
                  + ", ".join(f"{k.replace('_', ' ')} {v['median']:.2f} / {v['p99']:.2f}"
                              for k, v in tl.items()))
        wk = r["watcher"].get("wake_ms") or {}
        if wk.get("n"):
            print(f"  {name}, before that: the kernel's exec event -> the watcher thread read "
                  f"it (n={wk['n']}, both series): median {wk['median']:.2f} ms  "
                  f"p99 {wk['p99']:.2f} ms")
    b = res["baseline_self_pin_ms"]
    print(f"  baseline (launcher pins itself): median {b['median']:.3f} ms  p95 {b['p95']:.3f} "
          f"ms  p99 {b['p99']:.3f} ms")
    write_json(a.json, res)
    missed_all = sum(r[k] for _, r in runs for k in ("never_bound", "spaced_never_bound"))
    return 0 if missed_all == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
