"""Shared by bench/hostile_pids.py and bench/hostile_mixed.py: an ordinary user's stream
of bind/unbind requests for PIDs no process has and PIDs past the kernel's range, on
``--clients`` connections pipelined in batches of ``--batch``."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pwd
import socket

OUT_OF_RANGE = 10**12


def pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def add_stream_args(ap: argparse.ArgumentParser) -> None:
    """--requests, --clients, --batch and --uid (default: ``tunerd-test``, or 65534)."""
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--uid", type=int, default=None)


def resolve_uid(args: argparse.Namespace) -> None:
    if args.uid is None:
        try:
            args.uid = pwd.getpwnam("tunerd-test").pw_uid
        except KeyError:
            args.uid = 65534


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


def start_clients(sock: str, args: argparse.Namespace
                  ) -> tuple[mp.synchronize.Event, mp.Queue, list[mp.Process], int]:  # type: ignore[type-arg]
    """``args.clients`` client processes, started and connected, waiting for the returned
    event; each puts (reply codes, internal errors) on the queue. Also returns the
    requests per client."""
    absent = min(pid_max(), 4_194_304 - 100_000)  # no process has a PID >= pid_max
    per = args.requests // args.clients
    start = mp.Event()
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=client, args=(sock, args.uid, k * per, per, args.batch,
                                             absent, start, q))
             for k in range(args.clients)]
    for p in procs:
        p.start()
    return start, q, procs, per
