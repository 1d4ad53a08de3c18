"""The control socket: JSON lines over a Unix stream socket, with peer credentials.

Robustness rules, because any local user can connect:

* the socket is created with its final mode (bind under a umask), never chmod'ed
  by name afterwards, so a swapped-in symlink cannot redirect a chmod;
* a non-root uid may hold at most ``max_connections_per_user`` connections at once;
  one more gets one error line and is closed (root is never limited);
* the listen backlog fits a burst of connects; accept() failures for lack of fds
  or memory pause accepting briefly instead of spinning, and are logged once
  (the daemon's log filter rate-limits repeats);
* every connection has an idle timeout; a line over 1 MiB, a malformed message,
  NaN, too deep a nesting or a half-sent message gets an error reply (then the
  connection is closed where the stream can no longer be trusted);
* a client that sends requests without reading the replies costs bounded memory:
  its socket is not read while requests already read wait to be run, and it is
  dropped once its replies have not moved for the idle timeout;
* what one request may cost is bounded before its handler runs: a request holds at
  most MAX_REQUEST_NUMBERS numbers (the parse stops at the next one) and
  MAX_ARG_ITEMS list or object items in its arguments, so no handler's work scales
  past those with what a client sends;
* a reply to a non-root peer is at most ``max_reply_bytes`` (an error past it, never
  a cut answer), and the replies queued for one non-root user's connections together
  are at most USER_QUEUED_MAX: a reply past that drops its connection at once (its
  client does not read), so unread replies cannot grow the daemon's memory;
* a reply is always one valid JSON line; a failing handler never takes the
  server down.

Connections are plain non-blocking sockets driven by loop readers: per request
that is one recv, one parse, the handler, one encode and one send, with no
stream objects or timers per connection, and no task unless the handler has to
wait for something.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import logging
import os
import resource
import socket
import stat
import struct
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

from tunerd.base.errors import Failed, TunerdError, UsageError
from tunerd.base.logutil import acting_for
from tunerd.daemon.router import Request, Router
from tunerd.jobs.peer import Peer
from tunerd.wire.protocol import (
    MAX_MESSAGE,
    MAX_REQUEST_NUMBERS,
    decode,
    encode,
    error_to_wire,
    reply_id,
)

log = logging.getLogger("tunerd.server")

__all__ = ["ControlServer", "peer_credentials", "raise_nofile_limit"]

IDLE_TIMEOUT = 30.0  # seconds a client may stay silent before it is dropped
MAX_CONNECTIONS_PER_USER = 128  # open connections one non-root uid may hold
LISTEN_BACKLOG = 4096  # pending connects; the kernel caps it at net.core.somaxconn
ACCEPT_BATCH = 512  # connections accepted per wake-up: a flood cannot starve the loop
ACCEPT_PAUSE = 0.1  # seconds accepting pauses after EMFILE/ENFILE/ENOBUFS/ENOMEM
RECV_SIZE = 256 * 1024
OUT_HIGH = 4 * MAX_MESSAGE  # queued reply bytes above which a connection's requests wait
MAX_REPLY_USER = 4 << 20  # bytes of one reply to a non-root peer; past it an error reply
USER_QUEUED_MAX = 16 << 20  # unsent reply bytes of one non-root user, all connections
MAX_ARG_ITEMS = 4096  # list and object items in one request's arguments, all levels
TURN_SLICE = 0.002  # seconds of requests one connection runs before the others' turn
CLOSE_GRACE = 1.0  # seconds a closing connection may take to flush its last reply
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit; (old, new) soft.

    Each client connection, bound process (pidfd) and watcher holds an fd; the
    default soft limit of 1,024 is a denial of service waiting for a user with
    a loop of connects.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as err:
        log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, err)
        return soft, soft
    return soft, hard


def _bind_listener(path: Path, backlog: int) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path`` with mode 0666, replacing a stale socket there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not (stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise Failed(f"{path} exists and is not a socket; refusing to remove it",
                         path=str(path))
        # a stale socket of a previous daemon (or a symlink): unlink never follows
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                         | socket.SOCK_CLOEXEC)
    try:
        # Everyone may connect; what a peer may do is decided per request from
        # SO_PEERCRED. The mode comes from the umask at bind(): a chmod by name
        # after bind() could be redirected by a symlink swapped in meanwhile.
        old = os.umask(0o111)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        st = os.lstat(path)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise Failed(f"cannot listen on {path}: {err.strerror or err}", path=str(path),
                     errno=err.errno) from err
    return sock, (st.st_dev, st.st_ino)


class ControlServer:
    def __init__(self, router: Router, path: Path, idle_timeout: float = IDLE_TIMEOUT,
                 *, max_connections_per_user: int = MAX_CONNECTIONS_PER_USER,
                 backlog: int = LISTEN_BACKLOG, max_reply: int = MAX_REPLY_USER,
                 user_queued_max: int = USER_QUEUED_MAX,
                 owner: Callable[[int], int] = lambda uid: uid) -> None:
        self.router = router
        # the user a uid counts as for per-user limits (a subordinate uid: its owner)
        self.owner = owner
        self.path = Path(path)
        self.idle_timeout = idle_timeout
        self.max_connections_per_user = max_connections_per_user
        self.backlog = backlog
        self.max_reply = max_reply  # bytes of one reply to a non-root peer
        self.user_queued_max = user_queued_max
        self._queued: Counter[int] = Counter()  # unsent reply bytes per non-root user
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._conns: set[_Connection] = set()
        self._per_uid: Counter[int] = Counter()
        self._sweeper: asyncio.TimerHandle | None = None
        self._resume: asyncio.TimerHandle | None = None

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock, self._inode = _bind_listener(self.path, self.backlog)
        self._loop.add_reader(self._sock.fileno(), self._on_acceptable)
        self._schedule_sweep()
        log.info("control socket listening on %s", self.path)

    async def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        for h in (self._sweeper, self._resume):
            if h is not None:
                h.cancel()
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            # only our own socket: a newer daemon may already serve at this path
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
        for conn in list(self._conns):
            conn.abort(cancel=True)

    # -- accepting -------------------------------------------------------------
    def _on_acceptable(self) -> None:
        assert self._sock is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as err:
                if err.errno in _OUT_OF_RESOURCES:
                    log.error("control socket %s: accept() failed: %s; pausing accepts for "
                              "%g s", self.path, err.strerror, ACCEPT_PAUSE)
                    self._pause_accepting()
                else:
                    log.error("control socket %s: accept() failed: %s", self.path,
                              err.strerror or err)
                return
            self._admit(conn)

    def _pause_accepting(self) -> None:
        assert self._loop is not None and self._sock is not None
        self._loop.remove_reader(self._sock.fileno())
        self._resume = self._loop.call_later(ACCEPT_PAUSE, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._on_acceptable)

    def _admit(self, sock: socket.socket) -> None:
        assert self._loop is not None
        try:
            sock.setblocking(False)
            peer = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        user = self.owner(peer.uid)
        if peer.uid != 0 and self._per_uid[user] >= self.max_connections_per_user:
            who = f"uid {peer.uid}" + (f" (a subordinate uid of uid {user})"
                                       if user != peer.uid else "")
            log.warning("%s holds %d connections (max_connections_per_user): refusing "
                        "more", who, self._per_uid[user])
            err = Failed(f"too many connections: {who} already has "
                         f"{self._per_uid[user]} open connections to tunerd "
                         f"(max_connections_per_user = {self.max_connections_per_user})")
            with contextlib.suppress(OSError):  # a fresh socket's buffer takes one line
                sock.send(encode({"id": None, "ok": False, "error": error_to_wire(err)}))
            sock.close()
            return
        self._per_uid[user] += 1
        conn = _Connection(self, self._loop, sock, peer)
        conn.user = user
        self._conns.add(conn)

    def _closed(self, conn: _Connection) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            n = self._per_uid[conn.user] - 1
            if n > 0:
                self._per_uid[conn.user] = n
            else:
                del self._per_uid[conn.user]

    # -- idle connections ------------------------------------------------------
    def _schedule_sweep(self) -> None:
        assert self._loop is not None
        every = min(max(self.idle_timeout / 4, 0.05), 5.0)
        self._sweeper = self._loop.call_later(every, self._sweep)

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns):
            conn.check_idle(now)
        self._schedule_sweep()

    # -- unsent replies ----------------------------------------------------------
    def queue(self, conn: _Connection, n: int) -> bool:
        """Count ``n`` more unsent reply bytes for ``conn``'s user; False (nothing
        counted) when a non-root user's would pass ``user_queued_max``."""
        if conn.peer.uid == 0:
            return True
        total = self._queued[conn.user] + n
        if total > self.user_queued_max:
            log.warning("uid %d does not read its replies: %d bytes of them would wait, "
                        "more than %d for one user; dropping a connection", conn.peer.uid,
                        total, self.user_queued_max)
            return False
        self._queued[conn.user] = total
        return True

    def sent(self, conn: _Connection, n: int) -> None:
        """``n`` unsent reply bytes of ``conn`` went out (or were thrown away)."""
        if conn.peer.uid == 0 or n <= 0:
            return
        left = self._queued[conn.user] - n
        if left > 0:
            self._queued[conn.user] = left
        else:
            del self._queued[conn.user]

    # -- requests --------------------------------------------------------------
    async def handle(self, peer: Peer, line: bytes) -> bytes:
        """One request line in, one reply line out (never raises)."""
        rid: Any = None
        cmd: Any = None
        try:
            msg = decode(line, MAX_REQUEST_NUMBERS)
            rid = reply_id(msg)
            cmd = msg.get("cmd")
            args = msg.get("args") or {}
            if not isinstance(cmd, str) or not isinstance(args, dict):
                raise UsageError("malformed message: needs 'cmd' (string) and 'args' (object)")
            handler = self.router.get(cmd)
            if handler is None:
                raise UsageError(f"unknown command {cmd[:100]!r}")
            check_items(cmd, args)
            result = await handler(Request(cmd=cmd, args=args, peer=peer))
            reply: dict[str, Any] = {"id": rid, "ok": True, "result": result}
        except TunerdError as err:
            reply = {"id": rid, "ok": False, "error": error_to_wire(err)}
        except Exception as err:
            log.exception("handler for %r failed", line[:200])
            reply = {"id": rid, "ok": False,
                     "error": error_to_wire(TunerdError(f"internal error: {err!r}"))}
        return self._encode(peer, line, rid, cmd, reply)

    def _encode(self, peer: Peer, line: bytes, rid: Any, cmd: Any,
                reply: dict[str, Any]) -> bytes:
        try:
            data = encode(reply)
        except (TypeError, ValueError) as err:  # NaN or an object in a result
            log.error("reply to %r cannot be sent as JSON: %s", line[:200], err)
            return encode({"id": rid, "ok": False, "error": error_to_wire(TunerdError(
                f"internal error: the reply could not be encoded as JSON ({err})"))})
        if len(data) > self.max_reply and peer.uid != 0:
            # an error, never a cut answer: a client must not act on half a list
            return encode({"id": rid, "ok": False, "error": error_to_wire(Failed(
                f"reply too large: the reply to {str(cmd)[:100]!r} is {len(data)} bytes, "
                f"more than the {self.max_reply} a non-root user may get "
                "(max_reply_bytes in tunerd.toml)"))})
        return data


