"""End-to-end latency of `tunerctl bind` on a 64-thread process, next to Python baselines.

Run as root from the repository root:
    python bench/bind_latency.py [--runs 40] [--json FILE] [--before DIR] [--instructions]

It starts a real tunerd (temporary dirs) and a child with 64 threads, then runs,
interleaved and with the same interpreter:
  pass   python -c pass
  click  python -c "import click"
  bind   tunerctl bind PID --cpus A|B   (human output; alternating sets, so every call
         changes something; an untimed --json bind in between supplies the daemon's times)
  before tunerctl bind from another checkout's tunerd (--before DIR, e.g. a
         `git worktree add DIR main`), against this tree's daemon: a before/after pair
         measured in one run
--instructions also counts each command's user-space instructions under valgrind
(cachegrind, no cache simulation; needs valgrind): the same count on a quiet or a
loaded machine, where wall times are not (it leaves out the kernel and the daemon).
`tunerctl` is the installed console script when there is one on PATH, else the same
entry point the console script calls (python -c 'from tunerd.cli.main import main; main()').
Daemon-side time is the reply's elapsed_ms (whole handler: pidfd pin, validation,
every thread's mask, and the state.json write when there is something new to keep);
apply_ms and save_ms split it. A re-bind keeps the first bind's originals, which are
on disk already, so its state write is deferred; "first bind" (after an unbind) shows
the cost with the synchronous write-ahead save (fsync).
Daemon CPU: the daemon's own CPU time (schedstat of its threads) over the timed loop per
bind there (two per run: the timed and the untimed one), and over the first-bind loop
per unbind + first bind, each loop followed by 0.7 s so that a deferred state save
(0.5 s after a bind) is counted with the bind that caused it.
Targets: bind median <= 1.3 x click; daemon side <= 1 ms for 64 threads.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _leases_common import task_ns

REPO = Path(__file__).resolve().parent.parent
THREADS = 64
CHILD = ("import threading\nev = threading.Event()\n"
         f"for _ in range({THREADS}): threading.Thread(target=ev.wait, daemon=True).start()\n"
         "print('ready', flush=True)\nev.wait()\n")


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "p95": pct(xs, 95), "min": min(xs), "n": len(xs)}


def daemon_cpu_ms(pid: int) -> float:
    """CPU milliseconds of the threads of ``pid`` alive now (/proc/PID/task/*/schedstat)."""
    return task_ns(pid) / 1e6


def tunerctl_argv() -> tuple[list[str], str]:
    exe = shutil.which("tunerctl")
    if exe:
        return [exe], f"installed console script {exe}"
    return ([sys.executable, "-c", "from tunerd.cli.main import main; main()"],
            "python -c 'from tunerd.cli.main import main; main()' (the console script's "
            "entry point; tunerd is not installed here)")


def wait_socket(sock: Path, proc: subprocess.Popen[bytes], log: Path,
                timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"tunerd did not start (rc {proc.poll()}); its output:\n"
                             + log.read_text(errors="replace"))
        time.sleep(0.05)


def instructions(argv: list[str], env: dict[str, str], cwd: Path = REPO) -> int:
    """User-space instructions one run of ``argv`` executes (valgrind's "I refs")."""
    p = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                        "--cachegrind-out-file=/dev/null", *argv],
                       capture_output=True, text=True, env=env, cwd=cwd)
    for line in p.stderr.splitlines():
        if "I refs:" in line or "I   refs:" in line:
            return int(line.rsplit(":", 1)[1].replace(",", "").strip())
    raise SystemExit(f"valgrind gave no instruction count for {argv} ({p.returncode}): "
                     f"{p.stderr[-500:]}")


CPU: dict[str, list[float]] = {}  # label -> the runs' CPU time (user + sys), ms


def timed(argv: list[str], env: dict[str, str], cwd: Path = REPO,
          label: str = "") -> tuple[float, str]:
    """(wall ms, stdout) of one run; with ``label``, its CPU time goes to CPU[label]."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    dt = (time.perf_counter() - t0) * 1000
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{argv} failed ({p.returncode}): {p.stderr}")
    if label:
        CPU.setdefault(label, []).append(
            (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1000)
    return dt, p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--json", dest="json_out", type=Path)
    ap.add_argument("--before", type=Path, metavar="DIR",
                    help="also time `tunerctl bind` run from the tunerd package of this "
                         "checkout (its own client, this tree's daemon)")
    ap.add_argument("--instructions", action="store_true",
                    help="also count user-space instructions under valgrind (3 runs each)")
    args = ap.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind")
    before: Path | None = args.before.resolve() if args.before else None
    if before is not None and not (before / "tunerd" / "cli" / "main.py").is_file():
        raise SystemExit(f"--before {before}: no tunerd/cli/main.py there")
    if os.geteuid() != 0:
        raise SystemExit("run as root (the daemon binds processes)")

    online = (Path("/sys/devices/system/cpu/online").read_text().strip())
    cpus = sorted({int(x) for part in online.split(",")
                   for x in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)})
    if len(cpus) < 2:
        raise SystemExit("needs 2 online CPUs to alternate between")
    half = max(1, len(cpus) // 2)
    sets = [",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))]

    # An installed tunerctl runs from byte-compiled modules; PYTHONDONTWRITEBYTECODE
    # (set in some dev shells) would otherwise make every run compile tunerd from source.
    compileall.compile_dir(str(REPO / "tunerd"), quiet=1)
    if before is not None:
        compileall.compile_dir(str(before / "tunerd"), quiet=1)
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-bench-bind-"))
    (tmp / "policies").mkdir()
    (tmp / "policies" / "00.toml").write_text('[policy]\nname = "bench"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tmp / "tunerd.log"
    with open(log, "wb") as logf:  # shown when the daemon does not start
        daemon = subprocess.Popen(
            [sys.executable, "-m", "tunerd.daemon.main", "--policy-dir", str(tmp / "policies"),
             "--runtime-dir", str(tmp / "run"), "--state-dir", str(tmp / "state"),
             "--metrics-listen", "off", "--log-level", "warning",
             "--scope-pid", str(os.getpid())],
            cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        sock = tmp / "run" / "tunerd.sock"
        wait_socket(sock, daemon, log)
        ctl, how = tunerctl_argv()
        human = [*ctl, "--socket", str(sock), "bind", str(child.pid), "--cpus"]
        as_json = [*ctl, "--socket", str(sock), "--json", "bind", str(child.pid), "--cpus"]
        timed([*as_json, sets[1]], env)  # warm-up (first bind also pins and saves originals)
        results: dict[str, list[float]] = {"pass": [], "click": [], "bind": []}
        # the same entry point, run from the other checkout (cwd and PYTHONPATH: its
        # tunerd is found first); human output, like the timed bind
        old = [sys.executable, "-c", "from tunerd.cli.main import main; main()",
               "--socket", str(sock), "bind", str(child.pid), "--cpus"]
        old_env = {**env, "PYTHONPATH": str(before)} if before is not None else env
        if before is not None:
            results["before"] = []
            timed([*old, sets[0]], old_env, cwd=before)  # warm-up
        daemon_ms: list[float] = []
        apply_ms: list[float] = []
        save_ms: list[float] = []
        threads = 0
        cpu0 = daemon_cpu_ms(daemon.pid)
        for i in range(args.runs):
            results["pass"].append(timed([sys.executable, "-c", "pass"], env, label="pass")[0])
            results["click"].append(
                timed([sys.executable, "-c", "import click"], env, label="click")[0])
            # timed: the human-output command a user or prolog runs
            dt = timed([*human, sets[i % 2]], env, label="bind")[0]
            results["bind"].append(dt)
            back = sets[(i + 1) % 2]
            if before is not None:  # to the other set; the untimed bind moves it back
                results["before"].append(timed([*old, back], old_env, cwd=before,
                                               label="before")[0])
                back = sets[i % 2]
            # untimed: the same operation back to the other set, for the daemon's numbers
            reply: dict[str, Any] = json.loads(timed([*as_json, back], env)[1])
            daemon_ms.append(reply["elapsed_ms"])
            apply_ms.append(reply["apply_ms"])
            save_ms.append(reply["save_ms"])
            threads = reply["threads"]
        time.sleep(0.7)  # a deferred save of the last bind
        cpu_per_bind = (daemon_cpu_ms(daemon.pid) - cpu0) / (2 * args.runs)
        # a first bind (after unbind) also reads every thread's original mask and
        # writes them to state.json with fsync before touching the process
        instr: dict[str, int] = {}
        if args.instructions:
            cases = {"pass": ([sys.executable, "-c", "pass"], env, REPO),
                     "click": ([sys.executable, "-c", "import click"], env, REPO),
                     "bind": (human, env, REPO)}
            if before is not None:
                cases["before"] = (old, old_env, before)
            for k, (argv, e, cwd) in cases.items():
                runs = []
                for i in range(3):
                    tail = [sets[i % 2]] if k in ("bind", "before") else []
                    runs.append(instructions([*argv, *tail], e, cwd))
                instr[k] = int(statistics.median(runs))
        first_ms: list[float] = []
        unbind = [*ctl, "--socket", str(sock), "--json", "unbind", str(child.pid)]
        time.sleep(0.7)
        cpu0 = daemon_cpu_ms(daemon.pid)
        n_first = max(10, args.runs // 3)
        for i in range(n_first):
            timed(unbind, env)
            first_ms.append(json.loads(timed([*as_json, sets[i % 2]], env)[1])["elapsed_ms"])
        time.sleep(0.7)
        cpu_per_first = (daemon_cpu_ms(daemon.pid) - cpu0) / n_first
    finally:
        child.kill()
        child.wait()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)

    out_doc: dict[str, Any] = {
        "tunerctl": how, "before": str(before) if before else None,
        "load_average": os.getloadavg(), "python": sys.executable, "threads": threads,
        "runs": args.runs, "cpu_sets": sets,
        "wall_ms": {k: summary(v) for k, v in results.items()},
        # CPU time of the timed process alone (user + sys): what waiting for a CPU on
        # a loaded machine adds to the wall time is not in it (the daemon's part is not
        # either: that is daemon_ms)
        "cpu_ms": {k: summary(v) for k, v in CPU.items()},
        "daemon_ms": summary(daemon_ms), "apply_ms": summary(apply_ms),
        "save_ms": summary(save_ms), "daemon_first_bind_ms": summary(first_ms),
        "daemon_cpu_ms_per_bind": cpu_per_bind,
        "daemon_cpu_ms_per_unbind_and_first_bind": cpu_per_first,
    }
    if instr:
        out_doc["instructions"] = instr
        out_doc["instructions_ratio_bind_to_click"] = instr["bind"] / instr["click"]
    med = {k: v["median"] for k, v in out_doc["wall_ms"].items()}
    out_doc["ratio_bind_to_click"] = med["bind"] / med["click"]
    out_doc["ratio_bind_to_pass"] = med["bind"] / med["pass"]
    cpu_med = {k: v["median"] for k, v in out_doc["cpu_ms"].items()}
    out_doc["cpu_ratio_bind_to_click"] = cpu_med["bind"] / cpu_med["click"]
    if before is not None:
        out_doc["ratio_before_to_click"] = med["before"] / med["click"]
        out_doc["cpu_ratio_before_to_click"] = cpu_med["before"] / cpu_med["click"]
    out_doc["targets_met"] = {
        "bind_median_le_1.3x_click": out_doc["ratio_bind_to_click"] <= 1.3,
        "daemon_median_le_1ms": out_doc["daemon_ms"]["median"] <= 1.0,
    }

    print(f"tunerctl: {how}")
    print(f"target: {threads} threads, alternating cpus {sets[0]} / {sets[1]}, "
          f"{args.runs} runs each, interleaved")
    print(f"{'':28}{'median':>9}{'p95':>9}{'min':>9}{'cpu med':>9}  (ms)")
    rows = [("pass", "python -c pass"), ("click", 'python -c "import click"'),
            ("bind", "tunerctl bind")]
    if before is not None:
        rows.append(("before", "tunerctl bind (--before)"))
    for k, label in rows:
        s = out_doc["wall_ms"][k]
        print(f"{label:28}{s['median']:9.1f}{s['p95']:9.1f}{s['min']:9.1f}"
              f"{out_doc['cpu_ms'][k]['median']:9.1f}")
    for k, label in (("daemon_ms", "daemon side (elapsed_ms)"), ("apply_ms", "  of which apply"),
                     ("save_ms", "  of which state save"),
                     ("daemon_first_bind_ms", "daemon side, first bind")):
        s = out_doc[k]
        print(f"{label:28}{s['median']:9.3f}{s['p95']:9.3f}{s['min']:9.3f}")
    print(f"daemon CPU: {cpu_per_bind:.2f} ms per re-bind, {cpu_per_first:.2f} ms per unbind "
          "+ first bind (deferred saves included)")
    print(f"bind / click = {out_doc['ratio_bind_to_click']:.2f}x (target <= 1.3x); "
          f"bind / pass = {out_doc['ratio_bind_to_pass']:.2f}x; daemon side median "
          f"{out_doc['daemon_ms']['median']:.3f} ms (target <= 1 ms)")
    print(f"CPU time (user + sys, the process alone): bind / click = "
          f"{out_doc['cpu_ratio_bind_to_click']:.2f}x")
    if before is not None:
        print(f"before ({before}): bind / click = {out_doc['ratio_before_to_click']:.2f}x, "
              f"CPU time {out_doc['cpu_ratio_before_to_click']:.2f}x")
    if instr:
        print("user-space instructions (valgrind, median of 3): "
              + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in instr.items())
              + f"; bind / click = {instr['bind'] / instr['click']:.2f}x"
              + (f", before / click = {instr['before'] / instr['click']:.2f}x"
                 if "before" in instr else ""))
    la = out_doc["load_average"]
    print(f"load average at the end: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(out_doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
