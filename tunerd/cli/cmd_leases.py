"""tunerctl alloc / release / run / leases.

``run`` is on the job-launch path: stdlib + click only, and ``ctypes`` for
set_mempolicy just before the exec.
"""

from __future__ import annotations

import errno
import os
import shlex
import sys
from typing import Any

import click

from tunerd.base.syscalls import syscall_nr
from tunerd.cli.context import get_ctx
from tunerd.cli.types import CPULIST, Command, CountType, cpu_args

# set_mempolicy(2): glibc has no wrapper (libnuma does); numbers in tunerd.base.syscalls
MPOL_BIND = 2

_COMMON = [
    click.option("--gpus", type=CountType(minimum=0), default=0, show_default=True,
                 help="Number of GPUs."),
    click.option("--ncpus", type=CountType(), default=None,
                 help="Number of CPUs (default: this node's per-GPU share)."),
    click.option("--cpus", type=CPULIST, default=None,
                 help="Exactly these CPUs (cpulist, e.g. 2-5,8), as for bind."),
    click.option("--workers", type=CountType(minimum=0, maximum=1024),
                 default=None,
                 help="DataLoader worker processes per rank: placement leaves room for them."),
    click.option("--exclusive", is_flag=True,
                 help="No other lease or rule may use these CPUs."),
    click.option("--exclusive-scope", metavar="pid:N|cgroup:/PATH", default=None,
                 help="With --exclusive: also move these processes off the CPUs "
                      "(restored when the lease ends)."),
    click.option("--uuids", is_flag=True,
                 help="CUDA_VISIBLE_DEVICES with GPU UUIDs instead of indices."),
    click.option("--tag", default=None, metavar="TEXT",
                 help="Label for `release --tag` (default inside Slurm: slurm:$SLURM_JOB_ID)."),
]


def _common(fn: Any) -> Any:
    for opt in reversed(_COMMON):
        fn = opt(fn)
    return fn


def _env(result: dict[str, Any], uuids: bool) -> dict[str, str]:
    env = dict(result["env"])
    if uuids and env.get("TUNERD_GPU_UUIDS"):
        env["CUDA_VISIBLE_DEVICES"] = env["TUNERD_GPU_UUIDS"]
    return env


# launchers `run` may start, and the option that says how many ranks each starts here
_RANK_COUNT = {"torchrun": ("--nproc-per-node", "--nproc_per_node"),
               "torch.distributed.run": ("--nproc-per-node", "--nproc_per_node"),
               "torch.distributed.launch": ("--nproc-per-node", "--nproc_per_node"),
               "deepspeed": ("--num_gpus", "--num-gpus"),
               "accelerate": ("--num_processes", "--num-processes"),
               "mpirun": ("-np", "-n", "--np"), "mpiexec": ("-np", "-n", "--np")}


def _launcher_ranks(argv: list[str]) -> tuple[str, int | None] | None:
    """(launcher, ranks it starts on this node; None: not said as a number) when
    ``argv`` is a launcher `run` knows (torchrun or ``python -m torch.distributed.run``,
    deepspeed, accelerate, mpirun); None for anything else."""
    name, rest = os.path.basename(argv[0]), argv[1:]
    if name.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        name, rest = argv[2], argv[3:]
    flags = _RANK_COUNT.get(name)
    if flags is None:
        return None
    for i, arg in enumerate(rest):
        key, eq, val = arg.partition("=")
        if key in flags:
            text = val if eq else (rest[i + 1] if i + 1 < len(rest) else "")
            return name, int(text) if text.isdigit() and 0 < len(text) < 7 else None
        if arg == "--" or arg.endswith(".py"):  # the training script: its options follow
            break
    return name, None


