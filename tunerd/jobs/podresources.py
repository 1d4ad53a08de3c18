"""Which GPUs and CPUs the kubelet gave a pod: the PodResources API (v1, GA in 1.28).

The kubelet serves gRPC on ``/var/lib/kubelet/pod-resources/kubelet.sock``
(config key ``pod_resources_socket``); dcgm-exporter and NFD read it the same way:

- ``/v1.PodResourcesLister/List``: per pod (namespace, name) and container, the
  devices (``nvidia.com/gpu`` → GPU UUIDs, ``nvidia.com/mig-*`` → MIG UUIDs) and the
  exclusive ``cpu_ids`` of the static CPU manager;
- ``/v1.PodResourcesLister/GetAllocatableResources``: what the node can give.

The few messages are decoded here by hand (protobuf wire format: tag, varint,
length-delimited), so no generated code and no protobuf runtime is needed; grpcio
carries the raw bytes (a generic unary call without (de)serializers).

Joining a process to its pod. A process shows only its cgroup path, which the
kernel writes and nobody in the pod can change: the pod UID and the container id
(``kubepods/burstable/pod<uid>/<id>``, ``kubepods-burstable-pod<uid>.slice/
cri-containerd-<id>.scope``). ``List`` is keyed by namespace and pod name instead.
The join reads, as root through ``/proc/PID/root``, the pod's hostname
(``/etc/hostname``, which the runtime writes with the pod's name) and namespace (the
service-account volume's ``namespace`` file, which the kubelet projects). Those
files live in the container: they are trusted only when the process does not run as
root (a non-root user cannot rewrite root-owned files that are not writable by it),
and a UID claimed by two different pods is trusted for neither. Where the join
cannot be trusted, the pod gives no allocation and tunerd falls back to the usual
sources (CUDA_VISIBLE_DEVICES, NVML): it only ever narrows, never widens, and the
device cgroup still decides what the pod can open. The CPU side needs no join: the
container's cpuset (read from the cgroup, kernel-enforced) already holds its
exclusive CPUs; ``cpu_ids`` is reported beside it.

Calls: one ``List`` when a process from a pod not seen in the last answer asks
(a new pod is a kubelet change), or after ``invalidate()`` (the cpuset watcher
calls it when the kubelet rewrites a cpuset); never on a timer. A failed call backs
off 1, 2, 4 ... 60 s, keeping the last good answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tunerd.base.jsontypes import JSONObject
from tunerd.topology.model import Topology

__all__ = ["ContainerDevices", "ContainerResources", "PodAllocation", "PodCgroup",
           "PodResources", "PodResourcesSource", "decode_allocatable", "decode_list",
           "pod_allocation", "pod_cgroup"]

log = logging.getLogger("tunerd.jobs.podresources")

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
LIST = "/v1.PodResourcesLister/List"
ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"
CALL_TIMEOUT = 1.0  # seconds; the kubelet answers from memory
MAX_BACKOFF = 60.0
GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-")
# An answer is decoded where a rank is bound (the exec watcher's real-time thread): a
# hostile kubelet's 4 MiB (gRPC's default limit) cost 6.6-9.7 s and ~120 MB there. A
# real node's List is tens of KiB (250 pods x 2 containers x 128 CPUs ~ 70 KiB).
MAX_ANSWER = 512 << 10  # bytes of one answer, gRPC's max_receive_message_length too
MAX_PODS = 4096  # pods of one answer
MAX_ITEMS = 1024  # containers of a pod, devices of a container, ids of a device
MAX_CPU_ID = 1 << 16  # as tunerd.base.cpulist.MAX_ID: a CPU id beyond is no CPU


# -- protobuf wire format -----------------------------------------------------------
class DecodeError(ValueError):
    pass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise DecodeError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value): int for varints (wire type 0), bytes for the
    rest (``_payload`` takes a length-delimited one's)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
            yield num, wt, v
        elif wt == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise DecodeError("truncated field")
            yield num, wt, buf[i:i + n]
            i += n
        elif wt == 1:
            yield num, wt, buf[i:i + 8]
            i += 8
        elif wt == 5:
            yield num, wt, buf[i:i + 4]
            i += 4
        else:
            raise DecodeError(f"wire type {wt} of field {num}")


def _payload(v: int | bytes) -> bytes:
    """A length-delimited field's bytes (its wire type, 2, checked by the caller)."""
    if isinstance(v, int):
        raise DecodeError("a varint where a length-delimited field belongs")
    return v


