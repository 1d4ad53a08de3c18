"""The control socket: JSON lines over a Unix stream socket, with peer credentials.

Robustness rules: every connection has an idle timeout; a line over 1 MiB, a
malformed message or a half-sent message gets an error reply (then the
connection is closed where the stream can no longer be trusted); a failing
handler never takes the server down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from tunerd.daemon.router import Peer, Request, Router
from tunerd.errors import TunerdError, UsageError
from tunerd.protocol import MAX_MESSAGE, decode, encode, error_to_wire

log = logging.getLogger("tunerd.server")

IDLE_TIMEOUT = 30.0  # seconds a client may stay silent before it is dropped


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid=pid, uid=uid, gid=gid)


class ControlServer:
    def __init__(self, router: Router, path: Path, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.router = router
        self.path = Path(path)
        self.idle_timeout = idle_timeout
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), limit=MAX_MESSAGE
        )
        # Everyone may connect; what a peer may do is decided per request from SO_PEERCRED.
        os.chmod(self.path, 0o666)
        log.info("control socket listening on %s", self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for t in list(self._conns):
            t.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            peer = peer_credentials(writer.get_extra_info("socket"))
            await self._session(peer, reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a broken connection must never reach the loop
            log.exception("control connection failed")
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _session(
        self, peer: Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), self.idle_timeout)
            except asyncio.TimeoutError:
                await self._reply_error(writer, None, UsageError(
                    f"timeout: no complete request within {self.idle_timeout:g} s"))
                return
            except asyncio.IncompleteReadError as err:
                if err.partial.strip():
                    await self._reply_error(writer, None, UsageError(
                        "incomplete message: connection closed before the end of the line"))
                return
            except asyncio.LimitOverrunError:
                await self._reply_error(writer, None, UsageError(
                    f"message too large: requests are limited to {MAX_MESSAGE} bytes"))
                return
            if not line.strip():
                continue
            reply = await self._dispatch(peer, line)
            writer.write(encode(reply))
            await writer.drain()

    async def _dispatch(self, peer: Peer, line: bytes) -> dict[str, Any]:
        rid: Any = None
        try:
            msg = decode(line)
            rid = msg.get("id")
            cmd = msg.get("cmd")
            args = msg.get("args") or {}
            if not isinstance(cmd, str) or not isinstance(args, dict):
                raise UsageError("malformed message: needs 'cmd' (string) and 'args' (object)")
            handler = self.router.get(cmd)
            if handler is None:
                raise UsageError(f"unknown command {cmd!r}")
            req = Request(cmd=cmd, args=args, peer=peer)
            result = await handler(req)
            return {"id": rid, "ok": True, "result": result}
        except TunerdError as err:
            return {"id": rid, "ok": False, "error": error_to_wire(err)}
        except Exception as err:
            log.exception("handler for %r failed", line[:200])
            return {"id": rid, "ok": False,
                    "error": error_to_wire(TunerdError(f"internal error: {err!r}"))}

    async def _reply_error(
        self, writer: asyncio.StreamWriter, rid: Any, err: TunerdError
    ) -> None:
        with contextlib.suppress(Exception):
            writer.write(encode({"id": rid, "ok": False, "error": error_to_wire(err)}))
            await asyncio.wait_for(writer.drain(), 1.0)
