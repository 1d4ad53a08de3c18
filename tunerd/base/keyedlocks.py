"""Per-key asyncio locks that exist only while someone holds or waits for them.

A lock per PID kept for ever is state any user can make the daemon keep: one
``bind`` of a PID that does not exist used to leave its lock behind (~170 bytes a
request, issue 16 found 3). Here a key's lock is made on the first ``hold`` and
dropped when its last holder or waiter lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable

__all__ = ["KeyedLocks"]


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock_now, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock_now, users - 1)

    def pop(self, key: Hashable, default: object = None) -> object:
        """Nothing to drop: a lock lives only while used (kept for callers that did)."""
        return default