def _ints(v: int | bytes, limit: int = MAX_CPU_ID) -> list[int]:
    """A repeated int64: packed (one length-delimited run) or one varint per entry; at
    most ``limit`` of them, each below ``limit`` (DecodeError otherwise)."""
    if isinstance(v, int):  # wire type 0
        out = [v]
    else:
        out, i = [], 0
        while i < len(v):
            x, i = _varint(v, i)
            out.append(x)
            if len(out) > limit:
                raise DecodeError(f"more than {limit} ids in one list")
    if any(x >= limit for x in out):
        raise DecodeError(f"an id of {max(out)}, past {limit - 1}")
    return out


def _bounded(items: Sized, what: str, limit: int = MAX_ITEMS) -> None:
    if len(items) > limit:
        raise DecodeError(f"more than {limit} {what}")


@dataclass(frozen=True)
class ContainerDevices:
    resource_name: str
    device_ids: tuple[str, ...]
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ContainerResources:
    name: str
    devices: tuple[ContainerDevices, ...] = ()
    cpu_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PodResources:
    name: str
    namespace: str
    containers: tuple[ContainerResources, ...] = ()


def _devices(buf: bytes) -> ContainerDevices:
    name = ""
    ids: list[str] = []
    numa: list[int] = []
    for num, wt, v in _fields(buf):
        if num == 1 and wt == 2:
            name = _payload(v).decode()
        elif num == 2 and wt == 2:
            ids.append(_payload(v).decode())
            _bounded(ids, "device ids in one container")
        elif num == 3 and wt == 2:  # TopologyInfo { repeated NUMANode nodes = 1 }
            for n2, w2, node in _fields(_payload(v)):
                if n2 == 1 and w2 == 2:  # NUMANode { int64 ID = 1 }: its varints
                    numa += [x for n3, _, x in _fields(_payload(node))
                             if n3 == 1 and isinstance(x, int)]
                    _bounded(numa, "NUMA nodes of one device list")
    return ContainerDevices(name, tuple(ids), tuple(numa))


def _container(buf: bytes) -> ContainerResources:
    name = ""
    devs: list[ContainerDevices] = []
    cpus: list[int] = []
    for num, wt, v in _fields(buf):
        if num == 1 and wt == 2:
            name = _payload(v).decode()
        elif num == 2 and wt == 2:
            devs.append(_devices(_payload(v)))
            _bounded(devs, "device lists in one container")
        elif num == 3:
            cpus += _ints(v)
            _bounded(cpus, "CPU ids in one container", MAX_CPU_ID)
    return ContainerResources(name, tuple(devs), frozenset(cpus))


def decode_list(buf: bytes) -> list[PodResources]:
    """ListPodResourcesResponse { repeated PodResources pod_resources = 1 }; an answer
    past MAX_ANSWER bytes, MAX_PODS pods or MAX_ITEMS of anything in one of them is a
    DecodeError, refused before it is decoded where it can be."""
    if len(buf) > MAX_ANSWER:
        raise DecodeError(f"an answer of {len(buf)} bytes, more than {MAX_ANSWER}")
    pods: list[PodResources] = []
    for num, wt, v in _fields(buf):
        if num != 1 or wt != 2:
            continue
        name = ns = ""
        ctrs: list[ContainerResources] = []
        for n2, w2, x in _fields(_payload(v)):
            if n2 == 1 and w2 == 2:
                name = _payload(x).decode()
            elif n2 == 2 and w2 == 2:
                ns = _payload(x).decode()
            elif n2 == 3 and w2 == 2:
                ctrs.append(_container(_payload(x)))
                _bounded(ctrs, "containers in one pod")
        pods.append(PodResources(name, ns, tuple(ctrs)))
        _bounded(pods, "pods", MAX_PODS)
    return pods


def decode_allocatable(buf: bytes) -> tuple[list[ContainerDevices], frozenset[int]]:
    """AllocatableResourcesResponse { devices = 1; cpu_ids = 2; memory = 3 }."""
    devs: list[ContainerDevices] = []
    cpus: list[int] = []
    for num, wt, v in _fields(buf):
        if num == 1 and wt == 2:
            devs.append(_devices(_payload(v)))
        elif num == 2:
            cpus += _ints(v)
    return devs, frozenset(cpus)


# -- a process's pod ------------------------------------------------------------------
_V1 = re.compile(r"/kubepods[^/]*(?:/[a-z]+)?/pod([0-9a-f-]{36})/(?:[a-z-]*-)?([0-9a-f]{64})")
_SYSTEMD = re.compile(r"kubepods-(?:[a-z]+-)?pod([0-9a-f_]{36})\.slice/"
                      r"(?:[a-z-]+-)?([0-9a-f]{64})\.scope")


