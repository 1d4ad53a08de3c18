"""Control-socket client used by tunerctl (stdlib only: it is on every command's path).

It talks through ``_socket``, the C module the stdlib's ``socket`` wraps: ``socket.py``
builds four IntEnums of every AF_/SOCK_/MSG_/AI_ constant when imported, about a third
of what ``tunerctl bind`` adds to Python's start-up (bench/bind_latency.py), and this
client needs none of it: a Unix stream socket, connect, sendall, recv, getsockopt. The
object it makes is the same C socket type ``socket.socket`` subclasses, with the same
errors (OSError and its subclasses, TimeoutError).
"""

from __future__ import annotations

import _socket as socket  # socket.py imports it the same way; see above
import os
import struct
import time
from typing import Any

from tunerd.base.errors import DaemonUnreachable, PermissionDenied, TunerdError, UsageError
from tunerd.wire.protocol import DEFAULT_SOCKET, MAX_MESSAGE, decode, encode, error_from_reply

__all__ = ["Client", "check_server", "default_socket_path"]


def default_socket_path() -> str:
    return os.environ.get("TUNERD_SOCKET") or DEFAULT_SOCKET


def check_server(sock: socket.socket, path: str) -> None:
    """Refuse a server that is not root and not the owner of the socket's directory."""
    pid, uid, _gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid == 0:
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        owner = os.stat(directory).st_uid
    except OSError as err:
        raise DaemonUnreachable(f"cannot check who owns {directory}: {err.strerror}") from err
    if uid != owner:
        raise DaemonUnreachable(
            f"refusing the server on {path}: it runs as uid {uid} (pid {pid}), but tunerd "
            f"must run as root or as the owner of {directory} (uid {owner}); another user "
            "may be impersonating tunerd", server_uid=uid, server_pid=pid)


class Client:
    """One connection to the daemon; ``call`` sends a request and waits for its reply.

    Before the first request goes out the server's credentials are checked
    (SO_PEERCRED): it must run as root, or as the uid that owns the socket's
    directory (a daemon a user runs in a dir of their own). Anything else may be
    another user impersonating tunerd, so the client refuses it with
    DaemonUnreachable (exit 3) and a message saying why.
    """

    def __init__(self, path: str | None = None, timeout: float = 60.0) -> None:
        self.path = path or default_socket_path()
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""
        self._next_id = 1

    def connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            s.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                s.connect(self.path)
                break
            except BlockingIOError as err:
                # EAGAIN: the listen queue is full (a burst of connects); wait for room
                s.close()
                if time.monotonic() + delay > deadline:
                    raise DaemonUnreachable(
                        f"tunerd at {self.path} is too busy: its listen queue stayed full "
                        f"for {self.timeout:g} s") from err
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except PermissionError as err:
                s.close()
                raise PermissionDenied(f"cannot connect to {self.path}: {err.strerror}") from err
            except (OSError, TimeoutError) as err:
                s.close()
                raise DaemonUnreachable(
                    f"tunerd is not reachable at {self.path}: {err.strerror or err}") from err
        try:
            check_server(s, self.path)
        except BaseException:
            s.close()
            raise
        s.settimeout(self.timeout)
        self._sock = s

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, cmd: str, **args: Any) -> Any:
        """Send one request; return its result or raise the error the daemon sent."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        rid = self._next_id
        self._next_id += 1
        try:
            data = encode({"id": rid, "cmd": cmd, "args": args})
        except (TypeError, ValueError) as err:  # NaN, or a value JSON cannot hold
            raise UsageError(f"{cmd}: arguments cannot be sent as JSON: {err}") from err
        try:
            self._sock.sendall(data)
            line = self._readline()
        except (OSError, TimeoutError) as err:
            raise DaemonUnreachable(f"lost the connection to tunerd at {self.path}: {err}") from err
        try:
            reply = decode(line)
        except UsageError as err:
            raise TunerdError(f"malformed reply from tunerd at {self.path}: {err.message}") from err
        if reply.get("ok"):
            return reply.get("result")
        raise error_from_reply(reply.get("error") or {})

    def _readline(self) -> bytes:
        assert self._sock is not None
        while b"\n" not in self._buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise TunerdError(f"tunerd at {self.path} closed the connection")
            self._buf += chunk
            if len(self._buf) > 64 * MAX_MESSAGE:
                raise TunerdError(f"reply from tunerd at {self.path} is too large")
        line, _, self._buf = self._buf.partition(b"\n")
        return line
