"""bind/unbind on absent and out-of-range PIDs, as an ordinary user (issue 28, found 4).

``--clients`` processes, each dropped to ``--uid`` (default: the ``tunerd-test`` user
or 65534), send ``--requests`` requests in all over their own connections, pipelined
in batches of ``--batch``: bind and unbind in turn, for PIDs no process has (within the
kernel's range: above pid_max) and PIDs past it (10^12 and up), half each. Reported:
requests per second over the whole stream, the replies by error code, internal errors,
and the lines the daemon logged meanwhile. Target (issue 28): >= 20,000 requests/s,
0 internal errors, < 100 log lines for 20,000 requests. Needs root (it starts a daemon
and drops privileges). The daemon runs the tunerd that ``PYTHONPATH`` names, so the
same script measures an older tree as the baseline:

    PYTHONPATH=/path/to/old python bench/hostile_pids.py --json old.json
    python bench/hostile_pids.py [--requests 20000] [--clients 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pwd
import socket
import time

from _leases_common import Daemon, write_json

OUT_OF_RANGE = 10**12


def pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def client(sock: str, uid: int, first: int, n: int, batch: int, absent: int,
           start: mp.synchronize.Event, q: mp.Queue) -> None:  # type: ignore[type-arg]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    f = s.makefile("rb")
    codes: dict[str, int] = {}
    internal = 0
    start.wait()
    for lo in range(0, n, batch):
        k = min(batch, n - lo)
        lines = []
        for i in range(lo, lo + k):
            j = first + i
            pid = absent + j % 100_000 if j % 2 else OUT_OF_RANGE + j
            lines.append(json.dumps({"id": i, "cmd": "bind" if j % 4 < 2 else "unbind",
                                     "args": {"pid": pid, "cpus": "0"}}).encode() + b"\n")
        s.sendall(b"".join(lines))
        for _ in range(k):
            r = json.loads(f.readline())
            code = "ok" if r.get("ok") else r["error"]["code"]
            codes[code] = codes.get(code, 0) + 1
            if not r.get("ok") and "internal error" in r["error"]["message"]:
                internal += 1
    q.put((codes, internal))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--uid", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.uid is None:
        try:
            args.uid = pwd.getpwnam("tunerd-test").pw_uid
        except KeyError:
            args.uid = 65534
    absent = min(pid_max(), 4_194_304 - 100_000)  # no process has a PID >= pid_max
    with Daemon('[policy]\nname = "hostile"\n') as d:
        lines_before = (d.tmp / "log").read_bytes().count(b"\n")
        per = args.requests // args.clients
        start = mp.Event()
        q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        procs = [mp.Process(target=client, args=(str(d.socket), args.uid, k * per, per,
                                                 args.batch, absent, start, q))
                 for k in range(args.clients)]
        for p in procs:
            p.start()
        time.sleep(0.5)  # connected
        t0 = time.monotonic()
        start.set()
        results = [q.get(timeout=300) for _ in procs]
        took = time.monotonic() - t0
        for p in procs:
            p.join(30)
        time.sleep(0.2)
        lines = (d.tmp / "log").read_bytes().count(b"\n") - lines_before
    codes: dict[str, int] = {}
    for c, _ in results:
        for k, v in c.items():
            codes[k] = codes.get(k, 0) + v
    n = per * args.clients
    internal = sum(i for _, i in results)
    out = {"requests": n, "seconds": round(took, 3), "rate_per_s": round(n / took),
           "codes": codes, "internal_errors": internal, "log_lines": lines,
           "target": ">= 20000/s, 0 internal errors, < 100 log lines",
           "ok": n / took >= 20_000 and internal == 0 and lines < 100}
    print(json.dumps(out, indent=1))
    if args.json:
        write_json(args.json, out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
