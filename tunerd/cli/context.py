"""Shared state and output helpers for tunerctl commands."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar

import click

from tunerd.base.errors import DaemonUnreachable, TunerdError
from tunerd.wire.client import Client
from tunerd.wire.protocol import error_to_wire


class CliContext:
    # the one this tunerctl run made: main() reads --json from it to report an error
    active: ClassVar[CliContext | None] = None

    # a plain class, not a dataclass: tunerctl start-up time matters (job prologs)
    def __init__(self, socket_path: str | None = None, as_json: bool = False,
                 timeout: float = 60.0) -> None:
        self.socket_path = socket_path
        self.as_json = as_json
        self.timeout = timeout
        self._client: Client | None = None
        CliContext.active = self

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.socket_path, timeout=self.timeout)
        return self._client

    def call(self, cmd: str, **args: Any) -> Any:
        client = self.client()
        try:
            return client.call(cmd, **args)
        except DaemonUnreachable as err:
            if not isinstance(err.__cause__, TimeoutError):
                raise
            # the client's own message says only "timed out": name the socket, the
            # bound and where the bound comes from, so a prolog's log line is actionable.
            # (A Unix-socket connect never waits: a full backlog is EAGAIN at once.)
            raise DaemonUnreachable(
                f"tunerd at {client.path} did not answer {cmd!r} within {self.timeout:g} s"
                " (tunerctl --timeout, env TUNERCTL_TIMEOUT); whether it took effect is"
                " unknown") from err

    def emit(self, result: Any, human: Callable[[Any], str | None] | None = None) -> None:
        """Print ``result`` as JSON (--json) or through the ``human`` formatter."""
        if self.as_json or human is None:
            import json

            click.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
            return
        from tunerd.base.text import safe_tree

        # every string a user may have chosen (tags, names, command lines) is shown with
        # its control characters escaped: nothing reaches the terminal raw
        text = human(safe_tree(result))
        if text:
            click.echo(text)


def get_ctx() -> CliContext:
    obj = click.get_current_context().find_root().obj
    assert isinstance(obj, CliContext)
    return obj


def report_error(err: TunerdError, as_json: bool) -> None:
    if as_json:
        import json

        click.echo(json.dumps({"ok": False, "error": error_to_wire(err)}, indent=2, default=str))
    if err.details.get("prometheus_unreachable"):
        # another service (fleet check's Prometheus), not tunerd: no hint to start tunerd
        click.echo(f"tunerctl: error: {err.message}\n  is Prometheus running there? "
                   f"check the URL and `curl {err.details['prometheus_unreachable']}/-/ready`",
                   err=True)
    elif isinstance(err, DaemonUnreachable):
        from tunerd.cli.service_hint import unreachable_message

        click.echo(f"tunerctl: error: {unreachable_message(err.message)}", err=True)
    else:
        from tunerd.base.text import bounded_message, safe

        click.echo(f"tunerctl: error: {safe(bounded_message(err.message))}", err=True)
    sys.stderr.flush()
