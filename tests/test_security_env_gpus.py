"""An ``env`` request's GPU list is bounded by the node's GPUs and deduplicated (issue 34
item 2, the ``env`` part).

With ``[nccl] per_rank_nic = true`` a 1 MiB ``gpus`` list of ``0,0,0,...`` got a 111 MiB
reply, built on the event loop in 2.6 s while another user's round trip waited. Replayed
by the real unprivileged test user against a real daemon on the DGX H100 recording.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_as, write_policy
from tunerd.wire.protocol import MAX_MESSAGE

pytestmark = pytest.mark.root

DGX = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"
POLICY = '[policy]\nname = "nic"\n\n[nccl]\nper_rank_nic = true\n'


def _line(cmd: str, args: dict[str, Any], n: int) -> bytes:
    """A request line whose ``gpus`` holds ``n`` zeros (``0,0,0,...``)."""
    head = json.dumps({"id": 1, "cmd": cmd, "args": args}, separators=(",", ":"))[:-2]
    return (head.encode() + b',"gpus":[' + b"0," * (n - 1) + b"0]}}\n")


def _timed(path: str, lines: list[bytes]) -> list[tuple[float, int, dict[str, Any]]]:
    """(seconds from the last byte sent to the whole reply, reply bytes, reply) each."""
    out = []
    for line in lines:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(path)
        s.sendall(line)
        t0 = time.perf_counter()
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
        out.append((time.perf_counter() - t0, len(buf), json.loads(buf)))
        s.close()
    return out


def test_a_1mib_gpu_list_is_an_error_in_bounded_time(daemon_factory, tmp_path: Path,
                                                     unpriv_user: tuple[int, int]) -> None:
    pdir = tmp_path / "policies"
    write_policy(pdir, "00-nic.toml", POLICY)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(DGX)]).start()
    n = (MAX_MESSAGE - 200) // 2  # ~524,000 zeros: just under the protocol's 1 MiB
    attack = _line("env", {"local_rank": 0}, n)
    # the same line to a command that does not exist: it costs the read and the JSON
    # decode, and nothing else; the difference is the env handler's own work
    base = _line("no-such-command", {"local_rank": 0}, n)
    assert len(attack) <= MAX_MESSAGE
    rounds = run_as(*unpriv_user, _timed, str(d.socket), [attack, base] * 5)
    env = [r for i, r in enumerate(rounds) if i % 2 == 0]
    other = [r for i, r in enumerate(rounds) if i % 2 == 1]
    for _, size, reply in env:
        assert not reply["ok"] and reply["error"]["code"] == "usage", reply
        # refused by the protocol's number cap as it parses (server), or, under that cap,
        # by the env handler's bound of the node's GPUs: either way a short error
        msg = reply["error"]["message"]
        assert ("8 GPU(s)" in msg or "more than 4096 numbers" in msg) and size < 4096, msg
    extra = statistics.median(t for t, _, _ in env) - statistics.median(t for t, _, _ in other)
    print(f"1 MiB env gpus: median {statistics.median(t for t, _, _ in env) * 1000:.1f} ms, "
          f"same size to no command {statistics.median(t for t, _, _ in other) * 1000:.1f} ms")
    assert extra < 0.010, f"the env handler took {extra * 1000:.1f} ms more than decoding"


def test_gpu_lists_are_deduplicated_and_checked(daemon_factory, tmp_path: Path,
                                                unpriv_user: tuple[int, int]) -> None:
    pdir = tmp_path / "policies"
    write_policy(pdir, "00-nic.toml", POLICY)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(DGX)]).start()

    def ask(gpus: list[object]) -> dict[str, Any]:
        line = json.dumps({"id": 1, "cmd": "env", "args": {"gpus": gpus}}).encode() + b"\n"
        return run_as(*unpriv_user, _timed, str(d.socket), [line])[0][2]

    r = ask([5, 5, 5])
    assert r["ok"] and [x["gpu"] for x in r["result"]["nics"]] == [5], r
    assert r["result"]["nic_env"]["NCCL_IB_HCA"] == "=mlx5_5:1"
    r = ask([1, 99])
    assert not r["ok"] and "99" in r["error"]["message"], r
    r = ask([0] * 9)  # more entries than the node's 8 GPUs
    assert not r["ok"] and "9 entries" in r["error"]["message"], r
    r = ask(["0"])
    assert not r["ok"] and r["error"]["code"] == "usage", r
