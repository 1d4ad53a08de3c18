"""GroupSave: the saves asked for in one turn of the event loop, made as one write.

A bind saves its record (with the originals) before it changes the process. Under
load many binds run in one turn of the loop (one per connection that was readable),
and each used to rewrite the whole runtime state file. Here each caller puts its
record in the state first, then awaits ``GroupSave()``: the first caller of a turn
schedules one write with ``call_soon``, which runs after every callback already
ready in this turn, and every caller resumes only after that write. So the order
stays save first, change after, for each of them, and 50 binds of a turn cost one
write instead of 50 (bench/control_load.py --mix).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["GroupSave"]


class GroupSave:
    """``await group()``: returns once a write that began after the call has succeeded;
    raises that write's error (the same error for every caller of the turn)."""

    def __init__(self, save: Callable[[], None]) -> None:
        self._save = save
        self._waiting: list[asyncio.Future[None]] | None = None
        self.writes = 0  # writes made (one per turn that asked)
        self.asked = 0  # callers served

    async def __call__(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self._waiting is None:
            self._waiting = []
            loop.call_soon(self._write)
        self._waiting.append(fut)
        await fut

    def _write(self) -> None:
        waiting, self._waiting = self._waiting or [], None
        self.writes += 1
        self.asked += len(waiting)
        try:
            self._save()
        except Exception as err:  # handed to every caller, who raises it (none may hang)
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(err)
            return
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)
