"""Launchers and wrappers: the processes of a job tree that are never ranks.

A launcher (slurmstepd, a torchrun agent, mpirun/orted, deepspeed, accelerate)
starts ranks; a wrapper (numactl, taskset, env, nsys, a shell ...) only starts the
next process, often by exec. Neither is ever bound as a rank: binding numactl
before it has read its own arguments makes it fail ("cpu argument out of range").
"""

from __future__ import annotations

import os

__all__ = ["AFFINITY_WRAPPERS", "RANK_VARS", "WRAPPERS", "is_launcher", "launcher_comm",
           "wrapper_name"]

# variables a launcher sets in each rank it starts
RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

# processes that only start the next one: never placed as a rank
AFFINITY_WRAPPERS = frozenset({"numactl", "taskset", "cset", "hwloc-bind"})
WRAPPERS = AFFINITY_WRAPPERS | frozenset({
    "env", "nsys", "ncu", "nohup", "time", "chrt", "nice", "ionice", "stdbuf", "timeout",
    "setsid", "sh", "bash", "dash", "zsh", "ksh", "strace", "ltrace", "perf", "valgrind",
    "sudo", "su", "runuser", "setpriv", "tini", "dumb-init", "xargs", "exec"})
# launchers: they start ranks and are never ranks themselves
_LAUNCHER_NAMES = frozenset({
    "torchrun", "mpirun", "mpiexec", "orterun", "orted", "prted", "prterun", "prte",
    "hydra_pmi_proxy", "mpiexec.hydra", "srun", "slurmstepd", "deepspeed", "accelerate",
    "pt_elastic", "horovodrun", "charliecloud"})
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch",
                     "torch.distributed.elastic", "deepspeed.launcher", "accelerate.commands",
                     "horovod.runner")
def _base(arg: str) -> str:
    return os.path.basename(arg)


def is_launcher(argv: list[str], comm: str = "") -> bool:
    """Whether a command line is a launcher's (torchrun agent, mpirun, srun, ...)."""
    if comm in ("slurmstepd", "torchrun", "orted", "prted", "hydra_pmi_proxy"):
        return True
    if not argv:
        return False
    if _base(argv[0]) in _LAUNCHER_NAMES:
        return True
    if _base(argv[0]).startswith("python"):
        for i, a in enumerate(argv[1:6], 1):
            if a == "-m" and i + 1 < len(argv):
                return argv[i + 1].startswith(_LAUNCHER_MODULES)
            if not a.startswith("-"):
                return _base(a) in _LAUNCHER_NAMES
    return False


def launcher_comm(comm: str) -> str | None:
    """The launcher a process is by its name alone (``/proc/PID/comm``: a launcher
    script's own name, e.g. ``torchrun``), or None."""
    return comm if comm in _LAUNCHER_NAMES else None


def wrapper_name(argv: list[str], comm: str = "") -> str | None:
    """The wrapper a command line is (``numactl``, ``sh`` ...), or None."""
    name = _base(argv[0]) if argv else comm
    return name if name in WRAPPERS else None


