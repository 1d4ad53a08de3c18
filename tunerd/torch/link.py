"""This process as the daemon sees it, and the ``report`` command that tells it.

``current_report()`` builds the ``report`` arguments (pid, step figures, device,
memory, DataLoader workers, ranks); ``DaemonLink`` sends them and never raises or
waits long; ``daemon_settings()`` asks once for the ``torch`` table of the
``[[job]]`` rule that bound this process.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

from tunerd.adapters.procfs import Process, read_cmdline, read_comm
from tunerd.base.errors import DaemonUnreachable, PermissionDenied, TunerdError, UsageError
from tunerd.torch.settings import log, valid_settings, warn_once

__all__ = ["DaemonLink", "current_report", "daemon_settings", "dataloader_workers"]

WORKER_COMM = "pt_data_worker"  # torch names its DataLoader worker processes so
UNREACHABLE_BACKOFF_S = 10.0
FAILED_BACKOFF_S = 30.0

_daemon_cache: dict[str, Any] | None = None


# -- what this process looks like ------------------------------------------------

def _torch_if_loaded() -> Any:
    """torch if the training script imported it; never imports it ourselves."""
    return sys.modules.get("torch")


def uses_cuda() -> bool:
    torch = _torch_if_loaded()
    try:
        # is_initialized: this process made a CUDA context; is_available alone would
        # also be true for a CPU job on a GPU node
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(cuda: bool) -> dict[str, int]:
    if cuda:
        torch = _torch_if_loaded()
        return {"allocated": int(torch.cuda.memory_allocated()),
                "reserved": int(torch.cuda.memory_reserved()),
                "max_allocated": int(torch.cuda.max_memory_allocated())}
    return {"rss": _rss_bytes()}


def dataloader_workers(pid: int | None = None) -> list[int]:
    """PIDs of the DataLoader worker processes of ``pid`` (default: this process).

    Its children named ``pt_data_worker`` (torch names workers so) or, for torch
    versions that do not, forked children running the same command line.
    """
    proc = Process(pid or os.getpid())
    try:
        own_cmdline = proc.cmdline_text()
        children = proc.children()
    except TunerdError:
        return []
    # a child that exits meanwhile reads as None and is left out
    return [c for c in sorted(set(children))
            if read_comm(c) == WORKER_COMM or read_cmdline(c) == own_cmdline]


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "")
    return int(v) if v.strip().isdigit() else None


def job_id(env: dict[str, str] | None = None) -> str | None:
    """The id ranks of one training job share on every node: TUNERD_JOB, else the
    Slurm job, else torchrun's run id, else the rendezvous address (None: unknown)."""
    e = os.environ if env is None else env
    run_id = e.get("TORCHELASTIC_RUN_ID", "")
    for v in (e.get("TUNERD_JOB"), e.get("SLURM_JOB_ID") and f"slurm-{e['SLURM_JOB_ID']}",
              run_id if run_id and run_id != "none" else None,
              e.get("MASTER_ADDR") and e.get("MASTER_PORT")
              and f"{e['MASTER_ADDR']}:{e['MASTER_PORT']}"):
        if v:
            # the daemon takes 1-64 of A-Z a-z 0-9 _ . : @ / + = - (a Prometheus label)
            return re.sub(r"[^A-Za-z0-9_.:@/+=-]", "_", "j" + v if not v[0].isalnum()
                          else v)[:64]
    return None


def current_report(steps: int = 0, step_time_s: float | None = None,
                   samples_per_s: float | None = None, workers: list[int] | None = None,
                   num_workers: int | None = None) -> dict[str, Any]:
    """The ``report`` command's arguments for this process (see the wire spec).

    Without step numbers (``report_memory``) step time and throughput are null: not
    measured is not zero.
    """
    cuda = uses_cuda()
    if workers is None:
        workers = dataloader_workers()
    return {"pid": os.getpid(), "steps": int(steps),
            "step_time_s": None if step_time_s is None else float(step_time_s),
            "samples_per_s": None if samples_per_s is None else float(samples_per_s),
            "device": "cuda" if cuda else "cpu",
            "memory": memory(cuda), "workers": workers,
            "num_workers": len(workers) if num_workers is None else int(num_workers),
            "rank": _env_int("RANK"), "local_rank": _env_int("LOCAL_RANK"),
            "local_world_size": _env_int("LOCAL_WORLD_SIZE"), "job": job_id()}


# -- the daemon ---------------------------------------------------------------------

class DaemonLink:
    """Sends ``report`` to the daemon; never raises, never waits longer than ``timeout``.

    ``status`` says what happened last, for ``summary()``: "not tried", "accepted",
    "unreachable: ...", "daemon has no 'report' command", "refused: ...".
    """

    def __init__(self, socket_path: str | None = None, timeout: float = 0.5) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.status = "not tried"
        self.supported: bool | None = None
        self.settings: dict[str, Any] = {}
        self.sent = 0
        self._client: Any = None
        self._quiet_until = 0.0

    def send(self, args: dict[str, Any]) -> dict[str, Any] | None:
        if self.supported is False or time.monotonic() < self._quiet_until:
            return None
        from tunerd.wire.client import Client

        try:
            if self._client is None:
                self._client = Client(self.socket_path, timeout=self.timeout)
            reply = self._client.call("report", **args)
        except UsageError as err:
            self.close()
            if "unknown command 'report'" in err.message:
                self.supported = False
                self.status = "daemon has no 'report' command"
                log.info("tunerd.torch: the daemon does not know the 'report' command "
                         "(tunerd older than 0.2): no reports")
                return None
            self._failed(f"refused: {err.message}")
            return None
        except DaemonUnreachable as err:
            self.close()
            self.status = f"unreachable: {err.message}"
            self._quiet_until = time.monotonic() + UNREACHABLE_BACKOFF_S
            return None
        except PermissionDenied as err:
            self.close()
            self.supported = False
            self.status = f"refused: {err.message}"
            return None
        except (TunerdError, OSError, ValueError) as err:
            self.close()
            self._failed(f"refused: {getattr(err, 'message', err)}")
            return None
        if not isinstance(reply, dict) or reply.get("accepted") is not True:
            self._failed(f"refused: unexpected reply {reply!r:.200}")
            return None
        self.supported = True
        self.status = "accepted"
        self.sent += 1
        self.settings = valid_settings(reply.get("settings"))
        return reply

    def _failed(self, status: str) -> None:
        self.status = status
        self._quiet_until = time.monotonic() + FAILED_BACKOFF_S
        warn_once(f"report:{status}", "tunerd.torch: report to tunerd failed: %s", status)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None


def daemon_settings(refresh: bool = False, timeout: float = 0.5) -> dict[str, Any]:
    """The ``torch`` table of the ``[[job]]`` rule that bound this process ({} if none).

    Asked once per process with the ``report`` command (steps=0) and cached. No
    daemon, an old daemon that does not know ``report``, or any other failure gives {}
    (the helpers work without a daemon); only a reply that makes no sense is warned
    about.
    """
    global _daemon_cache
    if _daemon_cache is not None and not refresh:
        return dict(_daemon_cache)
    link = DaemonLink(timeout=timeout)
    try:
        link.send(current_report(steps=0))  # validates the reply's table into .settings
    finally:
        link.close()
    settings = dict(link.settings)  # {} when the report failed
    _daemon_cache = settings
    return dict(settings)
