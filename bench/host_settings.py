"""Benchmark: host settings — uevent-to-MTU latency, apply and verify of a 50-setting policy.

Runs everything inside a network namespace it creates (deleted at the end), with
the real daemon started by `ip netns exec`. The measuring half re-executes this
script inside the namespace (`--inner`), because /sys/class/net shows a
namespace's devices only to processes in it.

1. uevent -> MTU: `ip link add vethbN type veth ...` 50 times; from the return of
   `ip link add` to /sys/class/net/vethbN/mtu reading 9000 (polled in a tight loop).
   Baseline: the same script setting the MTU itself with `ip link set mtu 9000`.
2. apply / verify of a 50-setting policy (10 net.* sysctls + MTU and txqueuelen of
   20 veths) through the daemon's socket, vs. the same 50 writes (or reads) done by a
   plain Python loop and by `sysctl -w` + `ip -batch` (what an operator script does).

    python bench/host_settings.py [--n 50] [--rounds 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SYSCTLS = {  # per-namespace sysctls: value A (policy) / value B (reset between rounds)
    "net.core.somaxconn": ("1111", "4096"),
    "net.ipv4.tcp_rmem": ("4096 87380 268435456", "4096 131072 6291456"),
    "net.ipv4.tcp_wmem": ("4096 65536 268435456", "4096 16384 4194304"),
    "net.ipv4.tcp_fin_timeout": ("17", "60"),
    "net.ipv4.tcp_keepalive_time": ("333", "7200"),
    "net.ipv4.tcp_max_syn_backlog": ("2222", "1024"),
    "net.ipv4.ip_local_port_range": ("20000 60000", "32768 60999"),
    "net.ipv4.tcp_mtu_probing": ("1", "0"),
    "net.ipv4.tcp_slow_start_after_idle": ("0", "1"),
    "net.ipv4.tcp_no_metrics_save": ("1", "0"),
}
N_PAIRS = 10  # 20 veths x (mtu, txqueuelen) = 40 NIC settings + 10 sysctls = 50
NIC = {"mtu": ("9000", "1500"), "tx_queue_len": ("5000", "1000")}


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return {"median_ms": round(statistics.median(xs) * 1e3, 3), "p95_ms": round(p95 * 1e3, 3),
            "n": len(xs)}


def policy_text() -> str:
    lines = ["[policy]", 'name = "bench"', "[sysctl]"]
    lines += [f'"{k}" = "{a}"' for k, (a, _) in SYSCTLS.items()]
    lines += ["[[nic]]", 'match = "veth*"', "mtu = 9000", "txqueuelen = 5000"]
    return "\n".join(lines) + "\n"


# -- inside the namespace ---------------------------------------------------------------
def sysctl_file(name: str) -> Path:
    return Path("/proc/sys", *name.split("."))


def settings(which: int) -> dict[Path, str]:
    """The 50 (file, value) pairs: which=0 policy values, 1 the reset values."""
    out = {sysctl_file(k): v[which] for k, v in SYSCTLS.items()}
    for i in range(N_PAIRS):
        for ifname in (f"veth{i}a", f"veth{i}b"):
            for attr, vals in NIC.items():
                out[Path("/sys/class/net", ifname, attr)] = vals[which]
    return out


def write_all(values: dict[Path, str]) -> None:
    for path, v in values.items():
        with open(path, "w") as f:
            f.write(v)


def shell_baseline(which: int) -> None:
    """`sysctl -w` for the sysctls, one `ip -batch` for the 40 link settings."""
    subprocess.run(["sysctl", "-q", "-w", *(f"{k}={v[which]}" for k, v in SYSCTLS.items())],
                   check=True)
    batch = "".join(f"link set dev veth{i}{s} mtu {NIC['mtu'][which]} txqueuelen "
                    f"{NIC['tx_queue_len'][which]}\n" for i in range(N_PAIRS) for s in "ab")
    subprocess.run(["ip", "-batch", "-"], input=batch, text=True, check=True)


def inner(sock: str, n: int, rounds: int) -> dict[str, Any]:
    from tunerd.wire.client import Client

    client = Client(sock)
    res: dict[str, Any] = {}

    # 1. uevent -> applied MTU
    lat, base = [], []
    for i in range(n):
        ifname = f"vethb{i}"
        subprocess.run(["ip", "link", "add", ifname, "type", "veth", "peer", "name", f"pb{i}"],
                       check=True)
        t0 = time.perf_counter()
        mtu = Path("/sys/class/net", ifname, "mtu")
        while True:
            try:
                if mtu.read_bytes() == b"9000\n":
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > 10:
                raise RuntimeError(f"{ifname}: MTU not applied in 10 s")
        lat.append(time.perf_counter() - t0)
        # baseline: the script sets the MTU of the peer itself
        t0 = time.perf_counter()
        subprocess.run(["ip", "link", "set", "dev", f"pb{i}", "mtu", "9000"], check=True)
        base.append(time.perf_counter() - t0)
    for i in range(n):  # leave exactly the 50 settings below in the policy's reach
        subprocess.run(["ip", "link", "del", f"vethb{i}"], check=True)
    res["uevent_to_mtu"] = stats(lat)
    res["baseline_ip_link_set_mtu"] = stats(base)

    # 2. apply and verify of 50 settings
    policy_vals, reset_vals = settings(0), settings(1)
    assert len(policy_vals) == 50, len(policy_vals)
    t_apply, t_loop, t_shell, t_verify, t_read = [], [], [], [], []
    for _ in range(rounds):
        write_all(reset_vals)
        t0 = time.perf_counter()
        r = client.call("apply")
        t_apply.append(time.perf_counter() - t0)
        if len(r["changed"]) != 50 or r["errors"]:
            raise RuntimeError(f"apply changed {len(r['changed'])}, errors {r['errors']}")
        t0 = time.perf_counter()
        v = client.call("verify")
        t_verify.append(time.perf_counter() - t0)
        if v["drift"] or v["checked"] != 50:
            raise RuntimeError(f"drift after apply: {v['drift']}")
        t0 = time.perf_counter()
        ok = all(" ".join(p.read_text().split()) == val for p, val in policy_vals.items())
        t_read.append(time.perf_counter() - t0)
        assert ok
        write_all(reset_vals)
        t0 = time.perf_counter()
        write_all(policy_vals)
        t_loop.append(time.perf_counter() - t0)
        write_all(reset_vals)
        t0 = time.perf_counter()
        shell_baseline(0)
        t_shell.append(time.perf_counter() - t0)
    res["apply_50_daemon"] = stats(t_apply)
    res["baseline_apply_50_python_loop"] = stats(t_loop)
    res["baseline_apply_50_sysctl_w_ip_batch"] = stats(t_shell)
    res["verify_50_daemon"] = stats(t_verify)
    res["baseline_verify_50_python_reads"] = stats(t_read)
    client.call("revert")
    return res


# -- outside: namespace, daemon ------------------------------------------------------------
def outer(n: int, rounds: int) -> dict[str, Any]:
    ns = f"tunerd-bench-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="tunerd-bench-"))
    subprocess.run(["ip", "netns", "add", ns], check=True)
    proc = None
    try:
        for i in range(N_PAIRS):
            subprocess.run(["ip", "-n", ns, "link", "add", f"veth{i}a", "type", "veth", "peer",
                            "name", f"veth{i}b"], check=True)
        (tmp / "pol").mkdir()
        (tmp / "pol/bench.toml").write_text(policy_text())
        (tmp / "etc").mkdir()
        (tmp / "tunerd.toml").write_text(f'etc_root = "{tmp / "etc"}"\nverify_interval = 600\n')
        sock = tmp / "run/tunerd.sock"
        with open(tmp / "tunerd.log", "wb") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "tunerd.daemon.main",
                 "--config", str(tmp / "tunerd.toml"), "--policy-dir", str(tmp / "pol"),
                 "--runtime-dir", str(tmp / "run"), "--state-dir", str(tmp / "state"),
                 "--metrics-listen", "off", "--log-level", "warning",
                 "--scope-pid", str(os.getpid())],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / "tunerd.log").read_text())
            time.sleep(0.05)
        time.sleep(0.5)  # let the start-up apply finish
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, __file__, "--inner", str(sock),
             "--n", str(n), "--rounds", str(rounds)],
            cwd=REPO, check=True, capture_output=True, text=True)
        return json.loads(out.stdout)  # type: ignore[no-any-return]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50, help="veth creations (default 50)")
    ap.add_argument("--rounds", type=int, default=20, help="apply/verify rounds (default 20)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--inner", metavar="SOCKET", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        print(json.dumps(inner(args.inner, args.n, args.rounds)))
        return 0
    res = outer(args.n, args.rounds)
    ratio = {
        "uevent_vs_ip_link_set": res["uevent_to_mtu"]["median_ms"]
        / res["baseline_ip_link_set_mtu"]["median_ms"],
        "apply_vs_python_loop": res["apply_50_daemon"]["median_ms"]
        / res["baseline_apply_50_python_loop"]["median_ms"],
        "apply_vs_sysctl_ip_batch": res["apply_50_daemon"]["median_ms"]
        / res["baseline_apply_50_sysctl_w_ip_batch"]["median_ms"],
        "verify_vs_python_reads": res["verify_50_daemon"]["median_ms"]
        / res["baseline_verify_50_python_reads"]["median_ms"],
    }
    res["ratios"] = {k: round(v, 2) for k, v in ratio.items()}
    for k, v in res.items():
        if k != "ratios":
            print(f"{k:40s} median {v['median_ms']:8.3f} ms   p95 {v['p95_ms']:8.3f} ms"
                  f"   (n={v['n']})")
    for k, v in res["ratios"].items():
        print(f"ratio {k:34s} {v:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
