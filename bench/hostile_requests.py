"""Daemon memory under a hostile request stream (issue 16, found 3): RSS growth per request.

``--clients`` connections send ``--requests`` bind/unbind requests in all, each for a
PID that does not exist (a new one each time), as fast as they can. Measured from
outside, VmRSS of /proc/PID/status: after a warm-up of 2,000 requests (the baseline,
in the same run), then after the stream. Reports the growth in bytes, per request, and
the request rate. Target (issue 16): 400,000 requests grow the daemon by < 5 MiB.
Needs root (it starts a daemon).

    python bench/hostile_requests.py [--requests 400000] [--clients 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from _leases_common import Daemon, write_json

from tunerd.base.errors import TunerdError
from tunerd.wire.client import Client

PID_BASE = 5_000_000  # above PID_MAX_LIMIT (4,194,304): none of them exists


def vmrss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def stream(sock: str, first: int, n: int, refused: list[int]) -> None:
    got = 0
    with Client(sock, timeout=60) as c:
        for i in range(n):
            try:
                c.call("bind" if i % 2 else "unbind", pid=first + i, cpus="0")
            except TunerdError:
                got += 1
    refused.append(got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with Daemon('[policy]\nname = "hostile"\n') as d:
        sock = str(d.socket)
        stream(sock, PID_BASE, 2000, [])
        base = vmrss(d.proc.pid)
        per = args.requests // args.clients
        refused: list[int] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=stream, args=(sock, PID_BASE + 10_000 + k * per,
                                                         per, refused))
                   for k in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        after = vmrss(d.proc.pid)
    n = per * args.clients
    out = {"requests": n, "refused": sum(refused), "seconds": round(took, 1),
           "rate_per_s": round(n / took), "rss_before": base, "rss_after": after,
           "growth_bytes": after - base, "bytes_per_request": round((after - base) / n, 2),
           "target_growth_bytes": 5 << 20, "ok": after - base < (5 << 20)}
    print(json.dumps(out, indent=1))
    if args.json:
        write_json(args.json, out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
