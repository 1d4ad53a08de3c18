"""Process exec/exit events from the kernel proc connector, on the asyncio loop.

The proc connector (``NETLINK_CONNECTOR``, multicast group ``CN_IDX_PROC``)
sends one datagram per process event to every listener. A busy node execs
thousands of unrelated commands a second, so the daemon must not wake up for
them. Two kernel-side filters keep that cost near zero:

* a classic BPF socket filter (``SO_ATTACH_FILTER``) that drops every message
  that is not an event we asked for (and, for exits, every non-leader thread
  exit) before it is queued on our socket;
* on kernels >= 6.6 the proc connector's own per-listener event filter
  (``struct proc_input`` with ``event_type``, commit 2aa1f7a1f47c "connector/cn_proc:
  Add filtering to fix some bugs"), which skips building the message at all.

If the connector cannot be used (not root, another network namespace:
EPERM / EPROTONOSUPPORT / ECONNREFUSED) the ExecWatcher falls back to scanning
/proc at a modest interval and says so in the log. A receive-queue overrun
(ENOBUFS: events were lost) triggers one /proc rescan.

Wire layout (little-endian host order; see include/uapi/linux/connector.h and
cn_proc.h)::

    0  struct nlmsghdr   len u32, type u16, flags u16, seq u32, pid u32   (16 bytes)
    16 struct cn_msg     id.idx u32, id.val u32, seq u32, ack u32, len u16, flags u16
    36 struct proc_event what u32, cpu u32, timestamp_ns u64 (aligned 8)
    52   event_data      exec: pid, tgid | exit: pid, tgid, exit_code, exit_signal, ...
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

from tunerd.adapters.procfs import (
    PROC,
    Process,
    in_initial_pid_namespace,
    pid_namespace,
    read_text,
)
from tunerd.base.errors import TunerdError
from tunerd.base.jsontypes import JSONObject

__all__ = [
    "PROC_EVENT_EXEC",
    "PROC_EVENT_EXIT",
    "ConnectorUnavailable",
    "ExecWatcher",
    "Overrun",
    "ProcConnector",
    "ProcEvent",
    "kernel_has_event_filter",
]

log = logging.getLogger("tunerd.watch")

T = TypeVar("T")
STOP_CHECK_S = 0.5  # the watcher thread's receive timeout: how soon it sees stop()
SWITCH_INTERVAL_S = 0.0005  # GIL switch interval while exec events are watched
BURST_GOES_ON = 2  # execs a batch pause must find for the next pause to follow at once
BATCH_GROWTH = 4  # in a long burst the pause doubles up to this many batch_windows

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
NLMSG_DONE = 3
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_EXEC = 0x00000002
PROC_EVENT_EXIT = 0x80000000
SO_ATTACH_FILTER = 26
SO_RCVBUFFORCE = 33

_OFF_NL_TYPE = 4
_OFF_CN_IDX = 16
_OFF_CN_VAL = 20
_OFF_WHAT = 36
_OFF_PID = 52
_OFF_TGID = 56
_MSG_MIN = 60
CAP_NET_ADMIN = 12

# classic BPF opcodes (include/uapi/linux/filter.h, bpf_common.h)
_BPF_LD_W_ABS = 0x00 | 0x00 | 0x20
_BPF_LD_H_ABS = 0x00 | 0x08 | 0x20
_BPF_LDX_MEM = 0x01 | 0x60
_BPF_ST = 0x02
_BPF_JEQ_K = 0x05 | 0x10 | 0x00
_BPF_JEQ_X = 0x05 | 0x10 | 0x08
_BPF_RET_K = 0x06 | 0x00
_ACCEPT = 0xFFFFFFFF
_U32 = struct.Struct("I")
_I32 = struct.Struct("i")
_U64 = struct.Struct("Q")
_OFF_TS = 44  # proc_event.timestamp_ns (CLOCK_MONOTONIC)
_EVENT = struct.Struct("=I12xii")  # what, (cpu, timestamp), pid, tgid: from _OFF_WHAT
_EVENT_AT = struct.Struct("=I32xI12xii")  # nlmsg len, what, pid, tgid: from the start


class ProcEvent(NamedTuple):
    what: int  # PROC_EVENT_EXEC or PROC_EVENT_EXIT
    pid: int  # thread id
    tgid: int  # process id


class ConnectorUnavailable(OSError):
    """The proc connector cannot be used here (errno says why)."""


class Overrun(OSError):
    """The socket's receive queue overflowed (ENOBUFS): some events were lost."""


