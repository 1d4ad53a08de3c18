"""Helpers for the leases / automatic-binding tests (real daemon, real processes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tests.helpers import FIXTURES, DaemonProc, write_policy

DGX_H100 = FIXTURES / "topologies" / "dgx-h100.json"


def cpus_allowed(pid: int) -> str | None:
    """Cpus_allowed_list of /proc/PID/status (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def unique_sleeper(tmp: Path, name: str) -> Path:
    """A copy of sleep(1) under a test-unique name, so rules match only our processes."""
    p = tmp / name
    shutil.copy("/bin/sleep", p)
    p.chmod(0o755)
    return p


def spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait()


def descendants(pid: int) -> list[int]:
    """PIDs of the children, grandchildren... of ``pid`` (from /proc/PID/task/*/children)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *descendants(k)]
    return out


def kill_pids(pids: Iterable[int]) -> None:
    """SIGKILL each of these PIDs (processes this test started), gone ones skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_tree(p: subprocess.Popen[bytes]) -> None:
    """Kill a process this test started and every process it started, by PID."""
    kids = descendants(p.pid)
    kill(p)
    kill_pids(kids)


def ppid(pid: int) -> int:
    """The parent of ``pid`` (field 4 of /proc/PID/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def environ(pid: int) -> dict[str, str]:
    """/proc/PID/environ as a dict (values decoded with replacement)."""
    out = {}
    for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        k, sep, v = kv.partition(b"=")
        if sep:
            out[k.decode()] = v.decode(errors="replace")
    return out


def local_ranks(top: int, script: Path, n: int | None = None) -> dict[int, int] | None:
    """local rank -> pid of the processes under ``top`` running ``script`` with LOCAL_RANK
    in their environment (a ``numactl`` about to exec the rank is not it yet); with
    ``n``, None until there are exactly ``n``."""
    out: dict[int, int] = {}
    for pid in descendants(top):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(script).encode() in argv and argv[0] != b"numactl":
            for kv in env:
                if kv.startswith(b"LOCAL_RANK="):
                    out[int(kv.split(b"=", 1)[1])] = pid
    return out if n is None or len(out) == n else None


def rule_policy(directory: Path, body: str) -> Path:
    write_policy(directory, "00-test.toml", '[policy]\nname = "test"\n\n' + body)
    return directory


def scope_bundled_rule(directory: Path, var: str, token: str,
                       rule: str = "torch-training") -> Path:
    """A policy file, read after the others (zz-), that narrows the bundled [[job]]
    ``rule`` to processes with ``var=token`` in their environment: rules of one name
    merge and match.env tables merge key by key, so the rule keeps the rest of its
    match. The machine is shared: the rule must not bind anyone else's training job."""
    return write_policy(directory, "zz-test-scope.toml", f"""\
# only narrows the bundled rule {rule!r} to this test's processes
[policy]
name = "test-scope"

[[job]]
name = "{rule}"
match.env = {{ {var} = "{token}" }}
""")


def leases_of(d: DaemonProc) -> list[dict[str, Any]]:
    r = d.ctl("--json", "leases")
    assert r.rc == 0, r.err
    out: list[dict[str, Any]] = r.json()
    return out


def autobind_status(d: DaemonProc) -> dict[str, Any]:
    r = d.ctl("--json", "status")
    out: dict[str, Any] = r.json()["services"]["autobind"]
    return out


def open_path_for_others(path: Path) -> None:
    """Let another user reach ``path`` (a socket in a test tmp dir): o+x on its test dirs.

    Only directories under pytest's own temporary root are touched.
    """
    p = path if path.is_dir() else path.parent
    for d in [p, *p.parents]:
        if not d.name.startswith("pytest-") and "pytest-of-" not in str(d):
            break
        d.chmod(d.stat().st_mode | 0o011)
        if d.name.startswith("pytest-of-"):
            break


def _snapshot_here(path: Path, near: Callable[[list[int]], list[int]],
                   links: list[dict[str, Any]], hostname: str) -> list[int]:
    """This machine's real topology plus recorded GPUs (DGX H100's), GPU i local to CPU
    ``near(cpus)[i]`` and on its NUMA node, written to ``path``: every CPU of the snapshot
    exists here, so placements on it are really applied. Returns those CPUs."""
    import json

    from tunerd.topology import load_topology

    j = load_topology().to_json()
    cpus = near(sorted(c["id"] for c in j["cpus"]))
    node = {c["id"]: c["numa_node"] for c in j["cpus"]}
    tmpl = json.loads(DGX_H100.read_text())["gpus"][0]
    j["gpus"] = [{**tmpl, "index": i, "uuid": f"GPU-test-{i}",
                  "pci_bus_id": f"0000:{i + 1:02x}:00.0", "numa_node": node[c],
                  "local_cpus": str(c)} for i, c in enumerate(cpus)]
    j["links"] = links
    j["hostname"] = hostname
    path.write_text(json.dumps(j))
    return cpus


def snapshot_with_gpus_here(path: Path) -> tuple[Path, int, int]:
    """This machine's real topology plus two recorded GPUs, one local to each end CPU.

    Every CPU of the snapshot exists here, so placements on it are really
    applied; returns (snapshot path, CPU local to GPU 0, CPU local to GPU 1).
    """
    lo, hi = _snapshot_here(path, lambda cpus: [cpus[0], cpus[-1]],
                            [{"a": 0, "b": 1, "kind": "NVLINK", "nvlinks": 18, "pcie": "NODE"}],
                            "this-machine-with-2-gpus")
    return path, lo, hi


def snapshot_with_8_gpus_here(path: Path) -> Path:
    """This machine's real topology plus 8 recorded GPUs (DGX H100's), GPU i on the NUMA
    node of the CPU i/8 of the way along: every CPU exists here, so binds are applied."""
    _snapshot_here(path, lambda cpus: [cpus[i * len(cpus) // 8] for i in range(8)], [],
                   "this-machine-with-8-gpus")
    return path
