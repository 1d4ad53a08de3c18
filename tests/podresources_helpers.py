"""A fake kubelet: a real gRPC server on a unix socket replaying recorded PodResources
answers (tests/fixtures/podresources/*.json, encoded here to the v1 wire format), and a
process that looks like a container (in a kubepods cgroup, chrooted into a root with
the pod's hostname and namespace files, running as an unprivileged user).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

FIXTURES = Path(__file__).parent / "fixtures" / "podresources"


# -- protobuf encoding (the kubelet's side; tunerd only decodes) -----------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(num: int, data: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _packed(num: int, ints: list[int]) -> bytes:
    return _ld(num, b"".join(_varint(i) for i in ints)) if ints else b""


def _devices(d: dict[str, Any]) -> bytes:
    out = _ld(1, d["resource_name"].encode())
    out += b"".join(_ld(2, i.encode()) for i in d["device_ids"])
    nodes = (d.get("topology") or {}).get("nodes") or []
    if nodes:
        out += _ld(3, b"".join(_ld(1, _varint(1 << 3 | 0) + _varint(n["ID"])) for n in nodes))
    return out


def encode_list(answer: dict[str, Any]) -> bytes:
    out = b""
    for p in answer["pod_resources"]:
        pod = _ld(1, p["name"].encode()) + _ld(2, p["namespace"].encode())
        for c in p.get("containers", []):
            ctr = _ld(1, c["name"].encode())
            ctr += b"".join(_ld(2, _devices(d)) for d in c.get("devices", []))
            ctr += _packed(3, c.get("cpu_ids", []))
            pod += _ld(3, ctr)
        out += _ld(1, pod)
    return out


def _cpus(ranges: list[str]) -> list[int]:
    out: list[int] = []
    for r in ranges:
        a, _, b = r.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def encode_allocatable(answer: dict[str, Any]) -> bytes:
    return (b"".join(_ld(1, _devices(d)) for d in answer["devices"])
            + _packed(2, _cpus(answer["cpu_ranges"])))


def recorded(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / name).read_text()))


class FakeKubelet:
    """``/v1.PodResourcesLister`` on a unix socket; counts calls; can be told to fail."""

    def __init__(self, socket_path: Path, list_answer: dict[str, Any]) -> None:
        self.socket_path = socket_path
        self.list_answer = list_answer
        self.calls: dict[str, int] = {"List": 0, "GetAllocatableResources": 0}
        self.fail = False
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(self._list),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(self._alloc),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),))
        self.server.add_insecure_port(f"unix://{socket_path}")

    def _count(self, name: str, ctx: Any) -> None:
        with self._lock:
            self.calls[name] += 1
        if self.fail:
            ctx.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")

    def _list(self, request: bytes, ctx: Any) -> bytes:
        self._count("List", ctx)
        return encode_list(self.list_answer)

    def _alloc(self, request: bytes, ctx: Any) -> bytes:
        self._count("GetAllocatableResources", ctx)
        return encode_allocatable(recorded("allocatable.json"))

    def __enter__(self) -> FakeKubelet:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


# The container: joins the cgroup (before exec), then chroots into its root and drops
# to the unprivileged user, and waits.
CONTAINER = r"""
import os, sys, time
os.chroot(sys.argv[1]); os.chdir("/")
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
print("ready", flush=True)
time.sleep(600)
"""


def container_root(base: Path, hostname: str, namespace: str) -> Path:
    root = base / f"root-{hostname}"
    sa = root / "var" / "run" / "secrets" / "kubernetes.io" / "serviceaccount"
    sa.mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text(hostname + "\n")
    (sa / "namespace").write_text(namespace)
    for d in [root, *root.rglob("*")]:
        d.chmod(0o755 if d.is_dir() else 0o644)
    return root


@contextlib.contextmanager
def container(cgroup: Path, root: Path, uid: int, gid: int,
              env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    def join() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    p = subprocess.Popen([sys.executable, "-c", CONTAINER, str(root), str(uid), str(gid)],
                         stdout=subprocess.PIPE, text=True, preexec_fn=join,
                         env={**os.environ, **(env or {})})
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()
