"""`tunerctl top`: q quits, ? help, sort keys, a CPU sparkline per job (issue 19, item 5),
on a real terminal (a pty) against the real daemon, and the frame at 80 columns."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from io import StringIO

from tests.helpers import REPO, DaemonProc, wait_for
from tunerd.cli.top_view import TopState, render, sparkline


def _reply(*jobs: dict[str, object]) -> dict[str, object]:
    return {"sample": {"time": 0, "host": {}, "gpu": {"available": False}, "jobs": list(jobs)}}


def test_sort_keys_sparkline_and_help_fit_80_columns() -> None:
    from rich.console import Console

    a = {"pid": 10, "name": "z[b]x[/b]", "cpus": "0-3", "cpu_cores": 0.5, "rss_bytes": 9e9}
    b = {"pid": 20, "name": "alpha", "cpus": "4-7", "cpu_cores": 2.0, "rss_bytes": 1e6}
    st = TopState()
    for cores in (0.0, 1.0, 2.0):
        st.record(_reply(a, dict(b, cpu_cores=cores)))
    assert sparkline(list(st.history[20])) == "\u2581\u2585\u2588"
    assert sparkline([0.0, 0.0]) == "\u2581\u2581"

    def frame() -> str:
        buf = StringIO()
        Console(file=buf, width=80, color_system=None).print(render(_reply(a, b), st))
        text = buf.getvalue()
        assert max(len(ln) for ln in text.splitlines()) <= 80, text
        return text

    assert frame().index(" 20 ") < frame().index(" 10 ")  # c: by CPU, largest first
    assert "z[b]x[/b]" in frame()  # a job's name is text, never markup
    assert st.key("m") and frame().index(" 10 ") < frame().index(" 20 ")
    assert st.key("n") and frame().index("alpha") < frame().index("z[b]x[/b]")
    assert "(by name)" in frame() and "q quit" in frame()
    assert st.key("?") and "Keys: q quit" in frame()
    assert not st.key("q")


def test_q_quits_the_live_view_on_a_terminal(daemon: DaemonProc) -> None:
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "tunerd.cli.main", "--socket",
                          str(daemon.socket), "top", "--interval", "0.2"],
                         stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                         env={**os.environ, "TERM": "xterm", "COLUMNS": "80", "LINES": "40"})
    os.close(slave)
    seen = b""

    def screen_has(text: bytes) -> bool:
        nonlocal seen
        while select.select([master], [], [], 0.05)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
        return text in seen

    try:
        wait_for(lambda: screen_has(b"q quit"), 20, "the key line", detail=lambda: repr(seen))
        os.write(master, b"?")
        wait_for(lambda: screen_has(b"Keys: q quit"), 10, "the help", detail=lambda: repr(seen))
        t0 = time.monotonic()
        os.write(master, b"q")
        assert p.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
