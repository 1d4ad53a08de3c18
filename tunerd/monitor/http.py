"""The /metrics HTTP server: prometheus_client's WSGI app, with limits a shared node needs.

prometheus_client's own ``start_http_server`` starts one thread per connection and
waits for a request without end, so any local user can hold the daemon's threads by
the thousand (one half-sent request line each). This server keeps its use bounded:

- a request has ``REQUEST_TIMEOUT`` seconds to arrive and be answered;
- at most ``PER_CLIENT`` connections at a time per client: per local user (the uid
  that owns the connecting socket, read from /proc/net/tcp{,6} as identd does) for a
  connection from this host, per address otherwise; root is not limited;
- at most ``MAX_HANDLERS`` at a time in all; a connection over a limit is closed at
  once (Prometheus then reports the scrape failed, and the daemon carries on);
- a listen backlog of 128, not socketserver's 5, so a burst of honest connects is not
  delayed by SYN retransmits.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
from collections import Counter
from collections.abc import Hashable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

log = logging.getLogger("tunerd.monitor")

REQUEST_TIMEOUT = 10.0  # Prometheus' default scrape timeout
PER_CLIENT = 4
MAX_HANDLERS = 32


def _proc_net_hex(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """``addr`` as /proc/net/tcp{,6} print it: 32-bit words in host byte order, hex."""
    raw = addr.packed
    return "".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}"
                   for i in range(0, len(raw), 4))


def socket_owner(client: tuple[Any, ...], server_port: int,
                 proc_net: str = "/proc/net") -> int | None:
    """The uid owning the local socket that connected from ``client`` to ``server_port``,
    or None when there is none here (a connection from another host)."""
    addr = ipaddress.ip_address(str(client[0]).split("%", 1)[0])
    port = f":{int(client[1]):04X}"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    # an IPv4 client is in tcp, or in tcp6 as ::ffff:a.b.c.d when its socket is IPv6
    where = [("tcp6", _proc_net_hex(addr))] if addr.version == 6 else [
        ("tcp", _proc_net_hex(addr)),
        ("tcp6", _proc_net_hex(ipaddress.IPv6Address(f"::ffff:{addr}")))]
    server = f":{server_port:04X}"
    for name, hexaddr in where:
        want = hexaddr + port
        try:
            with open(f"{proc_net}/{name}", encoding="ascii", errors="replace") as f:
                next(f, None)  # header
                for line in f:
                    fields = line.split()
                    # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
                    if len(fields) > 7 and fields[1] == want and fields[2].endswith(server):
                        return int(fields[7])
        except OSError:
            continue
    return None


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT  # StreamRequestHandler puts it on the socket

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

    def _client_key(self, client: tuple[Any, ...]) -> Hashable:
        uid = socket_owner(client, self.server_address[1])
        return ("addr", str(client[0])) if uid is None else ("uid", uid)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        key = self._client_key(client_address)
        with self._lock:
            total = sum(self._open.values())
            if key != ("uid", 0) and (self._open[key] >= self.per_client
                                      or total >= self.max_handlers):
                self.refused_total += 1
                refused = True
            else:
                self._open[key] += 1
                self._keys[id(request)] = key
                refused = False
        if refused:
            log.debug("metrics: refused a connection from %s (%s over its limit)",
                      client_address, key)
        return not refused

    def _release(self, request: Any) -> None:
        with self._lock:
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


def serve_metrics(host: str, port: int, registry: Any) -> tuple[MetricsServer, threading.Thread]:
    """Start the server in a daemon thread (what ``start_http_server`` returns, bounded)."""
    from prometheus_client import make_wsgi_app

    server = MetricsServer((host, port), make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="tunerd-metrics",
                              daemon=True)
    thread.start()
    return server, thread
