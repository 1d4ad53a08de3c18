"""The /metrics HTTP server: prometheus_client's WSGI app, with limits a shared node needs.

prometheus_client's own ``start_http_server`` starts one thread per connection and
waits for a request without end, so any local user can hold the daemon's threads by
the thousand (one half-sent request line each). This server keeps its use bounded:

- a request has ``REQUEST_TIMEOUT`` seconds from accept to the end of its reply, in
  all (not per recv(): a client sending a byte every 3 s is dropped at the deadline,
  its socket shut down by one reaper thread);
- at most ``PER_CLIENT`` connections at a time per client: per local user (the uid
  that owns the connecting socket, asked of the kernel's sock_diag as ``ss`` does) for
  a connection from this host, per address otherwise; root is not limited;
- at most ``MAX_HANDLERS`` at a time in all; a connection over a limit is closed at
  once (Prometheus then reports the scrape failed, and the daemon carries on);
- a listen backlog of 128, not socketserver's 5, so a burst of honest connects is not
  delayed by SYN retransmits.

Between scrapes the server's thread sleeps in poll(2) without a timeout: socketserver's
own loop wakes every 0.5 s to look for a shutdown request (two wake-ups a second,
~0.2 ms/s of the loaded daemon's CPU); here ``shutdown()`` wakes it through a pipe.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger("tunerd.monitor")



def _request_timeout(default: float = 10.0) -> float:
    """``default`` (Prometheus' default scrape timeout), or the seconds in the environment
    variable TUNERD_METRICS_REQUEST_TIMEOUT (tests set it low, so that their slow
    clients need not wait 10 s); a value that is not a number in (0, 3600] is named in a
    warning and ignored."""
    text = os.environ.get("TUNERD_METRICS_REQUEST_TIMEOUT", "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if 0 < value <= 3600:
        return value
    log.warning("ignored TUNERD_METRICS_REQUEST_TIMEOUT=%r: not a number of seconds in "
                "(0, 3600]; the metrics request timeout is %g s", text, default)
    return default


REQUEST_TIMEOUT = _request_timeout()
PER_CLIENT = 4
MAX_HANDLERS = 32


_SOCK_DIAG_BY_FAMILY = 20
_NETLINK_SOCK_DIAG = 4
_NLMSG_ERROR = 2
_NOCOOKIE = 0xFFFFFFFF


def socket_owner(client: tuple[Any, ...], server: tuple[Any, ...]) -> int | None:
    """The uid owning the socket on this host that connected from ``client`` to
    ``server`` (the accepted socket's own address), or None when there is none here
    (a connection from another host).

    One exact sock_diag lookup (what ``ss`` uses), about 20 us whatever the number of
    sockets; reading /proc/net/tcp instead walks the kernel's whole connection hash
    table, several milliseconds per read even on an idle host.
    """
    local = ipaddress.ip_address(str(client[0]).split("%", 1)[0])
    remote = ipaddress.ip_address(str(server[0]).split("%", 1)[0])
    family = socket.AF_INET if local.version == 4 else socket.AF_INET6
    # inet_diag_req_v2: family, protocol, extensions, pad, states; then inet_diag_sockid
    # (ports and addresses in network order, interface, cookie "none") of the socket
    # whose local end is the client
    req = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
           + struct.pack("!HH16s16s", int(client[1]), int(server[1]),
                         local.packed.ljust(16, b"\0"), remote.packed.ljust(16, b"\0"))
           + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE))
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 1, 1, 0) + req
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(msg, (0, 0))
            reply = nl.recv(4096)
    except OSError as err:
        log.debug("metrics: sock_diag lookup of %s failed: %s", client, err)
        return None
    if len(reply) < 16 + 72 or struct.unpack_from("=H", reply, 4)[0] == _NLMSG_ERROR:
        return None  # ENOENT: no such socket here
    # inet_diag_msg: family, state, timer, retrans, sockid (48), expires, rqueue, wqueue, uid
    return int(struct.unpack_from("=I", reply, 16 + 64)[0])


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT  # StreamRequestHandler puts it on the socket

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        key = getattr(self.server, "_keys", {}).get(id(self.request))
        # the local uid that owns the connecting socket (None: another host)
        env["tunerd.uid"] = key[1] if isinstance(key, tuple) and key[0] == "uid" else None
        return env

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing per request (prometheus_client's handler does the same)."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], app: Any,
                 per_client: int = PER_CLIENT, max_handlers: int = MAX_HANDLERS) -> None:
        family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self.address_family = family
        super().__init__(address, _Handler)
        self.set_app(app)
        self.per_client = per_client
        self.max_handlers = max_handlers
        self._lock = threading.Lock()
        self._open: Counter[Hashable] = Counter()
        self._keys: dict[int, Hashable] = {}  # id(request) -> its client key
        self.refused_total = 0
        # id(request) -> (deadline, socket): one reaper thread shuts down the late ones
        self._deadlines: dict[int, tuple[float, socket.socket]] = {}
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._reaper: threading.Thread | None = None
        self.dropped_late_total = 0
        # serve_forever's wake-up for shutdown(); set while serve_forever does not run
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._served = threading.Event()
        self._served.set()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """socketserver's loop (``poll_interval`` is ignored), asleep until a connection
        or ``shutdown()`` comes, instead of waking every ``poll_interval`` to look."""
        self._served.clear()
        try:
            with selectors.PollSelector() as sel:
                sel.register(self, selectors.EVENT_READ)
                sel.register(self._wake_r, selectors.EVENT_READ)
                while not self._stopping:
                    ready = sel.select()
                    if self._stopping:
                        break
                    if any(key.fileobj is self for key, _ in ready):
                        self._handle_request_noblock()  # type: ignore[attr-defined]
                    self.service_actions()
        finally:
            self._served.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait until it has returned (from another thread)."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread has been woken already
            pass
        self._served.wait()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        try:
            uid = socket_owner(client_address, request.getsockname())
        except OSError:  # the client has gone already
            return False
        key: Hashable = ("addr", str(client_address[0])) if uid is None else ("uid", uid)
        with self._lock:
            total = sum(self._open.values())
            if key != ("uid", 0) and (self._open[key] >= self.per_client
                                      or total >= self.max_handlers):
                self.refused_total += 1
                refused = True
            else:
                self._open[key] += 1
                self._keys[id(request)] = key
                self._deadlines[id(request)] = (time.monotonic() + REQUEST_TIMEOUT, request)
                self._start_reaper()
                self._wake.notify()
                refused = False
        if refused:
            log.debug("metrics: refused a connection from %s (%s over its limit)",
                      client_address, key)
        return not refused

    def _start_reaper(self) -> None:
        """(lock held) The thread that ends requests at their deadline, started once."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="tunerd-metrics-deadline",
                                            daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        with self._lock:
            while not self._closing:
                now = time.monotonic()
                late = [(k, s) for k, (t, s) in self._deadlines.items() if t <= now]
                for k, sock in late:
                    del self._deadlines[k]
                    self.dropped_late_total += 1
                    try:  # the handler's blocked recv()/send() returns; it then ends
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                nxt = min((t for t, _ in self._deadlines.values()), default=None)
                self._wake.wait(None if nxt is None else max(nxt - now, 0.01))

    def server_close(self) -> None:
        wake = getattr(self, "_wake", None)  # None: the bind in __init__ failed
        if wake is not None:
            with wake:
                self._closing = True
                wake.notify()
        for name in ("_wake_r", "_wake_w"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        super().server_close()

    def _release(self, request: Any) -> None:
        with self._lock:
            self._deadlines.pop(id(request), None)
            key = self._keys.pop(id(request), None)
            if key is not None:
                self._open[key] -= 1
                if self._open[key] <= 0:
                    del self._open[key]

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that went away or timed out is not worth a traceback in the journal
        log.debug("metrics: request from %s failed: %s", client_address, sys.exc_info()[1])


def with_health(app: Any, health: Callable[[], tuple[bool, str]]) -> Any:
    """``app`` plus ``GET /healthz``: 200 and "ok" while ``health()`` says so, else 503
    and the reason (the DaemonSet's liveness and readiness probes ask it)."""

    def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") != "/healthz":
            return app(environ, start_response)
        ok, text = health()
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8")])
        return [(text + "\n").encode()]

    return wrapped


def with_view(app: Any, view: Callable[[int], str]) -> Any:
    """``app``, except that a local non-root client's ``/metrics`` is ``view(uid)``
    (what that uid may read: hidepid, tunerd.monitor.service.Monitor.exposition_for)."""

    def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
        uid = environ.get("tunerd.uid")
        if uid is None or uid == 0 or environ.get("PATH_INFO") not in ("/metrics", "/"):
            return app(environ, start_response)
        body = view(uid).encode()
        start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; "
                                   "charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return wrapped


def serve_metrics(host: str, port: int, registry: Any,
                  health: Callable[[], tuple[bool, str]] | None = None,
                  view: Callable[[int], str] | None = None,
                  ) -> tuple[MetricsServer, threading.Thread]:
    """Start the server in a daemon thread (what ``start_http_server`` returns, bounded)."""
    from prometheus_client import make_wsgi_app

    app = make_wsgi_app(registry)
    if view is not None:
        app = with_view(app, view)
    server = MetricsServer((host, port), app if health is None else with_health(app, health))
    thread = threading.Thread(target=server.serve_forever, name="tunerd-metrics",
                              daemon=True)
    thread.start()
    return server, thread
