"""sd_notify(3) protocol: READY=1, RELOADING=1, STOPPING=1, WATCHDOG=1, STATUS=...

Implemented directly (a datagram to $NOTIFY_SOCKET) so that the daemon needs no
libsystemd binding. Abstract sockets are written with a leading '@'.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def watchdog_interval(self) -> float | None:
        """Half of WATCHDOG_USEC in seconds, if the watchdog is on for this process."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return max(int(usec) / 2e6, 0.01)
        except ValueError:
            return None

    def send(self, *fields: str) -> None:
        if self._sock is None or not self.address:
            return
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            self._sock.sendto("\n".join(fields).encode(), addr)
        except OSError:
            pass  # a notification that cannot be sent must never stop the daemon

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets Type=notify-reload units (systemd >= 253) match the reload
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading policies")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")
