"""`tunerctl fleet check` against a hostile HTTP server on loopback (issue 28, found 7).

A malformed status line crashed it with a traceback that printed raw escape sequences;
NaN, Inf and wrongly shaped answers crashed it; a server sending one byte every few
seconds held it with no overall deadline; an 800 MB body took it to 2.5 GB; redirects
to ``ftp://`` and to other hosts were followed. Each is replayed here, run by the real
test user; every bad answer must be one escaped line and a documented exit code.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.security_helpers import ctl_as

pytestmark = pytest.mark.root

OK_BODY = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
    {"metric": {"instance": "a:9", "class": "c"}, "value": [1, "1"]},
    {"metric": {"instance": "b:9", "class": "c"}, "value": [1, "1"]}]}}).encode()


def _response(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode() + body


@contextmanager
def hostile(serve: Callable[[socket.socket, int], None]) -> Iterator[str]:
    """A loopback server; ``serve(conn, n)`` answers the n-th connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            n += 1
            threading.Thread(target=_one, args=(conn, n), daemon=True).start()

    def _one(conn: socket.socket, n: int) -> None:
        try:
            conn.settimeout(30)
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            serve(conn, n)
        except OSError:
            pass
        finally:
            conn.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        srv.close()


def _check(user: tuple[int, int], url: str, *extra: str, timeout: float = 60.0
           ) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = ctl_as(user, "/nonexistent/tunerd.sock", "fleet", "check", "--prometheus", url,
               *extra, timeout=timeout)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def _one_clean_line(out: str) -> None:
    assert "Traceback" not in out, out
    assert "\x1b" not in out and "\r" not in out, repr(out)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tunerctl: error:"), out


BAD_ANSWERS: dict[str, bytes] = {
    "status line": b"HTTP/1.1 2\x1b[31mOO\x1b]0;pwned\x07 OK\r\n\r\n",
    "garbage": b"\x1b[2J\x1b[31mnot http at all\r\n\r\n",
    "nan": _response(b'{"status":"success","data":{"result":[{"metric":{"instance":"a"},'
                     b'"value":[1,NaN]}]}}'),
    "nan string": _response(json.dumps({"status": "success", "data": {"result": [
        {"metric": {"instance": "a", "class": "c"}, "value": [1, "NaN"]}]}}).encode()),
    "inf": _response(json.dumps({"status": "success", "data": {"result": [
        {"metric": {"instance": "a", "class": "c"}, "value": [1, "+Inf"]}]}}).encode()),
    "result not a list": _response(b'{"status":"success","data":{"result":"x"}}'),
    "series not objects": _response(b'{"status":"success","data":{"result":[1,2]}}'),
    "metric not an object": _response(b'{"status":"success","data":{"result":'
                                      b'[{"metric":[1],"value":[1,"1"]}]}}'),
    "value short": _response(b'{"status":"success","data":{"result":'
                             b'[{"metric":{"instance":"a"},"value":[1]}]}}'),
    "body not an object": _response(b'[1,2,3]'),
    "data not an object": _response(b'{"status":"success","data":7}'),
    "label not a string": _response(b'{"status":"success","data":{"result":'
                                    b'[{"metric":{"instance":{"x":1}},"value":[1,"1"]}]}}'),
    "escape in error": _response(b'{"status":"error","error":"\\u001b[31mred\\r\\nfake"}'),
}


@pytest.mark.parametrize("name", sorted(BAD_ANSWERS))
def test_every_bad_answer_is_one_escaped_line(name: str, unpriv_user: tuple[int, int]
                                              ) -> None:
    payload = BAD_ANSWERS[name]

    def serve(conn: socket.socket, n: int) -> None:
        conn.sendall(payload)

    with hostile(serve) as url:
        rc, out, _ = _check(unpriv_user, url)
    assert rc in (1, 3), (rc, out)
    _one_clean_line(out)


def test_a_slow_server_meets_one_overall_deadline(unpriv_user: tuple[int, int]) -> None:
    def serve(conn: socket.socket, n: int) -> None:
        head = _response(OK_BODY)
        for b in head:  # one byte a second: no single read ever times out
            conn.sendall(bytes([b]))
            time.sleep(1.0)

    with hostile(serve) as url:
        rc, out, took = _check(unpriv_user, url, "--deadline", "3", "--timeout", "2")
    assert took < 8, (took, out)
    assert rc == 1 and "deadline" in out, (rc, out)
    _one_clean_line(out)


def test_a_huge_body_is_capped(unpriv_user: tuple[int, int]) -> None:
    size = 800 << 20

    def serve(conn: socket.socket, n: int) -> None:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {size}\r\n\r\n".encode() + b'{"status":"success","x":"')
        chunk = b"a" * (1 << 20)
        for _ in range(size >> 20):
            conn.sendall(chunk)

    with hostile(serve) as url:
        rc, out, took = _check(unpriv_user, url)
    assert rc == 1 and "larger than" in out and took < 30, (rc, out, took)
    _one_clean_line(out)


@pytest.mark.parametrize("where", ["ftp://127.0.0.1/x", "http://127.0.0.2:{port}/",
                                   "file:///etc/passwd"])
def test_redirects_elsewhere_are_refused(where: str, unpriv_user: tuple[int, int]) -> None:
    def serve(conn: socket.socket, n: int) -> None:
        port = conn.getsockname()[1]
        if "127.0.0.2" in where and conn.getsockname()[0] == "127.0.0.2":
            conn.sendall(_response(OK_BODY))
            return
        conn.sendall(_response(b"", "302 Found",
                               f"Location: {where.format(port=port)}\r\n"))

    with hostile(serve) as url:
        rc, out, _ = _check(unpriv_user, url)
    assert rc == 1 and "redirect" in out, (rc, out)
    _one_clean_line(out)


def test_a_redirect_on_the_same_server_is_followed(unpriv_user: tuple[int, int]) -> None:
    def serve(conn: socket.socket, n: int) -> None:
        req = conn.recv(0)  # the request was read already
        del req
        if n % 2:
            conn.sendall(_response(b"", "307 Temporary Redirect",
                                   "Location: /prom/api/v1/query\r\n"))
        else:
            conn.sendall(_response(OK_BODY))

    with hostile(serve) as url:
        rc, out, _ = _check(unpriv_user, url)
    assert "redirect" not in out and "Traceback" not in out, out
    assert rc in (0, 1), (rc, out)
