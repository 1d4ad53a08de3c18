"""Control-socket client used by tunerctl (stdlib only: it is on every command's path)."""

from __future__ import annotations

import os
import socket
from typing import Any

from tunerd.errors import DaemonUnreachable, PermissionDenied, TunerdError
from tunerd.protocol import DEFAULT_SOCKET, MAX_MESSAGE, decode, encode, error_from_reply

__all__ = ["Client", "default_socket_path"]


def default_socket_path() -> str:
    return os.environ.get("TUNERD_SOCKET") or DEFAULT_SOCKET


class Client:
    """One connection to the daemon; ``call`` sends a request and waits for its reply."""

    def __init__(self, path: str | None = None, timeout: float = 60.0) -> None:
        self.path = path or default_socket_path()
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""
        self._next_id = 1

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except PermissionError as err:
            s.close()
            raise PermissionDenied(f"cannot connect to {self.path}: {err.strerror}") from err
        except OSError as err:
            s.close()
            raise DaemonUnreachable(
                f"tunerd is not reachable at {self.path}: {err.strerror or err}"
                " (is the daemon running? see `systemctl status tunerd`)"
            ) from err
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
            self._sock.sendall(encode({"id": rid, "cmd": cmd, "args": args}))
            line = self._readline()
        except (OSError, TimeoutError) as err:
            raise DaemonUnreachable(f"lost the connection to tunerd at {self.path}: {err}") from err
        reply = decode(line)
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
                raise TunerdError("reply from tunerd is too large")
        line, _, self._buf = self._buf.partition(b"\n")
        return line
