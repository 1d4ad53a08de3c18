"""Hostile messages on the control socket (issue 9, found 9): clean usage errors,
replies that are always valid JSON, no tracebacks in the log."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tunerd.daemon.cmd_core  # noqa: F401 - registers ping
from tests.helpers import DaemonProc, run_as
from tests.security_helpers import exchange, strict_json
from tunerd.base.errors import UsageError
from tunerd.daemon.router import Peer, Request, Router
from tunerd.daemon.server import ControlServer
from tunerd.wire.client import Client
from tunerd.wire.protocol import decode, encode


def test_deep_nesting_nan_and_odd_ids_from_any_user(module_daemon: DaemonProc,
                                                    unpriv_user: tuple[int, int]) -> None:
    daemon = module_daemon  # read-only: one daemon for the module's such tests
    uid, gid = unpriv_user
    sock = str(daemon.socket)
    msgs = [
        b"[" * 100_000,
        b'{"id":NaN,"cmd":"ping","args":{}}',
        b'{"id":1,"cmd":"ping","args":{"x":Infinity}}',
        b'{"id":2,"cmd":"ping","args":{"x":1e999}}',
        b'{"id":{"a":[1]},"cmd":"ping","args":{}}',
        b'{"id":1.5,"cmd":"ping","args":{}}',
        b'{"id":true,"cmd":"ping","args":{}}',
        b'{"id":"x","cmd":"ping","args":{}}',
        b'{"id":7,"cmd":"ping","args":{}}',
    ]
    replies = run_as(uid, gid, exchange, sock, b"\n".join(msgs) + b"\n")
    assert len(replies) == len(msgs)
    nest, nan, inf, big, obj_id, float_id, bool_id, str_id, int_id = replies
    assert nest["error"]["code"] == "usage" and "nested too deeply" in nest["error"]["message"]
    assert nan["id"] is None and nan["error"]["code"] == "usage" and "NaN" in \
        nan["error"]["message"]
    assert inf["id"] is None and "Infinity" in inf["error"]["message"]
    assert big["id"] is None and "1e999" in big["error"]["message"]
    assert [r["id"] for r in (obj_id, float_id, bool_id)] == [None, None, None]
    assert obj_id["ok"] and float_id["ok"] and bool_id["ok"]
    assert (str_id["id"], int_id["id"]) == ("x", 7) and int_id["result"]["pong"]
    assert "Traceback" not in daemon.log() and "RecursionError" not in daemon.log()


def test_long_cgroup_scope_is_a_usage_error(module_daemon: DaemonProc) -> None:
    daemon = module_daemon  # read-only: one daemon for the module's such tests
    scope = "cgroup:/" + "a" * 300
    r = daemon.ctl("alloc", "--ncpus", "1", "--exclusive", "--exclusive-scope", scope)
    assert r.rc == 2, r
    assert "longer than 255 bytes" in r.err and "internal error" not in r.err
    with Client(str(daemon.socket), timeout=10) as c, \
            pytest.raises(UsageError, match="longer than 255 bytes"):
        c.call("alloc", ncpus=1, exclusive=True, exclusive_scope="cgroup:/a/" + "b" * 5000)
    assert "Traceback" not in daemon.log()


def test_a_reply_that_cannot_be_json_becomes_an_error_reply() -> None:
    """A handler result with NaN (or an object) must not reach the wire as invalid JSON."""
    async def nan(req: Request) -> dict[str, Any]:
        return {"value": float("nan")}

    router = Router()
    router.add("test.nan", nan)
    srv = ControlServer(router, Path("/nonexistent/tunerd.sock"))
    line = asyncio.run(srv.handle(Peer(1, 0, 0), b'{"id":3,"cmd":"test.nan","args":{}}'))
    reply = strict_json(line)
    assert reply["id"] == 3 and not reply["ok"]
    assert "could not be encoded" in reply["error"]["message"]
    with pytest.raises(ValueError):
        encode({"x": float("inf")})


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 st.recursive(st.none() | st.booleans() | st.floats() | st.integers()
                              | st.text(max_size=20),
                              lambda kids: st.lists(kids, max_size=4)
                              | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                              max_leaves=20).map(lambda o: json.dumps(o).encode())))
def test_any_line_gets_exactly_one_valid_json_reply(line: bytes) -> None:
    srv = ControlServer(Router(), Path("/nonexistent/tunerd.sock"))
    out = asyncio.run(srv.handle(Peer(1, 1000, 1000), line.replace(b"\n", b" ")))
    assert out.endswith(b"\n") and out.count(b"\n") == 1
    reply = strict_json(out)
    assert set(reply) >= {"id", "ok"}
    assert reply["id"] is None or isinstance(reply["id"], (str, int))


def test_decode_refuses_non_json_numbers_and_deep_nesting() -> None:
    for bad in (b"[" * 100_000, b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1e400}',
                b'{"a": ' + b"1" * 5000 + b"}"):
        with pytest.raises(UsageError):
            decode(bad)
    assert decode(b'{"a": 1.5e3}') == {"a": 1500.0}


def test_handlers_that_wait_answer_in_order(tmp_path: Path) -> None:
    """Handlers run inline until their first wait, then in a task: replies keep order."""
    async def slow(req: Request) -> dict[str, Any]:
        await asyncio.sleep(0.2)
        return {"slow": req.args.get("n")}

    async def late_error(req: Request) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        raise UsageError("late")

    async def scenario() -> list[Any]:
        srv = ControlServer(router, tmp_path / "t.sock")
        await srv.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "t.sock"))
            writer.write(b'{"id":1,"cmd":"test.slow","args":{"n":1}}\n'
                         b'{"id":2,"cmd":"ping","args":{}}\n'
                         b'{"id":3,"cmd":"test.late","args":{}}\n'
                         b'{"id":4,"cmd":"test.slow","args":{"n":4}}\n')
            out = [strict_json(await reader.readline()) for _ in range(4)]
            writer.close()
            return out
        finally:
            await srv.stop()

    async def ping(req: Request) -> dict[str, Any]:
        return {"pong": True}

    router = Router()
    router.add("test.slow", slow)
    router.add("test.late", late_error)
    router.add("ping", ping)
    replies = asyncio.run(scenario())
    assert [r["id"] for r in replies] == [1, 2, 3, 4]
    assert replies[0]["result"] == {"slow": 1} and replies[1]["result"]["pong"]
    assert replies[2]["error"]["message"] == "late" and replies[3]["result"] == {"slow": 4}
    assert not (tmp_path / "t.sock").exists()
