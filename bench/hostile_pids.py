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
import time

from _hostile_common import add_stream_args, resolve_uid, start_clients
from _leases_common import Daemon, write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stream_args(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    resolve_uid(args)
    with Daemon('[policy]\nname = "hostile"\n') as d:
        lines_before = (d.tmp / "log").read_bytes().count(b"\n")
        start, q, procs, per = start_clients(str(d.socket), args)
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
    write_json(args.json, out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