def kernel_has_event_filter(release: str | None = None) -> bool:
    """True on kernels >= 6.6, which accept ``struct proc_input`` with an event mask.

    Older kernels silently ignore a LISTEN message of the new size (they check
    ``msg->len == sizeof(int)``), so the size must be chosen by version.
    """
    rel = release or os.uname().release  # e.g. "6.18.44-fc-v857"
    try:
        major, minor = (int(x) for x in rel.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 6)


def listen_refusal() -> str | None:
    """Why the kernel would ignore our LISTEN, or None if it will accept it.

    LISTEN needs CAP_NET_ADMIN in the initial user namespace and a caller in the
    initial PID namespace (drivers/connector/cn_proc.c, cn_proc_mcast_ctl). The
    kernel refuses without an error we could see (its ack is filtered or never
    sent), so check up front instead of waiting for events that never come.
    """
    me = Process(os.getpid())
    try:
        with me.oneshot():  # one status read for both
            cap_eff = me.cap_effective()
            nspid = me.status().get("NSpid", "")
        uid_map = read_text(f"{PROC}/{me.pid}/uid_map").split()
    except TunerdError as err:
        return f"cannot read {PROC}/{me.pid}: {err.message}"
    except OSError as err:
        return f"cannot read {err.filename}: {err.strerror}"
    if not cap_eff & (1 << CAP_NET_ADMIN):
        return "CAP_NET_ADMIN is needed to listen to process events"
    if uid_map[:3] != ["0", "0", "4294967295"]:
        return "not in the initial user namespace (container?): the kernel ignores LISTEN"
    if not in_initial_pid_namespace() or len(nspid.split()) > 1:
        return (f"not in the initial PID namespace (pid:[{pid_namespace()}], container?): "
                "the kernel sends no process events there")
    return None


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def build_filter(events: int) -> bytes:
    """Classic BPF program accepting only proc-connector messages for ``events``.

    BPF loads read network byte order, the proc connector writes host order,
    hence the htonl/htons on every constant. Exit events are kept only for
    thread-group leaders (pid == tgid): one per process, not one per thread.
    """
    want_exec = bool(events & PROC_EVENT_EXEC)
    want_exit = bool(events & PROC_EVENT_EXIT)
    prog: list[bytes] = [
        _insn(_BPF_LD_H_ABS, 0, 0, _OFF_NL_TYPE),
        _insn(_BPF_JEQ_K, 1, 0, socket.htons(NLMSG_DONE)),
        _insn(_BPF_RET_K, 0, 0, 0),
        _insn(_BPF_LD_W_ABS, 0, 0, _OFF_CN_IDX),
        _insn(_BPF_JEQ_K, 1, 0, socket.htonl(CN_IDX_PROC)),
        _insn(_BPF_RET_K, 0, 0, 0),
        _insn(_BPF_LD_W_ABS, 0, 0, _OFF_CN_VAL),
        _insn(_BPF_JEQ_K, 1, 0, socket.htonl(CN_VAL_PROC)),
        _insn(_BPF_RET_K, 0, 0, 0),
        _insn(_BPF_LD_W_ABS, 0, 0, _OFF_WHAT),
    ]
    if want_exec:
        # what == EXEC -> accept; else fall through
        prog.append(_insn(_BPF_JEQ_K, 0, 1, socket.htonl(PROC_EVENT_EXEC)))
        prog.append(_insn(_BPF_RET_K, 0, 0, _ACCEPT))
    if want_exit:
        prog += [
            _insn(_BPF_JEQ_K, 1, 0, socket.htonl(PROC_EVENT_EXIT)),
            _insn(_BPF_RET_K, 0, 0, 0),
            # accept only when pid == tgid: X = tgid (via scratch M[0]), A = pid
            _insn(_BPF_LD_W_ABS, 0, 0, _OFF_TGID),
            _insn(_BPF_ST, 0, 0, 0),
            _insn(_BPF_LDX_MEM, 0, 0, 0),
            _insn(_BPF_LD_W_ABS, 0, 0, _OFF_PID),
            _insn(_BPF_JEQ_X, 0, 1, 0),
            _insn(_BPF_RET_K, 0, 0, _ACCEPT),
        ]
    prog.append(_insn(_BPF_RET_K, 0, 0, 0))
    return b"".join(prog)


