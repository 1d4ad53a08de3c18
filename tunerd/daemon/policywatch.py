"""Reload the policies when the policy directory changes (inotify), within 1 s.

A ConfigMap mounted as a directory is updated by the kubelet atomically: the new
files go into a fresh ``..<timestamp>`` directory, a ``..data_tmp`` symlink to it is
renamed over ``..data``, and the visible ``NAME.toml`` entries are symlinks through
``..data`` that never change. So the directory itself is watched for every kind of
entry change (the rename shows as ``IN_MOVED_TO ..data``), plus writes of files in
it for a plain directory edited in place.

A burst of events is settled for ``SETTLE`` seconds, then the content of the
``*.toml`` files is hashed: the same content as the policy in force (a rollout that
changed nothing, an editor's temporary file) reloads nothing, so it makes no host
write and no revert. Otherwise the daemon's own reload runs, exactly as SIGHUP's: a
bad update is rejected, the old policy stays and the error is shown by
``tunerctl status``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tunerd.policy.loader import MAX_FILE_BYTES

__all__ = ["PolicyWatch", "policy_dir_hash"]

log = logging.getLogger("tunerd.policywatch")

SETTLE = 0.1  # seconds without a new event before reading the directory
# A missing directory: its nearest existing ancestor is watched for entries created or
# moved in, and the directory tried again on each such event, else every RETRY
# seconds (a backstop: a mount appearing shows no event). It was a try every 0.5 s.
RETRY = 5.0


def policy_dir_hash(policy_dir: Path) -> str:
    """sha256 over the names and contents of the ``*.toml`` files (symlinks followed)."""
    h = hashlib.sha256()
    try:
        names = sorted(e.name for e in os.scandir(policy_dir)
                       if e.name.endswith(".toml") and not e.name.startswith("."))
    except OSError:
        return "missing"
    for name in names:
        data = _read_regular(policy_dir / name)
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _read_regular(path: Path) -> bytes:
    """The file's bytes, at most MAX_FILE_BYTES + 1 of them (one larger than a policy
    may be is stood for by its size and times, unread); a FIFO, device or directory is
    never read (O_NONBLOCK, and
    fstat before any read: a FIFO would block the thread). Symlinks are followed, as
    the loader follows them: a ConfigMap's entries are symlinks through ``..data``
    (so not safefs.read_regular, which refuses symlinks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        return f"unopenable: {err.errno}".encode()
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file: {stat.S_IFMT(st.st_mode)}".encode()
        if st.st_size > MAX_FILE_BYTES:  # the loader refuses it unread: so does the hash
            return (f"too large: {st.st_size} {st.st_mtime_ns} {st.st_ino} "
                    f"{st.st_ctime_ns}").encode()
        chunks: list[bytes] = []
        total = 0
        while total <= MAX_FILE_BYTES:  # one that grows meanwhile: at most this much
            b = os.read(fd, min(1 << 16, MAX_FILE_BYTES + 1 - total))
            if not b:
                break
            chunks.append(b)
            total += len(b)
        return b"".join(chunks)
    except OSError as err:
        return f"unreadable: {err.errno}".encode()
    finally:
        os.close(fd)


class PolicyWatch:
    """A service: ``reload()`` (the daemon's) after each change of the policy dir."""

    name = "policywatch"

    def __init__(self, policy_dir: Path | None,
                 reload: Callable[[], Awaitable[dict[str, Any]]], *,
                 settle: float = SETTLE) -> None:
        self.dir = policy_dir
        self._reload = reload
        self.settle = settle
        self._ino: Any = None
        self._wd: int | None = None
        self._parent_wd: int | None = None  # the nearest ancestor, while dir is missing
        self._hash: str | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.reloads_total = 0
        self.unchanged_total = 0  # changes of the dir that left the policy as it was
        self.last_error: str | None = None

    async def start(self) -> None:
        if self.dir is None:
            return
        try:
            from inotify_simple import INotify
        except ImportError as err:  # pragma: no cover - a dependency
            self.last_error = f"inotify_simple is missing ({err}): reload with SIGHUP"
            return
        self._ino = INotify()
        asyncio.get_running_loop().add_reader(self._ino.fileno(), self._on_events)
        self._hash = policy_dir_hash(self.dir)
        self._add_watch()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._ino is not None:
            asyncio.get_running_loop().remove_reader(self._ino.fileno())
            self._ino.close()
            self._ino = None

    def status(self) -> dict[str, Any]:
        if self.dir is None:
            return {"summary": "no policy dir to watch (bundled default)"}
        watching = self._wd is not None
        return {"summary": (f"watching {self.dir}" if watching
                            else f"not watching {self.dir}: {self.last_error}")
                + f"; {self.reloads_total} reload(s) on change",
                "watching": watching, "reloads_total": self.reloads_total,
                "unchanged_total": self.unchanged_total, "hash": self._hash}

    # -- watching ----------------------------------------------------------------------
    def _add_watch(self) -> bool:
        from inotify_simple import flags

        mask = (flags.CREATE | flags.DELETE | flags.MODIFY | flags.CLOSE_WRITE
                | flags.MOVED_TO | flags.MOVED_FROM | flags.ATTRIB | flags.DELETE_SELF
                | flags.MOVE_SELF | flags.ONLYDIR)
        assert self.dir is not None and self._ino is not None
        try:
            self._wd = self._ino.add_watch(str(self.dir), mask)
        except OSError as err:
            self._wd = None
            self.last_error = f"{self.dir}: {err.strerror}"
            return False
        self.last_error = None
        return True

    def _on_events(self) -> None:
        from inotify_simple import flags

        try:
            events = self._ino.read(timeout=0)
        except OSError:
            return
        for e in events:
            if e.wd != self._wd:  # the ancestor's (or a watch already removed)
                if e.wd == self._parent_wd and e.mask & flags.IGNORED:
                    self._parent_wd = None  # the ancestor went too: found anew
                continue
            if e.mask & (flags.IGNORED | flags.DELETE_SELF | flags.MOVE_SELF):
                self._wd = None  # the directory went away: watch it again when back
        self._changed.set()

    def _watch_parent(self) -> None:
        """Watch the nearest existing ancestor of the missing dir for new entries."""
        from inotify_simple import flags

        assert self.dir is not None and self._ino is not None
        self._unwatch_parent()
        d = self.dir.parent
        while True:
            try:
                self._parent_wd = self._ino.add_watch(
                    str(d), flags.CREATE | flags.MOVED_TO | flags.ONLYDIR)
                return
            except OSError:
                if d == d.parent:
                    return
                d = d.parent

    def _unwatch_parent(self) -> None:
        if self._parent_wd is not None:
            try:
                self._ino.rm_watch(self._parent_wd)
            except OSError:
                pass  # removed with its directory
            self._parent_wd = None

    async def _wait_for_dir(self) -> None:
        """Until the dir can be watched: tried on each entry made in its nearest existing
        ancestor, and every RETRY seconds."""
        loop = asyncio.get_running_loop()
        while True:
            self._watch_parent()
            if self._add_watch():  # made before the parent watch was in place
                break
            self._changed.clear()
            timer = loop.call_later(RETRY, self._changed.set)
            await self._changed.wait()
            timer.cancel()
            if self._add_watch():
                break
        self._unwatch_parent()

    async def _run(self) -> None:
        while True:
            if self._wd is None:
                await self._wait_for_dir()
            else:
                await self._changed.wait()
            # settle: the kubelet's swap (or an editor) is several events in a row
            while True:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), self.settle)
                except asyncio.TimeoutError:
                    break
            self._changed.clear()
            try:
                await self._check()
            except Exception as err:  # never end the watching
                log.exception("policy dir check failed: %r", err)

    async def _check(self) -> None:
        assert self.dir is not None
        new = await asyncio.get_running_loop().run_in_executor(None, policy_dir_hash,
                                                               self.dir)
        if new == self._hash:
            self.unchanged_total += 1
            log.debug("policy dir %s changed, its policies did not: nothing reloaded",
                      self.dir)
            return
        log.info("policy dir %s changed: reloading", self.dir)
        # a rejected update is remembered too: the same bad files are not re-read until
        # they change again (the error stays in `tunerctl status`)
        self._hash = new
        self.reloads_total += 1
        await self._reload()