def check_items(cmd: str, args: dict[str, Any]) -> None:
    """A UsageError when ``args`` hold more than MAX_ARG_ITEMS list and object items, all
    levels together, naming the argument that passes it; looks at no more than that many."""
    left = MAX_ARG_ITEMS - len(args)
    stack: list[tuple[str, Any]] = [(k, v) for k, v in args.items()
                                    if isinstance(v, (list, dict))]
    while stack:
        name, value = stack.pop()
        left -= len(value)
        if left < 0:
            raise UsageError(f"{cmd}: argument {name!r} is too large: a request's arguments "
                             f"hold at most {MAX_ARG_ITEMS} items (docs/security.md)")
        items = value.values() if isinstance(value, dict) else value
        stack += [(name, x) for x in items if isinstance(x, (list, dict))]


class _Resumed:
    """Hands a coroutine that already ran up to its first suspension over to a Task.

    The Task gets what the coroutine yielded (the future it waits on) and then
    drives it on with what it sends or throws in (a result, a cancellation):
    what ``yield from`` would do for a generator.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, bytes], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, bytes]:
        coro, value = self._coro, self._first
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # forwarded into the coroutine, not handled
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value


async def _finish(resumed: _Resumed) -> bytes:
    return await resumed


def error_line(err: TunerdError) -> bytes:
    return encode({"id": None, "ok": False, "error": error_to_wire(err)})


class _Connection:
    """One client: reads lines, runs them one at a time, writes replies in order."""

    __slots__ = ("_buf", "_closing", "_eof", "_fd", "_final", "_halted", "_incomplete",
                 "_later", "_lines", "_loop", "_out", "_reading", "_server", "_sock", "_task",
                 "_writing", "closing_since", "last", "peer", "user", "wrote")

    def __init__(self, server: ControlServer, loop: asyncio.AbstractEventLoop,
                 sock: socket.socket, peer: Peer) -> None:
        self._server = server
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self.peer = peer
        self.user = peer.uid  # whom it counts as (ControlServer.owner)
        self._buf = bytearray()
        self._out = bytearray()
        self._lines: deque[bytes] = deque()
        self._task: asyncio.Task[bytes] | None = None
        self._later: asyncio.Handle | None = None  # the rest of a turn's slice, queued
        self._final: bytes | None = None  # an error line to send last, then close
        self._eof = False
        self._incomplete = False  # the peer closed in the middle of a line
        self._closing = False  # close once the queued replies are out
        self.closing_since = 0.0
        self.last = time.monotonic()  # the last complete request or reply
        self.wrote = self.last  # the last time queued reply bytes went out
        self._writing = False
        self._reading = True  # the reader is registered
        self._halted = False  # reading stopped for good (end of stream, or a failure)
        loop.add_reader(self._fd, self._on_readable)

    # -- reading ---------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        if not data:
            self._stop_reading()
            self._eof = True
            self._incomplete = bool(self._buf.strip())
            self._buf.clear()
            self._pump()
            return
        buf = self._buf
        start = len(buf)
        buf += data
        pos = buf.find(b"\n", start)
        if pos >= 0:
            begin = 0
            while pos >= 0:
                self._lines.append(bytes(buf[begin:pos]))
                begin = pos + 1
                pos = buf.find(b"\n", begin)
            del buf[:begin]
            self.last = time.monotonic()
        if len(buf) > MAX_MESSAGE:
            buf.clear()
            self._fail(UsageError(
                f"message too large: requests are limited to {MAX_MESSAGE} bytes"))
            return
        self._pump()

    def _stop_reading(self) -> None:
        self._halted = True
        self._pause_reading()

    def _pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _flow(self) -> None:
        """Read only while no request already read waits to be run.

        Requests wait while one is in flight or while the client does not read
        its replies (over OUT_HIGH): reading on would queue its lines without
        bound. The kernel's socket buffer then fills and the client's sends block.
        """
        if self._lines:
            self._pause_reading()
        elif not self._reading and not self._halted and self._sock.fileno() >= 0:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    # -- running requests ------------------------------------------------------
    def _pump(self) -> None:
        """Start the next request, or finish the connection when nothing is left."""
        self._run_queued()
        self._flow()

    def _resume(self) -> None:
        self._later = None
        self._pump()

    def _run_queued(self) -> None:
        if self._sock.fileno() < 0 or self._later is not None:
            return
        # a slice of the loop per connection and wake-up: pipelined requests past it
        # wait behind the other connections' (and the loop's other callbacks) instead
        # of stalling them (issue 34 item 8: a user's batches of 200 binds)
        until = time.perf_counter() + TURN_SLICE
        while self._task is None and len(self._out) < OUT_HIGH and not self._closing:
            if self._lines and time.perf_counter() > until:
                self._later = self._loop.call_soon(self._resume)
                return
            if self._final is not None:
                self._send(self._final)
                self._final = None
                self._closing = True
                self._maybe_close()
                return
            if not self._lines:
                if self._eof:
                    if self._incomplete:
                        self._incomplete = False
                        self._final = error_line(UsageError(
                            "incomplete message: connection closed before the end of the line"))
                        continue
                    self._closing = True
                    self._maybe_close()
                return
            line = self._lines.popleft()
            if not line.strip():
                continue
            # run the handler right here up to its first real wait: most requests
            # (status, ping, jobs, bind) never wait, and then no task is needed
            # in a context of its own that names the peer: the log lines it causes
            # count against that uid's rate limit (tunerd.base.logutil.UserRateFilter)
            ctx = contextvars.copy_context()
            ctx.run(acting_for, self.user)
            coro = self._server.handle(self.peer, line)
            try:
                first = ctx.run(coro.send, None)
            except StopIteration as done:
                self.last = time.monotonic()
                self._send(done.value)
                continue
            task = ctx.run(self._loop.create_task, _finish(_Resumed(coro, first)))
            self._task = task
            task.add_done_callback(self._done)
            return

    def _done(self, task: asyncio.Task[bytes]) -> None:
        self._task = None
        if task.cancelled():
            return
        self.last = time.monotonic()
        self._send(task.result())
        self._pump()

    def _fail(self, err: TunerdError) -> None:
        """Answer ``err`` after the request in flight, then close: the stream is not
        to be trusted any more."""
        self._lines.clear()
        self._stop_reading()
        self._final = error_line(err)
        self._pump()

    def check_idle(self, now: float) -> None:
        if self._out and now - self.wrote > self._server.idle_timeout:
            # it sends requests but reads no replies: an error line would not be read
            # either, and what it queued must not be held forever (no pid in the
            # message: the log's repeat filter then limits one user's flood of these)
            log.warning("a control client of uid %d read no reply for %g s: dropping it",
                        self.peer.uid, self._server.idle_timeout)
            self.abort()
            return
        if self._closing:
            if not self.closing_since:
                self.closing_since = now
            elif now - self.closing_since > CLOSE_GRACE:
                self.abort()  # it does not read its last reply
            return
        if self._final is not None:
            return  # sent once the request in flight is answered
        if self._task is None and not self._lines and \
                now - self.last > self._server.idle_timeout:
            self._fail(UsageError(f"timeout: no complete request within "
                                  f"{self._server.idle_timeout:g} s"))

    # -- writing ---------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        if self._sock.fileno() < 0:
            return
        if not self._out:
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self.abort()
                return
            if n == len(data):
                return
            data = data[n:]
            self.wrote = time.monotonic()  # the time the unsent bytes start waiting
        if not self._server.queue(self, len(data)):
            self.abort()  # it does not read: an error line would wait unread too
            return
        self._out += data
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        try:
            n = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        del self._out[:n]
        self._server.sent(self, n)
        self.wrote = time.monotonic()
        if not self._out:
            self._writing = False
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._maybe_close()
            else:
                self._pump()

    # -- closing ---------------------------------------------------------------
    def _maybe_close(self) -> None:
        if self._closing and not self._out:
            self.abort()

    def abort(self, cancel: bool = False) -> None:
        """Close now. A request in flight still runs to its end (a client that goes
        away must not leave a change half made) unless ``cancel`` (daemon stop)."""
        if self._sock.fileno() < 0:
            return
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        if cancel and self._task is not None:
            self._task.cancel()
            self._task = None
        if self._later is not None:
            self._later.cancel()
            self._later = None
        self._server.sent(self, len(self._out))
        self._out.clear()
        self._lines.clear()  # read but not started: never run for a closed connection
        self._sock.close()
        self._server._closed(self)