class ProcConnector:
    """A non-blocking netlink socket subscribed to proc-connector events."""

    def __init__(self, events: int = PROC_EVENT_EXEC, rcvbuf: int = 4 << 20,
                 filter_events: int | None = None) -> None:
        self.events = events  # what the kernel is asked for (its own event filter)
        # what the BPF filter lets through at first (set_filter changes it)
        self.filter_events = events if filter_events is None else filter_events
        self.rcvbuf = rcvbuf
        self.kernel_filter = False  # the proc connector's own event filter is in use
        self._sock: socket.socket | None = None
        self._buf = bytearray(8192)
        self._filter_buf: ctypes.Array[ctypes.c_char] | None = None

    def open(self) -> None:
        """Create, filter, bind and subscribe; raises ConnectorUnavailable."""
        why = listen_refusal()
        if why is not None:
            raise ConnectorUnavailable(errno.EPERM, why)
        try:
            sock = socket.socket(
                socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                NETLINK_CONNECTOR)
        except OSError as err:
            raise ConnectorUnavailable(err.errno, f"netlink connector socket: {err.strerror}"
                                       ) from err
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self.rcvbuf)
            except OSError:  # not CAP_NET_ADMIN: the plain limit still works
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            # attach the filter before bind so no unfiltered message is ever queued
            self._attach(sock, self.filter_events)
            sock.bind((0, CN_IDX_PROC))
            self._sock = sock
            self._subscribe(PROC_CN_MCAST_LISTEN)
        except OSError as err:
            sock.close()
            self._sock = None
            raise ConnectorUnavailable(err.errno, f"proc connector: {err.strerror}") from err

    def _attach(self, sock: socket.socket, events: int) -> None:
        prog = build_filter(events)
        fbuf = ctypes.create_string_buffer(prog, len(prog))
        fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(fbuf))
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)  # the kernel copies it
        self._filter_buf = fbuf

    def set_filter(self, events: int) -> bool:
        """Let only ``events`` (of those subscribed) through from now on; True if done."""
        if self._sock is None:
            return False
        try:
            self._attach(self._sock, events & self.events)
        except OSError as err:
            log.warning("proc connector: cannot change the BPF filter: %s", err.strerror)
            return False
        return True

    def _subscribe(self, op: int) -> None:
        """Send LISTEN or IGNORE to the proc connector."""
        assert self._sock is not None
        self.kernel_filter = kernel_has_event_filter()
        # struct proc_input {mcast_op, event_type} on >= 6.6, a bare mcast_op before
        payload = (struct.pack("II", op, self.events) if self.kernel_filter
                   else struct.pack("I", op))
        cn = struct.pack("IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
        msg = struct.pack("IHHII", 16 + len(cn), NLMSG_DONE, 0, 0, 0) + cn
        self._sock.send(msg)

    def fileno(self) -> int:
        assert self._sock is not None
        return self._sock.fileno()

    def sock(self) -> socket.socket:
        assert self._sock is not None
        return self._sock

    def read(self) -> list[ProcEvent]:
        """Every queued event (never blocks). Raises Overrun after ENOBUFS."""
        assert self._sock is not None
        out: list[ProcEvent] = []
        buf = self._buf
        recv_into = self._sock.recv_into
        while True:
            try:
                n = recv_into(buf)
            except BlockingIOError:
                return out
            except OSError as err:
                if err.errno == errno.ENOBUFS:
                    raise Overrun(err.errno, "proc connector receive queue overrun") from err
                raise
            if n < _MSG_MIN:
                continue
            what, = struct.unpack_from("I", buf, _OFF_WHAT)
            pid, tgid = struct.unpack_from("ii", buf, _OFF_PID)
            out.append(ProcEvent(what, pid, tgid))

    def view_mismatch(self, timeout: float = 2.0) -> str | None:
        """The connector's view against ours (None: they agree): the exec of a child we
        start must come, with the pid we see. A kernel that ignored our LISTEN, or one
        whose events carry another PID namespace's numbers, fails here, not silently
        later. Events of other processes read meanwhile are dropped: the caller scans
        /proc after it starts watching."""
        import select
        import shutil

        exe = shutil.which("true") or "/bin/true"
        try:
            child = os.posix_spawn(exe, [exe], {})
        except OSError as err:
            log.debug("proc connector: no probe (%s: %s)", exe, err.strerror)
            return None
        seen: list[int] = []
        try:
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([self.sock()], [], [], left)[0]:
                    break
                try:
                    events = self.read()
                except Overrun:
                    return None  # a busy node: events do come
                if any(e.what == PROC_EVENT_EXEC and e.tgid == child for e in events):
                    return None
                seen += [e.tgid for e in events if e.what == PROC_EVENT_EXEC]
        finally:
            os.waitpid(child, 0)
        return (f"no exec event for pid {child}, a child it started, within {timeout:g} s "
                f"({len(seen)} other exec event(s)): the kernel's process events do not "
                "match this PID namespace")

    def unsubscribe(self) -> None:
        if self._sock is None:
            return
        try:
            self._subscribe(PROC_CN_MCAST_IGNORE)
        except OSError:
            pass

    def close(self) -> None:
        if self._sock is None:
            return
        self.unsubscribe()
        self._sock.close()
        self._sock = None


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.c_void_p), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


