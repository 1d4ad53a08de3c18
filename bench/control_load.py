"""Control-socket load: N concurrent clients in a closed loop against the real daemon.

Run from the repository root:  python bench/control_load.py [--clients 200] [--seconds 5]

It starts a real tunerd (temporary dirs, metrics off unless --metrics) and then, in
the same run and with the same clients, measures two commands one after the other:

  ping    the cheapest request the daemon answers (the baseline: socket, framing,
          JSON, dispatch)
  status  what `tunerctl status` asks for (every service's status, encoded)
  mix     (--mix) each client cycles status, jobs, bind PID --cpus 0, unbind PID on a
          sleeping process of its own that the bench started: the control socket as a
          busy shared node sees it (issue 26's figure: >= 2,000 replies/s, p99 <= 200 ms)

Each client is a raw non-blocking socket in one of --procs worker processes (one
selector each, so that the clients' own Python costs little and does not
serialize on one GIL); a client sends one request, waits for its reply, and
sends the next (closed loop). With --reconnect each
request opens a new connection, as every `tunerctl` invocation does.
Reported per command: requests/s over the measured window (after a warm-up),
p50/p99/max latency of one request as its client saw it, errors, and the daemon's
CPU seconds per 1,000 requests (from /proc/PID/stat).

Target (issue 9): status >= 2,000 requests/s from 200 clients with p99 <= 200 ms.
The figures depend on the machine and on what else runs on it: compare status with
the ping baseline of the same run, not with numbers from another machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _leases_common import Daemon, cpu_seconds, pct


class _Conn:
    __slots__ = ("buf", "i", "reqs", "sock", "t0")

    def __init__(self, reqs: list[bytes]) -> None:
        self.sock: socket.socket | None = None
        self.buf = b""
        self.t0 = 0.0
        self.reqs = reqs
        self.i = 0  # which of reqs goes next


def _requests(cmd: str, pids: list[int]) -> list[list[bytes]]:
    """Per client, the requests it sends in turn (one for a plain command)."""
    def line(name: str, **args: object) -> bytes:
        return json.dumps({"id": 1, "cmd": name, "args": args}).encode() + b"\n"
    if cmd != "mix":
        return [[line(cmd)] for _ in pids]
    return [[line("status"), line("jobs"), line("bind", pid=p, cpus="0"),
             line("unbind", pid=p)] for p in pids]


MIX = ("status", "jobs", "bind", "unbind")


def _worker(path: str, cmd: str, n: int, start: float, stop: float, reconnect: bool,
            out: Any, pids: list[int]) -> None:
    """``n`` clients on raw non-blocking sockets and one selector: as little client-side
    Python per request as possible, so that the daemon is what is measured."""
    reqs = _requests(cmd, pids)
    sel = selectors.DefaultSelector()
    lat: list[float] = []
    kinds: list[int] = []  # which of the client's requests each latency is
    errors: list[str] = []
    nerr = 0

    def begin(c: _Conn) -> None:
        nonlocal nerr
        c.t0 = time.perf_counter()
        c.buf = b""
        if c.sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)  # a blocking connect waits for room in the listen queue
            try:
                s.connect(path)
            except OSError as err:
                s.close()
                nerr += 1
                if len(errors) < 20:
                    errors.append(repr(err))
                time.sleep(0.01)
                return begin(c)
            s.setblocking(False)
            c.sock = s
            sel.register(s, selectors.EVENT_READ, c)
        c.sock.send(c.reqs[c.i])  # a fresh or idle socket's buffer takes one short request

    def end(c: _Conn) -> None:
        assert c.sock is not None
        sel.unregister(c.sock)
        c.sock.close()
        c.sock = None

    conns = [_Conn(r) for r in reqs[:n]]
    while time.monotonic() < start - 1.0:
        time.sleep(0.01)
    for c in conns:
        begin(c)
    while True:
        now = time.monotonic()
        if now >= stop:
            break
        for key, _ in sel.select(0.5):
            c = key.data
            try:
                chunk = c.sock.recv(1 << 20)
            except OSError as err:
                chunk = b""
                errors.append(repr(err))
            if not chunk:
                nerr += 1
                if len(errors) < 20:
                    errors.append("connection closed by the daemon")
                end(c)
                begin(c)
                continue
            c.buf += chunk
            if not c.buf.endswith(b"\n"):
                continue
            t = time.perf_counter()
            if b'"ok":true' not in c.buf:
                nerr += 1
                if len(errors) < 20:
                    errors.append(c.buf[:200].decode(errors="replace"))
            elif now >= start:
                lat.append(t - c.t0)
                kinds.append(c.i)
            c.i = (c.i + 1) % len(c.reqs)
            if reconnect:
                end(c)
            begin(c)
    for c in conns:
        if c.sock is not None:
            c.sock.close()
    out.put((lat, kinds, errors[:20], nerr))


def measure(path: str, daemon_pid: int | None, cmd: str, clients: int, procs: int,
            warmup: float, seconds: float, reconnect: bool,
            pids: list[int] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    t_begin = time.monotonic() + 1.5  # time for the workers to start and connect
    start, stop = t_begin + warmup, t_begin + warmup + seconds
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    pids = pids or [0] * clients
    firsts = [sum(per[:i]) for i in range(len(per))]
    workers = [ctx.Process(target=_worker, args=(path, cmd, n, start, stop, reconnect, out,
                                                 pids[first:first + n]))
               for n, first in zip(per, firsts, strict=True) if n]
    for w in workers:
        w.start()
    while time.monotonic() < start:
        time.sleep(0.01)
    cpu0 = cpu_seconds(daemon_pid) if daemon_pid else None
    while time.monotonic() < stop:
        time.sleep(0.01)
    cpu1 = cpu_seconds(daemon_pid) if daemon_pid else None
    lat: list[float] = []
    kinds: list[int] = []
    samples: list[str] = []
    nerr = 0
    for _ in workers:
        got_lat, got_kinds, got_err, got_n = out.get(timeout=seconds + 60)
        lat += got_lat
        kinds += got_kinds
        samples += got_err
        nerr += got_n
    for w in workers:
        w.join(30)
    n = len(lat)
    res: dict[str, Any] = {
        "cmd": cmd, "clients": clients, "reconnect": reconnect, "requests": n,
        "requests_per_s": round(n / seconds, 1),
        "p50_ms": round(pct(lat, 50) * 1000, 2), "p99_ms": round(pct(lat, 99) * 1000, 2),
        "max_ms": round(max(lat) * 1000, 2) if lat else None, "errors": nerr,
    }
    if cpu0 is not None and cpu1 is not None and n:
        res["daemon_cpu_ms_per_1000_requests"] = round((cpu1 - cpu0) / n * 1e6, 1)
        # below ~90% the daemon was not the bottleneck: the clients or the machine were
        res["daemon_cpu_percent"] = round((cpu1 - cpu0) / seconds * 100, 1)
    if samples:
        res["error_samples"] = samples[:3]
    if cmd == "mix":
        pairs = list(zip(lat, kinds, strict=True))
        res["p99_ms_by_cmd"] = {name: round(pct([x for x, k in pairs if k == i], 99) * 1000, 2)
                                for i, name in enumerate(MIX)}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--procs", type=int, default=max(2, min(8, os.cpu_count() or 2)),
                    help="client worker processes (default: CPUs, 2..8)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per command")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--reconnect", action="store_true",
                    help="a new connection per request (as each tunerctl call makes)")
    ap.add_argument("--metrics", action="store_true", help="daemon with its metrics endpoint on")
    ap.add_argument("--socket", help="measure an already running daemon at this socket")
    ap.add_argument("--pid", type=int, help="that daemon's pid (for its CPU time)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--root", metavar="DIR",
                    help="where the daemon's runtime and state dirs go (/dev/shm: tmpfs, as "
                         "/run is on a real node; default: the system's temp dir)")
    ap.add_argument("--mix", action="store_true",
                    help="also measure status/jobs/bind/unbind mixed (own sleeping processes)")
    args = ap.parse_args()

    daemon: Daemon | None = None
    results = []
    try:
        if args.socket:
            path, pid = args.socket, args.pid
        else:
            daemon = Daemon('[policy]\nname = "bench"\n', root=args.root,
                            metrics="127.0.0.1:0" if args.metrics else "off")
            path, pid = str(daemon.socket), daemon.pid
        for cmd in ("ping", "status"):
            r = measure(path, pid, cmd, args.clients, args.procs, args.warmup, args.seconds,
                        args.reconnect)
            results.append(r)
        if args.mix:
            sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(args.clients)]
            try:
                results.append(measure(path, pid, "mix", args.clients, args.procs,
                                       args.warmup, args.seconds, args.reconnect,
                                       [s.pid for s in sleepers]))
            finally:
                for s in sleepers:  # ours, by pid
                    s.kill()
                    s.wait()
    finally:
        if daemon is not None:
            daemon.stop()
    mode = "new connection per request" if args.reconnect else "one connection per client"
    print(f"{args.clients} clients in {args.procs} processes, closed loop, {mode}; "
          f"{args.seconds:g} s measured after {args.warmup:g} s warm-up; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'cmd':8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>7} "
          f"{'daemon CPU ms/1k req':>21} {'daemon CPU %':>13}")
    for r in results:
        print(f"{r['cmd']:8} {r['requests_per_s']:9.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['max_ms'] or 0:8.2f} {r['errors']:7d} "
              f"{r.get('daemon_cpu_ms_per_1000_requests', float('nan')):21.1f} "
              f"{r.get('daemon_cpu_percent', float('nan')):13.1f}")
        for s in r.get("error_samples", []):
            print(f"  error: {s}")
        if "p99_ms_by_cmd" in r:
            print("  p99 ms by command: " + ", ".join(f"{k} {v:.2f}"
                                                      for k, v in r["p99_ms_by_cmd"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    status = next(r for r in results if r["cmd"] == "status")
    ok = status["requests_per_s"] >= 2000 and status["p99_ms"] <= 200 and not status["errors"]
    print(f"target (status >= 2,000 req/s, p99 <= 200 ms, no errors): "
          f"{'met' if ok else 'NOT met'} on this run")
    for mix in (r for r in results if r["cmd"] == "mix"):
        ok = mix["requests_per_s"] >= 2000 and mix["p99_ms"] <= 200 and not mix["errors"]
        print(f"target (mixed status/jobs/bind/unbind >= 2,000 replies/s, p99 <= 200 ms, "
              f"no errors): {'met' if ok else 'NOT met'} on this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
