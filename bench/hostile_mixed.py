"""Another user's round trip under the mixed hostile load of issue 34 item 8.

One ordinary user (``tunerd-test``, or 65534) at once:

* streams bind/unbind for PIDs no process has and PIDs past the kernel's range, on
  ``--clients`` connections pipelined in batches of ``--batch`` (bench/hostile_pids.py);
* in a user+PID namespace of her own (``unshare -Upf``) binds and unbinds her own
  sleeping processes, by the PIDs she knows them by, on 4 connections pipelined.

Meanwhile root pings every 20 ms on a connection of its own: reported are the median
and the worst of those round trips (target: worst < 250 ms) and the seconds the load
took. The daemon runs the tunerd that ``PYTHONPATH`` names: for the baseline run it
from a checkout of the older tree, in the same session:

    (cd /path/to/old && PYTHONPATH=$PWD python bench/hostile_mixed.py --json old.json)
    python bench/hostile_mixed.py [--requests 20000] [--sleepers 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _hostile_common import add_stream_args, resolve_uid, start_clients
from _leases_common import Daemon, write_json

from tunerd.wire.client import Client

# inside her namespaces: N sleepers; 4 connections each bind then unbind every one of
# them, R rounds, pipelined; prints the reply codes
OWN = r"""
import json, socket, subprocess, sys, threading
sock, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kids = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
codes = {}
def go(k):
    s = socket.socket(socket.AF_UNIX); s.connect(sock); s.settimeout(300)
    f = s.makefile("rb")
    mine = kids[k::4]
    for _ in range(rounds):
        for cmd in ("bind", "unbind"):
            s.sendall(b"".join(json.dumps({"cmd": cmd, "args": {"pid": p.pid, "cpus": "0"}}
                                          ).encode() + b"\n" for p in mine))
            for _ in mine:
                r = json.loads(f.readline()); c = "ok" if r["ok"] else r["error"]["code"]
                codes[c] = codes.get(c, 0) + 1
ts = [threading.Thread(target=go, args=(k,)) for k in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"codes": codes}), flush=True)
for k in kids: k.kill()
"""


def _probe(sock: str, stop: threading.Event, rtts: list[float]) -> None:
    with Client(sock, timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.call("ping")
            rtts.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)


def _own_namespace(sock: str, uid: int, script: Path, n: int,
                   rounds: int) -> subprocess.Popen[str]:
    return subprocess.Popen(["unshare", "-Upf", "--mount-proc", sys.executable, str(script),
                             sock, str(n), str(rounds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, user=uid, group=uid,
                            extra_groups=[], cwd="/")


def run(args: argparse.Namespace) -> dict[str, object]:
    script = Path(tempfile.mkdtemp(prefix="tunerd-bench-")) / "own.py"
    script.parent.chmod(0o755)
    script.write_text(OWN)
    script.chmod(0o644)
    with Daemon('[policy]\nname = "hostile"\n') as d:
        sock = str(d.socket)
        own = _own_namespace(sock, args.uid, script, args.sleepers, args.rounds)
        assert own.stdout is not None and own.stdin is not None
        assert json.loads(own.stdout.readline())["ready"]
        start, q, procs, _ = start_clients(sock, args)
        stop, rtts = threading.Event(), []  # type: ignore[var-annotated]
        probe = threading.Thread(target=_probe, args=(sock, stop, rtts))
        probe.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        start.set()
        own.stdin.write("go\n")
        own.stdin.flush()
        pids_codes = [q.get(timeout=300)[0] for _ in procs]
        own_codes = json.loads(own.stdout.readline())["codes"]
        took = time.monotonic() - t0
        stop.set()
        probe.join(60)
        for p in procs:
            p.join(30)
        own.wait(30)
    rtts.sort()
    return {"seconds": round(took, 2), "probe_median_ms": round(rtts[len(rtts) // 2], 2),
            "probe_worst_ms": round(rtts[-1], 1), "probes": len(rtts),
            "own_namespace_codes": own_codes, "pid_codes": pids_codes,
            "load_average": os.getloadavg()[0], "target": "probe worst < 250 ms",
            "ok": rtts[-1] < 250}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stream_args(ap)
    ap.add_argument("--sleepers", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    resolve_uid(args)
    out = run(args)
    print(json.dumps(out, indent=1))
    write_json(args.json, out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
