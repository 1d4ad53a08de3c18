"""A ledger as the daemon's is when the exec watcher's thread runs the intake: attached
to an asyncio loop running in another thread (tunerd.jobs.ledger), so a quick look keeps
a parent's ancestry on the parent's pidfd, as in the daemon."""

from __future__ import annotations

import asyncio
import threading

from tunerd.jobs.ledger import Ledger


def attached_ledger() -> Ledger:
    """A Ledger attached to a loop that runs in a daemon thread until the bench exits."""
    ledger = Ledger()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="ledger-loop").start()

    async def attach() -> None:
        ledger.attach()

    asyncio.run_coroutine_threadsafe(attach(), loop).result(timeout=10)
    return ledger