class QueueReader:
    """Every message queued on a socket, without blocking: recvmmsg(2) through libc, up
    to SLOTS messages a system call (Python's socket module has no recvmmsg), else one
    recv(2) each. Raises Overrun after ENOBUFS, OSError for other failures."""

    SLOTS = 64
    SLOT = 256  # a proc connector message is ~76 bytes; longer ones arrive cut

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = bytearray(self.SLOT)
        self._mmsg: Any = None
        try:
            fn = ctypes.CDLL(None, use_errno=True).recvmmsg
        except (AttributeError, OSError):
            return  # no recvmmsg in this libc: recv per message
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._mbuf = ctypes.create_string_buffer(self.SLOTS * self.SLOT)
        self._iov = (_IOVec * self.SLOTS)()
        self._msgs = (_MMsgHdr * self.SLOTS)()
        base = ctypes.addressof(self._mbuf)
        for i in range(self.SLOTS):
            self._iov[i].base = base + i * self.SLOT
            self._iov[i].len = self.SLOT
            self._msgs[i].hdr.iov = ctypes.addressof(self._iov[i])
            self._msgs[i].hdr.iovlen = 1
        self._mmsg = fn
        self._msgs_addr = ctypes.addressof(self._msgs)

    def read(self) -> list[tuple[int, int]]:
        """(what, tgid) of each queued event message."""
        out: list[tuple[int, int]] = []
        if self._mmsg is None:
            buf = self.buf
            recv_into = self.sock.recv_into
            while True:
                try:
                    n = recv_into(buf, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return out
                except OSError as err:
                    if err.errno == errno.ENOBUFS:
                        raise Overrun(err.errno, "proc connector receive queue overrun"
                                      ) from err
                    raise
                if n >= _MSG_MIN:
                    what, _, tgid = _EVENT.unpack_from(buf, _OFF_WHAT)
                    out.append((what, tgid))
        unpack = _EVENT_AT.unpack_from
        mbuf = self._mbuf
        slots, slot = self.SLOTS, self.SLOT
        while True:
            n = self._mmsg(self.fd, self._msgs_addr, slots, socket.MSG_DONTWAIT, None)
            if n < 0:
                code = ctypes.get_errno()
                if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return out
                if code == errno.EINTR:
                    continue
                if code == errno.ENOBUFS:
                    raise Overrun(code, "proc connector receive queue overrun")
                raise OSError(code, os.strerror(code))
            for off in range(0, n * slot, slot):
                length, what, _, tgid = unpack(mbuf, off)
                if length >= _MSG_MIN:
                    out.append((what, tgid))
            if n < slots:  # the queue was emptied
                return out


class ExecWatcher(Generic[T]):
    """Calls ``on_exec(select(pid))`` on the asyncio loop for the execs ``select`` keeps.

    ``select(pid)`` runs in the watcher's own thread for every exec on the host and
    returns a value (a rule match, or the pid itself by default) or None to drop it;
    ``on_exec`` then runs on the loop with that value, so unrelated execs never wake
    the loop. ``on_rescan()`` is called on the loop when events may have been missed
    (overrun) and, in fallback mode, every ``scan_interval`` seconds instead of events.

    Why a thread: waking the asyncio loop costs far more than handling one event
    (measured on the 2-CPU dev VM: ~170 us of CPU per wake-up of an idle loop, whose
    epoll_wait arms a timer each time, against ~40 us for a thread blocked in a read).
    The thread blocks in a read of the connector socket; in a burst
    (``burst_wakeups`` events in a row closer than ``burst_gap`` on average) it
    sleeps ``batch_window`` before reading again, so the kernel queues the burst in
    the 4 MiB receive buffer and the next reads return at once, without a wake-up
    each; while each pause finds BURST_GOES_ON (2) or more execs queued the burst goes
    on and the thread pauses again, longer each time up to 4 windows (~25 wake-ups a
    second under a sustained storm, not one per event); a pause that finds fewer ends
    it. One job
    ending as the next starts (an exit and an exec together) is no burst.
    """

    def __init__(self, on_exec: Callable[[T], None], on_rescan: Callable[[], None], *,
                 select: Callable[[int], T | None] | None = None,
                 scan_interval: float = 2.0, use_connector: bool = True,
                 rcvbuf: int = 4 << 20, batch_window: float = 0.01,
                 burst_gap: float = 0.002, burst_wakeups: int = 3,
                 skip_exited: bool = False, rt_priority: int | None = None,
                 nice: int | None = None) -> None:
        self.on_exec = on_exec
        # the thread's scheduling (``_prioritise``): SCHED_FIFO ``rt_priority`` while
        # events are sparse (a bind waits for its wake-up), SCHED_OTHER at ``nice`` in a
        # burst; None: as the daemon's
        self.rt_priority = rt_priority
        self.nice = nice
        self.thread_policy = "as the daemon's"
        self._rt = False  # the thread runs SCHED_FIFO now
        self._lowered = False  # lowered for the rest of one event (``lower_for_rest``)
        self._tid = 0  # the watcher thread's, once it runs
        self.select: Callable[[int], T | None] = select or (lambda pid: pid)  # type: ignore[assignment,return-value]
        self.rcvbuf = rcvbuf
        self.batch_window = batch_window
        self.burst_gap = burst_gap
        self.burst_wakeups = burst_wakeups
        self.batches = 0  # bursts the thread let the kernel queue (batch_window each)
        # in a batch, drop the execs of processes that exited before they were read:
        # for a ``select`` that returns None for a process that is gone
        self.skip_exited = skip_exited
        self.exited_unread = 0
        self.wakeups = 0  # blocking reads that returned a message (one wake-up each)
        # exec event stamped by the kernel -> this thread read it, for blocking reads (the
        # wake-up a bind waits for before any of tunerd's work), ms, the last 1000
        self.wake_ms: deque[float] = deque(maxlen=1000)
        # while ``select`` runs on a lone event: (the kernel's stamp, read), CLOCK_MONOTONIC
        # ns; None in a batch (bench/autobind.py lines them up with its own clock)
        self.event_ns: tuple[int, int] | None = None
        self.on_rescan = on_rescan
        self.scan_interval = scan_interval
        self.use_connector = use_connector
        self.mode = "stopped"  # "proc-connector" | "proc-scan" | "stopped"
        self.reason: str | None = None  # why the fallback is in use
        self.events = 0
        self.selected = 0
        self.overruns = 0
        self.scans = 0
        self._conn: ProcConnector | None = None
        self._scan_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False  # the watcher thread reads while this is True

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.use_connector:
            # exits too from the kernel (its event filter), the BPF filter passes them
            # only while a burst is read in batches (skip_exited)
            conn = ProcConnector(PROC_EVENT_EXEC | PROC_EVENT_EXIT if self.skip_exited
                                 else PROC_EVENT_EXEC, self.rcvbuf, filter_events=PROC_EVENT_EXEC)
            try:
                conn.open()
                why = conn.view_mismatch()
                if why is not None:
                    conn.close()
                    raise ConnectorUnavailable(errno.EPERM, why)
            except ConnectorUnavailable as err:
                self.reason = f"{err.strerror} (errno {errno.errorcode.get(err.errno or 0, '?')})"
                log.warning("proc connector unavailable: %s; falling back to scanning /proc "
                            "every %g s", self.reason, self.scan_interval)
            else:
                self._conn = conn
                self._running = True
                # An exec event is handled by two threads in turn (this watcher, then the
                # loop), each of which must get the GIL first: with the default 5 ms
                # switch interval, a cycle of the monitor's sampler thread delayed a
                # bind by up to 5 ms (p99 4.2-5.6 ms exec to bound, issue 15). Holders
                # are asked to let go after 0.5 ms instead; CPU-bound work in the daemon
                # is short, so the extra switches cost nothing measurable.
                sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
                self._thread = threading.Thread(target=self._run, args=(conn,),
                                                name="tunerd-exec-watch", daemon=True)
                self._thread.start()
                self.mode = "proc-connector"
                log.info("exec watcher: proc connector (kernel event filter: %s)",
                         "yes" if conn.kernel_filter else "no, BPF filter only")
                return
        else:
            self.reason = "disabled in the configuration (watch_execs = false)"
            log.info("exec watcher: proc connector %s; scanning /proc every %g s", self.reason,
                     self.scan_interval)
        self.mode = "proc-scan"
        self._scan_task = asyncio.ensure_future(self._scan_loop())

    def stop(self) -> None:
        """Stop watching. The thread is blocked in a read: it sees the flag at the next
        event or within STOP_CHECK_S, and is a daemon thread (never holds up exit)."""
        self._running = False
        thread, self._thread = self._thread, None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.unsubscribe()  # no more events are queued for us
            if thread is not None:
                # the thread closes the socket when it leaves its read (never under it)
                thread_conn = conn

                def close_later() -> None:
                    thread.join(STOP_CHECK_S * 2)
                    thread_conn.close()

                threading.Thread(target=close_later, daemon=True,
                                 name="tunerd-exec-watch-stop").start()
            else:
                conn.close()
        if self._scan_task is not None:
            self._scan_task.cancel()
            self._scan_task = None
        self.mode = "stopped"

    # -- the watcher thread ---------------------------------------------------------
    def _run(self, conn: ProcConnector) -> None:
        """Blocking reads, one message each: ~40 us of CPU per exec on the dev VM, where
        poll(2) plus non-blocking reads cost ~115 us. A receive timeout (STOP_CHECK_S)
        lets the thread see ``stop()``; it arms a timer only while the socket is idle.
        In a burst (``burst_wakeups`` events closer than ``burst_gap`` on average) the
        thread reads in batches instead (:meth:`_batches`)."""
        sock = conn.sock()
        sock.setblocking(True)
        self._tid = threading.get_native_id()
        self._prioritise()
        sec = int(STOP_CHECK_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", sec, int((STOP_CHECK_S - sec) * 1e6)))
        buf = bytearray(4096)
        recv_into = sock.recv_into
        unpack_what = _U32.unpack_from
        unpack_tgid = _I32.unpack_from
        take = self._take
        # the times of the last burst_wakeups events: a burst when they all came within
        # burst_wakeups * burst_gap
        recent = deque([-1e9] * max(self.burst_wakeups, 1), maxlen=max(self.burst_wakeups, 1))
        span = self.burst_gap * self.burst_wakeups
        while self._running:
            try:
                n = recv_into(buf)
            except BlockingIOError:  # the receive timeout: see the stop flag
                continue
            except OSError as err:
                if not self._read_failed(err):
                    return
                continue
            self.wakeups += 1
            if n < _MSG_MIN or unpack_what(buf, _OFF_WHAT)[0] != PROC_EVENT_EXEC:
                continue  # an exit queued while batches were read
            self.events += 1
            stamped, read = _U64.unpack_from(buf, _OFF_TS)[0], time.monotonic_ns()
            self.wake_ms.append((read - stamped) / 1e6)
            self.event_ns = (stamped, read)
            take(unpack_tgid(buf, _OFF_TGID)[0])
            self.event_ns = None
            now = time.monotonic()
            if self.batch_window > 0 and now - recent[0] < span:
                self._batches(conn)
                recent.extend([-1e9] * len(recent))
            else:
                recent.append(now)

    def _batches(self, conn: ProcConnector) -> None:
        """A burst: sleep ``batch_window`` while the kernel queues its events, take them
        in a row, again while each pause finds BURST_GOES_ON or more, each pause twice
        the last up to BATCH_GROWTH batch windows. A wake-up costs 40-150 us of CPU
        here (more than reading ten events), so a storm of 1,000 execs/s costs ~25
        wake-ups a second; a rank exec'd in it is read within 40 ms.

        With ``skip_exited``, the exits of thread-group leaders are let through the BPF
        filter meanwhile: an exec whose process exited in the same batch is dropped
        unread (a process that is gone never matches), instead of a failed open of its
        /proc/PID at ~10 us each (most commands of a storm live ~1 ms). The queue is
        read with recvmmsg (QueueReader): one system call for up to 64 messages."""
        take = self._take
        reader = QueueReader(conn.sock())
        exits = self.skip_exited and conn.set_filter(PROC_EVENT_EXEC | PROC_EVENT_EXIT)
        pause = self.batch_window
        rt = self._rt
        if rt:  # a storm is read at a normal priority: it never crowds out other work
            self._set_fifo(False)
        try:
            while self._running:
                self.batches += 1
                time.sleep(pause)
                try:
                    queued = reader.read()
                except Overrun as err:
                    self._read_failed(err)
                    continue
                except OSError as err:
                    if not self._read_failed(err):
                        return
                    continue
                pending: dict[int, bool] = {}  # exec'd in this batch, in order
                execs = 0
                for what, tgid in queued:
                    if what == PROC_EVENT_EXEC:
                        execs += 1
                        if exits:
                            pending[tgid] = True  # exec'd twice: read once, as it is now
                        else:
                            take(tgid)
                    elif what == PROC_EVENT_EXIT and pending.pop(tgid, False):
                        self.exited_unread += 1
                self.events += execs
                for tgid in pending:
                    take(tgid)
                if execs < BURST_GOES_ON:
                    # the burst is over. A pause that found one costs one wake-up, as
                    # that one would have in a blocking read: only 0 or 1 end it
                    return
                pause = min(pause * 2, self.batch_window * BATCH_GROWTH)
        finally:
            if exits:
                conn.set_filter(PROC_EVENT_EXEC)
            if rt:
                self._set_fifo(True)

    # -- the thread's scheduling -----------------------------------------------------
    def _prioritise(self) -> None:
        """In the watcher's thread, once: its nice value (per thread on Linux), then
        SCHED_FIFO at ``rt_priority``. The thread's work per exec is bounded (a rule
        match and one bind, ~1 ms at most) and it blocks in between; a real-time
        thread is not queued behind the starting process, the launcher and the
        daemon's other threads on a busy node, where nice -10 still waited its turn.
        Bursts drop to SCHED_OTHER (``_batches``). Without CAP_SYS_NICE: as it is."""
        tid = threading.get_native_id()
        parts = []
        if self.nice is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, self.nice)
                parts.append(f"nice {self.nice}")
            except OSError as err:
                log.debug("exec watcher thread keeps its nice value: %s", err)
        if self.rt_priority is not None and self._set_fifo(True):
            parts.insert(0, f"SCHED_FIFO {self.rt_priority} while execs are sparse")
        if parts:
            self.thread_policy = ", ".join(parts)

    def _set_fifo(self, on: bool) -> bool:
        assert self.rt_priority is not None
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO if on else os.SCHED_OTHER,
                                  os.sched_param(self.rt_priority if on else 0))
        except OSError as err:
            log.debug("exec watcher thread: SCHED_%s refused: %s", "FIFO" if on else "OTHER",
                      err)
            return False
        self._rt = on
        return True

    def lower_for_rest(self) -> None:
        """From ``select``, in the watcher's thread: what is left of this event is not
        what the starting process waits for (its main thread's CPUs are set), so the
        thread runs it at SCHED_OTHER, where it no longer holds a CPU ahead of the
        process, its launcher and anyone reading its /proc; SCHED_FIFO is back before
        the next read. Measured on the 2-CPU VM: CPUs set -> seen from outside 0.44 ->
        0.13 ms (median). Elsewhere, or when not real-time: nothing."""
        if self._rt and not self._lowered and threading.get_native_id() == self._tid \
                and self._set_fifo(False):
            self._lowered = True

    def _take(self, tgid: int) -> None:
        """``select`` one exec'd process; a value it keeps goes to ``on_exec`` on the loop."""
        try:
            value = self.select(tgid)
        except Exception:  # one bad event must never stop the watcher
            log.exception("exec filter failed for pid %d", tgid)
            return
        finally:
            if self._lowered:
                self._lowered = False
                self._set_fifo(True)
        if value is not None:
            self.selected += 1
            self._to_loop(self._deliver, value)

    def _read_failed(self, err: OSError) -> bool:
        """A failed read of the connector; False when the thread is to stop."""
        if err.errno == errno.ENOBUFS:
            self.overruns += 1
            log.warning("proc connector overrun: events were lost; rescanning /proc")
            self._to_loop(self._rescan)
            return True
        if not self._running:
            return False
        log.error("proc connector read failed: %s", err)
        time.sleep(0.1)
        return True

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass

    # -- on the loop ---------------------------------------------------------------
    def _deliver(self, value: T) -> None:
        try:
            self.on_exec(value)
        except Exception:
            log.exception("exec handler failed for %r", value)

    def _rescan(self) -> None:
        self.scans += 1
        try:
            self.on_rescan()
        except Exception:
            log.exception("/proc rescan failed")

    async def _scan_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            self._rescan()
            await asyncio.sleep(max(self.scan_interval - (time.monotonic() - t0), 0.1))

    def status(self) -> JSONObject:
        return {"mode": self.mode, "reason": self.reason, "events": self.events,
                "selected": self.selected, "batches": self.batches,
                "overruns": self.overruns, "rescans": self.scans,
                "exited_unread": self.exited_unread, "wakeups": self.wakeups,
                "wake_ms": _quantiles(self.wake_ms), "thread_policy": self.thread_policy,
                "kernel_event_filter": bool(self._conn and self._conn.kernel_filter)}


def _quantiles(xs: deque[float]) -> JSONObject:
    s = sorted(xs)
    if not s:
        return {"n": 0}
    return {"n": len(s), "median": round(s[len(s) // 2], 3),
            "p99": round(s[min(len(s) - 1, round(0.99 * (len(s) - 1)))], 3)}
