"""GroupSave (issue 34 item 8): the saves of one loop turn are one write, and every
caller resumes only after a write that began after its call (save first stays)."""

from __future__ import annotations

import asyncio

from tunerd.base.errors import Failed
from tunerd.base.groupsave import GroupSave


def test_the_binds_of_one_turn_share_one_write_made_before_any_resumes() -> None:
    state: list[int] = []  # records put, as the registry's _put does
    written: list[list[int]] = []  # what each write held
    events: list[str] = []

    def save() -> None:
        written.append(list(state))
        events.append("write")

    group = GroupSave(save)

    async def bind(n: int) -> None:
        state.append(n)  # the record first
        await group()
        assert n in written[-1], "resumed before its record was written"
        events.append(f"apply {n}")  # the change, only now

    async def main() -> None:
        await asyncio.gather(*(bind(n) for n in range(50)))
        await bind(50)  # a later turn: a write of its own

    asyncio.run(main())
    assert written == [list(range(50)), list(range(51))]
    assert events[0] == "write" and events[51] == "write"
    assert group.writes == 2 and group.asked == 51


def test_a_failed_write_is_raised_to_every_caller_of_the_turn() -> None:
    calls = 0

    def save() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Failed("cannot write state.json: No space left on device (errno 28)")

    group = GroupSave(save)

    async def main() -> list[BaseException | None]:
        return await asyncio.gather(*(group() for _ in range(5)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, Failed) for r in results), results
    asyncio.run(group())  # the next turn writes again
    assert calls == 2
