"""Every integer on the wire is range-checked at the protocol boundary (issue 28, found 4).

A PID past the kernel's range (``unbind`` of 10^12: 13 digits, inside the protocol's
19) used to reach ``os.pidfd_open`` and answer ``internal error: OverflowError`` with
a 15-line traceback in the log for every request. Replayed by the real test user.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import DaemonProc, run_as
from tests.security_helpers import exchange

pytestmark = pytest.mark.root

HUGE = [10**12, 2**31, 2**32 + 5, 2**63 - 1, -1, -(2**63), 0, 4_194_305]


def _requests() -> list[tuple[str, dict[str, Any]]]:
    reqs: list[tuple[str, dict[str, Any]]] = []
    for n in HUGE:
        reqs += [("unbind", {"pid": n}), ("bind", {"pid": n, "cpus": "0"}),
                 ("bind", {"pid": n, "gpus": "0"}), ("advise", {"pid": n}),
                 ("report", {"pid": n, "step_time": 1.0})]
    for n in (10**12, 2**63 - 1, -1, 1 << 40):
        reqs += [("alloc", {"ncpus": n}), ("alloc", {"gpus": n}),
                 ("alloc", {"ncpus": 1, "workers": n}),
                 ("bind", {"pid": 1, "ncpus": n}), ("bind", {"pid": 1, "nofile": n}),
                 ("bind", {"pid": 1, "cpus": [n]}), ("bind", {"pid": 1, "gpus": [n]}),
                 ("bind", {"pid": 1, "cpus": str(n)}), ("bind", {"pid": 1, "mems": [n]})]
    return reqs


def _payload(reqs: list[tuple[str, dict[str, Any]]], repeat: int) -> bytes:
    return b"".join(json.dumps({"id": i, "cmd": c, "args": a}).encode() + b"\n"
                    for i, (c, a) in enumerate(reqs * repeat))


def test_out_of_range_integers_are_usage_errors_not_internal(
        module_daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    d = module_daemon
    before = len(d.log().splitlines())
    reqs = _requests()
    replies = run_as(*unpriv_user, exchange, str(d.socket), _payload(reqs, 10), 60)
    assert len(replies) == len(reqs) * 10
    internal = [(reqs[r["id"] % len(reqs)], r["error"]["message"]) for r in replies
                if not r["ok"] and "internal error" in r["error"]["message"]]
    assert not internal, internal[:5]
    for r in replies:
        assert not r["ok"], r
        assert r["error"]["code"] in ("usage", "no_such_process", "permission"), r
    # a PID past the kernel's range is a usage error naming it
    by_req = {reqs[r["id"]][0] + repr(reqs[r["id"]][1]): r for r in replies[:len(reqs)]}
    r = by_req["unbind" + repr({"pid": 10**12})]
    assert r["error"]["code"] == "usage" and r["error"]["exit"] == 2, r
    assert "1000000000000" in r["error"]["message"] and "pid" in r["error"]["message"]
    log = d.log().splitlines()[before:]
    assert "Traceback" not in "\n".join(log)
    assert len(log) < 100, log[-20:]


def test_cli_says_usage_for_a_pid_past_the_kernels_range(
        module_daemon: DaemonProc, unpriv_user: tuple[int, int]) -> None:
    from tests.security_helpers import ctl_as

    for cmd in (["unbind", "1000000000000"], ["bind", "1000000000000", "--cpus", "0"]):
        r = ctl_as(unpriv_user, module_daemon.socket, *cmd)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert "internal error" not in r.stderr and "1000000000000" in r.stderr, r.stderr


def test_a_users_tracebacks_count_every_line_against_her_log_limit() -> None:
    """A traceback is ~15 lines: 20 of them were 300 lines past the 20-line limit."""
    import contextvars
    import io
    import logging

    from tunerd.base.logutil import EscapeFilter, UserRateFilter, acting_for

    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    h.addFilter(EscapeFilter())
    h.addFilter(UserRateFilter(burst=20, window=60.0))
    logger = logging.getLogger("tunerd.test.ranges")
    logger.propagate = False
    logger.addHandler(h)

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        raise OverflowError("signed integer is greater than maximum")

    def flood() -> None:
        acting_for(999)
        for i in range(200):
            try:
                deep(6)
            except OverflowError:
                logger.exception("handler for request %d failed", i)

    try:
        contextvars.copy_context().run(flood)
        contextvars.copy_context().run(lambda: (acting_for(0), logger.error("root's line")))
    finally:
        logger.removeHandler(h)
    lines = out.getvalue().splitlines()
    assert len(lines) <= 22, f"{len(lines)} lines:\n" + "\n".join(lines[-30:])
    assert any("further lines its requests cause are suppressed" in ln for ln in lines)
    assert lines[-1] == "ERROR root's line"