@dataclass(frozen=True)
class PodCgroup:
    uid: str  # pod UID, with dashes
    container_id: str


def pod_cgroup(pid: int, proc_root: Path = Path("/proc")) -> PodCgroup | None:
    """Pod UID and container id from /proc/PID/cgroup (the kernel's), or None."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        m = _SYSTEMD.search(path) or _V1.search(path)
        if m:
            return PodCgroup(m.group(1).replace("_", "-"), m.group(2))
    return None


def _root_owned_text(path: Path) -> str | None:
    """A small file's text if owned by root and writable by nobody else, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != 0
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            return None
        return os.read(fd, 4096).decode(errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PodAllocation:
    """What the kubelet gave the pod a process is in (one more allocation source)."""

    namespace: str
    pod: str
    container: str | None  # None: the pod's containers could not be told apart
    gpus: tuple[int, ...]  # topology indices (MIG devices: their parent GPU)
    gpu_uuids: tuple[str, ...]  # as the device plugin names them (GPU-..., MIG-...)
    cpu_ids: frozenset[int]  # exclusive CPUs of the static CPU manager
    notes: tuple[str, ...] = ()


@dataclass
class _Cache:
    pods: dict[tuple[str, str], PodResources] = field(default_factory=dict)
    at: float | None = None
    stale: bool = True
    missed: set[tuple[str, str]] = field(default_factory=set)  # asked, not in this answer


class _UnaryCall(Protocol):
    def __call__(self, request: bytes, *, timeout: float) -> bytes: ...


class _Channel(Protocol):
    """What tunerd uses of a ``grpc.Channel``: a raw-bytes unary call, and close."""

    def unary_unary(self, method: str) -> _UnaryCall: ...

    def close(self) -> None: ...


@contextlib.contextmanager
def below_realtime() -> Iterator[None]:
    """The calling thread at SCHED_OTHER for the block when it runs SCHED_FIFO/RR (the
    exec watcher's thread): a kubelet's answer is waited for and decoded at ordinary
    priority, never ahead of everything else on its CPU; the policy comes back after."""
    try:
        policy = os.sched_getscheduler(0)
        param = os.sched_getparam(0)
    except OSError:
        policy = -1
    lowered = False
    if policy in (os.SCHED_FIFO, os.SCHED_RR):
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            lowered = True
        except OSError:
            pass
    try:
        yield
    finally:
        if lowered:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, policy, param)