def _rank_threads(env: dict[str, str], argv: list[str], ncpus: int) -> None:
    """OMP_NUM_THREADS for the ranks a launcher will start, not for the whole lease.

    The lease's share is per GPU; ``run -- torchrun --nproc-per-node N`` starts N ranks,
    each bound to its part of the lease's CPUs (the bundled rule splits them), and
    torchrun keeps an OMP_NUM_THREADS it finds: the lease's count would oversubscribe
    every rank (issue 35 item 2). N said: the lease's CPUs // N (at least 1); not said
    (``gpu``, ``auto``): left unset, to the launcher (torchrun then sets 1 per rank)."""
    got = _launcher_ranks(argv) if argv else None
    if got is None or "OMP_NUM_THREADS" not in env:
        return
    ranks = got[1]
    if ranks is None:
        del env["OMP_NUM_THREADS"]
    else:
        env["OMP_NUM_THREADS"] = str(max(1, ncpus // ranks))


def _summary(r: dict[str, Any]) -> str:
    gpus = ",".join(str(g) for g in r["gpus"]) or "none"
    s = f"lease {r['id']}: GPUs {gpus}, CPUs {r['cpus']}, memory nodes {r['mems']}"
    if r.get("exclusive"):
        s += " (exclusive)"
    return s


def _notes(r: dict[str, Any]) -> None:
    for n in r.get("notes") or []:
        click.echo(f"tunerctl: note: {n}", err=True)


def _request(gpus: int, ncpus: int | None, cpus: str | None, workers: int | None,
             exclusive: bool, exclusive_scope: str | None, tag: str | None) -> dict[str, Any]:
    count, cpulist = cpu_args(ncpus, cpus)
    args: dict[str, Any] = {"gpus": gpus, "ncpus": count, "cpus": cpulist, "exclusive": exclusive,
                            "exclusive_scope": exclusive_scope, "tag": _default_tag(tag)}
    if workers is not None:
        args["workers"] = workers
    return args


@click.command(cls=Command)
@_common
def alloc(gpus: int, ncpus: int | None, cpus: str | None, workers: int | None,
          exclusive: bool, exclusive_scope: str | None, uuids: bool, tag: str | None) -> int:
    """Reserve GPUs and CPUs without launching; prints shell `export` lines.

    Use as: eval "$(tunerctl alloc --gpus 2)"; end it with `tunerctl release $TUNERD_LEASE`.
    """
    ctx = get_ctx()
    r = ctx.call("alloc", **_request(gpus, ncpus, cpus, workers, exclusive, exclusive_scope,
                                     tag))
    r["env"] = _env(r, uuids)
    if ctx.as_json:
        ctx.emit(r)
        return 0
    for k, v in r["env"].items():
        click.echo(f"export {k}={shlex.quote(v)}")
    click.echo(f"# {_summary(r)}")
    _notes(r)
    return 0


def _default_tag(tag: str | None) -> str | None:
    job = os.environ.get("SLURM_JOB_ID")
    return tag if tag is not None else (f"slurm:{job}" if job else None)


@click.command(cls=Command)
@click.argument("lease", required=False)
@click.option("--tag", default=None, metavar="TEXT",
              help="Release every lease with this tag (yours; all of them for root).")
def release(lease: str | None, tag: str | None) -> int:
    """End lease LEASE (such as L3), or all leases tagged TEXT; give GPUs and CPUs back."""
    ctx = get_ctx()
    if (lease is None) == (tag is None):
        raise click.UsageError("give either LEASE or --tag TEXT")
    if tag is not None:
        r = ctx.call("release", tag=tag)
        ctx.emit(r, lambda r: "\n".join(f"released {_summary(x)}" for x in r["released"])
                 or f"no lease tagged {tag}")
        return 0
    r = ctx.call("release", lease=lease)
    ctx.emit(r, lambda r: f"released {_summary(r)}")
    return 0


@click.command(cls=Command)
def leases() -> int:
    """Current leases."""
    ctx = get_ctx()
    rs = ctx.call("leases")

    def human(rs: list[dict[str, Any]]) -> str:
        if not rs:
            return "no leases"
        return "\n".join(f"{_summary(r)}; {r['user']}"
                         + (f", pid {r['pid']}" if r.get("pid") else "")
                         + (f", tag {r['tag']}" if r.get("tag") else "")
                         + (f"; expires {_expires(r['expires'])}" if r.get("expires") else "")
                         for r in rs)

    ctx.emit(rs, human)
    return 0


def _expires(t: float) -> str:
    """When an alloc lease ends by itself ([leases] alloc_ttl)."""
    import time

    left = t - time.time()
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    if left <= 0:
        return f"{when} (now)"
    if left < 3600:
        return f"{when} (in {int(left // 60)} min {int(left % 60)} s)"
    return f"{when} (in {left / 3600:.1f} h)"


def set_mempolicy_bind(nodes: set[int]) -> None:
    """MPOL_BIND this process to ``nodes`` (kept across exec and inherited by children)."""
    import ctypes

    nr = syscall_nr("set_mempolicy")
    if nr is None or not nodes:
        return
    bits = max(nodes) + 1
    words = (bits + 63) // 64
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    # the kernel reads maxnode-1 bits (mm/mempolicy.c get_nodes), hence +1
    if libc.syscall(nr, MPOL_BIND, mask, ctypes.c_ulong(words * 64 + 1)) != 0:
        err = ctypes.get_errno()
        click.echo(f"tunerctl: note: set_mempolicy(MPOL_BIND, {sorted(nodes)}): "
                   f"{os.strerror(err)}", err=True)


def _parse_list(text: str) -> set[int]:
    from tunerd.base.cpulist import parse_cpulist

    return set(parse_cpulist(text))


@click.command(cls=Command, context_settings={"ignore_unknown_options": True,
                                              "allow_interspersed_args": False})
@_common
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(gpus: int, ncpus: int | None, cpus: str | None, workers: int | None,
        exclusive: bool, exclusive_scope: str | None, uuids: bool, tag: str | None,
        command: tuple[str, ...]) -> int:
    """Allocate, then exec COMMAND bound, with CUDA_VISIBLE_DEVICES set.

    The lease ends when COMMAND exits. COMMAND not found: exit 127.
    """
    ctx = get_ctx()
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise click.UsageError("run: missing COMMAND")
    from tunerd.wire.protocol import command_record

    # the daemon keeps a bounded record of the command; the exec below runs all of it
    r = ctx.call("run", command=command_record(argv),
                 **_request(gpus, ncpus, cpus, workers, exclusive, exclusive_scope, tag))
    nic_env: dict[str, str] = {}
    if r.get("gpus"):  # [nccl] per_rank_nic: the NICs of the lease's GPUs
        nic_env = ctx.call("env", gpus=list(r["gpus"])).get("nic_env") or {}
    ctx.client().close()
    env = _env(r, uuids)
    _rank_threads(env, argv, len(_parse_list(r["cpus"])) if r.get("cpus") else 0)
    # a value the job set itself is never overridden
    env.update({k: v for k, v in nic_env.items() if k not in os.environ and k not in env})
    os.environ.update(env)
    if r.get("applied"):
        # the daemon bound this process already -- or could not (no CAP_SYS_NICE: a
        # note says so), and a process may always set its own CPUs; both are
        # inherited across exec by COMMAND and its children
        try:
            os.sched_setaffinity(0, _parse_list(r["cpus"]))
        except OSError as err:
            why = (" (a cpuset outside these CPUs, or a seccomp policy: a process may "
                   "always set its own CPUs otherwise)" if err.errno in (errno.EPERM,
                                                                          errno.EINVAL) else "")
            click.echo(f"tunerctl: note: sched_setaffinity({r['cpus']}) on itself: "
                       f"{err.strerror}{why}", err=True)
        set_mempolicy_bind(_parse_list(r["mems"]))
    if ctx.as_json:
        import json

        click.echo(json.dumps({**r, "env": env}, sort_keys=True), err=True)
    _notes(r)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        click.echo(f"tunerctl: {argv[0]}: command not found", err=True)
        return 127
    except PermissionError as err:
        click.echo(f"tunerctl: {argv[0]}: {err.strerror}", err=True)
        return 126
    except OSError as err:
        click.echo(f"tunerctl: {argv[0]}: {err.strerror}", err=True)
        return 126
    return 0  # not reached
