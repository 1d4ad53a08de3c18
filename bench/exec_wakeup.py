"""The floor under exec -> bound on this machine: how long after an exec a thread blocked
in a read of the proc connector runs, with no daemon and no Python work in between.

The kernel stamps each proc-connector event (CLOCK_MONOTONIC, ns); a thread of this
process blocked in ``recv`` (as tunerd's exec watcher is) notes the clock when the read
returns. The launcher starts processes as bench/autobind.py does (subprocess.Popen, which
returns once the child has exec'd), 50 ms apart and back to back, and also notes when
Popen returned: bench/autobind.py counts from there, so "wake-up after Popen returned" is
the part of its figure no daemon can avoid.

    python bench/exec_wakeup.py [--n 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _leases_common import summary

from tunerd.watch.proc_connector import PROC_EVENT_EXEC, ProcConnector

_OFF_WHAT, _OFF_TS, _OFF_TGID = 36, 44, 56


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    conn = ProcConnector(PROC_EVENT_EXEC)
    conn.open()
    sock = conn.sock()
    sock.setblocking(True)
    sock.settimeout(None)
    woke: dict[int, tuple[int, int]] = {}  # tgid -> (event ns, thread ran ns)
    stop = False

    def reader() -> None:
        buf = bytearray(4096)
        while not stop:
            try:
                n = sock.recv_into(buf)
            except OSError:
                continue
            now = time.monotonic_ns()
            if n < 60 or struct.unpack_from("I", buf, _OFF_WHAT)[0] != PROC_EVENT_EXEC:
                continue
            ts, = struct.unpack_from("Q", buf, _OFF_TS)
            tgid, = struct.unpack_from("i", buf, _OFF_TGID)
            woke[tgid] = (ts, now)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-wakeup-"))
    exe = tmp / f"wakeup_{os.getpid()}"
    shutil.copy("/bin/sleep", exe)
    out: dict[str, Any] = {}
    try:
        for name, gap in (("50 ms apart", 0.05), ("back to back", 0.0)):
            popen_ret: dict[int, int] = {}
            for _ in range(a.n):
                if gap:
                    time.sleep(gap)
                p = subprocess.Popen([str(exe), "30"])
                popen_ret[p.pid] = time.monotonic_ns()
                deadline = time.monotonic() + 1
                while p.pid not in woke and time.monotonic() < deadline:
                    time.sleep(0.0001)
                p.kill()
                p.wait()
            ev_to_thread = [(woke[p][1] - woke[p][0]) / 1e6 for p in popen_ret if p in woke]
            after_popen = [(woke[p][1] - popen_ret[p]) / 1e6 for p in popen_ret if p in woke]
            ev_to_popen = [(popen_ret[p] - woke[p][0]) / 1e6 for p in popen_ret if p in woke]
            out[name] = {"exec_event_to_thread_ms": summary(ev_to_thread),
                         "thread_after_popen_returned_ms": summary(after_popen),
                         "popen_returned_after_exec_event_ms": summary(ev_to_popen),
                         "missed": a.n - len(ev_to_thread)}
    finally:
        stop = True
        conn.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exec -> a thread blocked in a proc-connector read runs ({a.n} starts each; "
          f"load {os.getloadavg()[0]:.2f}):")
    for name, r in out.items():
        e, w, q = (r["exec_event_to_thread_ms"], r["thread_after_popen_returned_ms"],
                   r["popen_returned_after_exec_event_ms"])
        print(f"  {name:13}: event -> thread median {e['median']:.3f} ms, p99 {e['p99']:.3f};"
              f" thread after Popen returned median {w['median']:.3f}, p99 {w['p99']:.3f};"
              f" Popen returned after the event median {q['median']:.3f}; "
              f"missed {r['missed']}")
    if a.json:
        import json
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