class PodResourcesSource:
    """The PodResources client with its cache, backoff and the pod join (a daemon
    service only for its status: it starts nothing)."""

    name = "podresources"

    def __init__(self, socket_path: Path = DEFAULT_SOCKET, *,
                 proc_root: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self.proc = proc_root
        self.clock = clock
        self._cache = _Cache()
        self._lock = threading.Lock()
        self._channel: _Channel | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._uids: dict[str, tuple[str, str] | None] = {}  # pod uid -> (ns, name); None: conflict
        self.lists_total = 0
        self.errors_total = 0
        self.last_error: str | None = None

    # -- gRPC ------------------------------------------------------------------------
    def _call(self, method: str) -> bytes:
        import grpc

        if self._channel is None:
            self._channel = grpc.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.max_receive_message_length", MAX_ANSWER)])
        fn = self._channel.unary_unary(method)  # no (de)serializer: raw bytes both ways
        return bytes(fn(b"", timeout=CALL_TIMEOUT))

    def _list(self) -> None:
        """One List, unless backing off after errors (the old answer stays then)."""
        now = self.clock()
        if now < self._retry_at:
            return
        try:
            with below_realtime():  # the exec watcher's thread asks at SCHED_FIFO
                pods = decode_list(self._call(LIST))
        except Exception as err:  # grpc.RpcError, DecodeError, a missing grpcio
            self._failures += 1
            self.errors_total += 1
            delay = min(MAX_BACKOFF, 2.0 ** (self._failures - 1))
            self._retry_at = now + delay
            self.last_error = f"{self.socket_path}: {_rpc_error(err)}; next try in {delay:.0f} s"
            log.warning("PodResources List failed: %s", self.last_error)
            self._close()
            return
        self._failures, self._retry_at, self.last_error = 0, 0.0, None
        self.lists_total += 1
        self._cache = _Cache({(p.namespace, p.name): p for p in pods}, now, stale=False)

    def allocatable(self) -> tuple[list[ContainerDevices], frozenset[int]]:
        """GetAllocatableResources: every device and CPU the kubelet can give."""
        with self._lock:
            return decode_allocatable(self._call(ALLOCATABLE))

    def invalidate(self) -> None:
        """The kubelet changed something (a cpuset was rewritten): List again when asked."""
        self._cache.stale = True

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def close(self) -> None:
        with self._lock:
            self._close()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self.close()

    def status(self) -> JSONObject:
        pods = len(self._cache.pods)
        summary = (f"{self.lists_total} List call(s), {pods} pod(s) in the last answer"
                   if self.lists_total else f"not asked yet ({self.socket_path})")
        if self.last_error:
            summary += f"; last error: {self.last_error}"
        return {"summary": summary, "socket": str(self.socket_path),
                "lists_total": self.lists_total, "errors_total": self.errors_total,
                "last_error": self.last_error, "pods": pods}

    # -- the join --------------------------------------------------------------------
    def _identity(self, pid: int, uid: str) -> tuple[str, str] | None:
        """(namespace, pod name) of the pod with ``uid``, from a process in it."""
        if uid in self._uids:
            return self._uids[uid]
        try:
            owner = os.stat(self.proc / str(pid)).st_uid
        except OSError:
            return None
        if owner == 0:
            return None  # root in the container could have rewritten the files
        root = self.proc / str(pid) / "root"
        host = _root_owned_text(root / "etc" / "hostname")
        ns = _root_owned_text(root / "var" / "run" / "secrets" / "kubernetes.io"
                              / "serviceaccount" / "namespace")
        if not host or not ns:
            return None
        ident = (ns, host)
        for other, seen in self._uids.items():
            if seen == ident and other != uid:  # two pods claim one name: neither
                self._uids[other] = None
                self._uids[uid] = None
                log.warning("pods %s and %s both claim %s/%s: not joined", other, uid, ns, host)
                return None
        self._uids[uid] = ident
        return ident

    def lookup(self, pid: int, topo: Topology) -> PodAllocation | None:
        """The kubelet's allocation for the pod of ``pid``, or None (not in a pod, no
        trusted join, no answer from the kubelet)."""
        cg = pod_cgroup(pid, self.proc)
        if cg is None:
            return None
        with self._lock:
            ident = self._identity(pid, cg.uid)
            if ident is None:
                return None
            if self._cache.stale or (ident not in self._cache.pods
                                     and ident not in self._cache.missed):
                self._list()  # a pod not in the last answer is new: one List
            pod = self._cache.pods.get(ident)
            if pod is None:
                self._cache.missed.add(ident)  # not again until the kubelet changes
        if pod is None:
            return None
        return pod_allocation(pod, topo)


def pod_allocation(pod: PodResources, topo: Topology) -> PodAllocation:
    """The GPUs (topology indices; a MIG device counts as its GPU) and exclusive CPUs of
    the pod's GPU container; the whole pod's when several containers have GPUs."""
    index: dict[str, int] = {}
    for g in topo.gpus:
        index[str(g.uuid)] = int(g.index)
        for m in g.mig_devices:
            if m.get("uuid"):
                index[str(m["uuid"])] = int(g.index)
    with_gpus = [c for c in pod.containers
                 if any(d.resource_name.startswith(GPU_RESOURCES) for d in c.devices)]
    notes: list[str] = []
    if len(with_gpus) == 1:
        chosen, container = with_gpus, with_gpus[0].name
    else:
        chosen, container = with_gpus, None
        if len(with_gpus) > 1:
            notes.append(f"pod {pod.namespace}/{pod.name}: {len(with_gpus)} containers have "
                         f"GPUs; the pod's whole set is used")
    uuids: list[str] = []
    for c in chosen:
        for d in c.devices:
            if d.resource_name.startswith(GPU_RESOURCES):
                uuids += d.device_ids
    gpus: list[int] = []
    for u in uuids:
        i = index.get(u)
        if i is None:
            notes.append(f"device {u} of pod {pod.namespace}/{pod.name} is not on this node's "
                         f"topology")
        elif i not in gpus:
            gpus.append(i)
    cpus = frozenset().union(*(c.cpu_ids for c in chosen)) if chosen else frozenset()
    return PodAllocation(pod.namespace, pod.name, container, tuple(sorted(gpus)),
                         tuple(uuids), frozenset(cpus), tuple(notes))


def _rpc_error(err: Exception) -> str:
    code = getattr(err, "code", None)
    details = getattr(err, "details", None)
    if callable(code) and callable(details):
        return f"{code()}: {details()}"
    return repr(err)
