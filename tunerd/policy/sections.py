"""The policy file format, declared once: validation, normalization and JSON Schema.

docs/policies.md documents the format for operators. After merging,
every section is present (``SECTION_DEFAULTS`` gives each one's empty value) and
``tunerd.policy.typed`` turns the result into typed values.
"""

from __future__ import annotations

from typing import Any

from tunerd.base import torchkeys
from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist
from tunerd.base.modes import MODES
from tunerd.policy.schema import (
    AnyOf,
    Bool,
    Enum,
    Int,
    Spec,
    Str,
    StrList,
    Table,
    TableArray,
)
from tunerd.policy.typed import DEFAULT_ALLOC_TTL, DEFAULT_MAX_PER_USER

__all__ = ["ARRAY_KEYS", "FILE_SCHEMA", "SECTION_DEFAULTS", "json_schema"]

# fnmatch globs: letters, digits and the usual name punctuation plus * ? [ ] !
_GLOB = r"[A-Za-z0-9_.:@+*?\[\]!,/ =-]+"
_NAME_GLOB = r"[A-Za-z0-9_.:@+*?\[\]!-]+"  # interface / block device names: no '/' or space
_POLICY_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
# /proc/sys top-level directories; a name outside them is a typo or an attack on the path
_SYSCTL_ROOTS = ("abi", "crypto", "debug", "dev", "fs", "kernel", "net", "sunrpc", "user", "vm")
_SYSCTL = (r"(?:" + "|".join(_SYSCTL_ROOTS) + r")(?:\.[A-Za-z0-9_][A-Za-z0-9_:@+-]*)+")

# largest RLIMIT_NOFILE the kernel allows (fs.nr_open's ceiling, fs/file.c sysctl_nr_open_max)
NOFILE_MAX = 1 << 30


def _cpulist(allow_empty: bool) -> Any:
    def convert(text: str) -> str:
        try:
            cpus = parse_cpulist(text)
        except CpuListError as err:
            raise ValueError(str(err)) from None
        if not cpus and not allow_empty:
            raise ValueError("an empty cpulist selects no CPU")
        return format_cpulist(cpus)

    return convert


def _glob(what: str, pattern: str = _GLOB) -> Str:
    return Str(pattern, what=what, max_len=256)


HOST_GLOBS = StrList(_glob("a hostname glob"),
                     description="fnmatch globs over the hostname (case-insensitive; "
                                 "the short name and the FQDN are both tried)")
# NVML model strings are free text ("NVIDIA GeForce RTX 4090", "NVIDIA A100 80GB PCIe")
GPU_GLOBS = StrList(Str(what="a GPU model glob", max_len=256),
                    description="fnmatch globs matched against every GPU model, "
                                "e.g. \"*H100*\" (case-insensitive)")

MATCH = Table({
    "hostname": HOST_GLOBS,
    "gpu_model": GPU_GLOBS,
    "min_gpus": Int(0, 1024, description="at least this many GPUs"),
    "max_gpus": Int(0, 1024, description="at most this many GPUs"),
}, description="every key given must match this node; no table = all nodes")

POLICY = Table({
    "name": Str(_POLICY_NAME, what="a policy name (letters, digits, '_', '.', '-')",
                max_len=128, description="defaults to the file name without .toml"),
    "extends": StrList(Str(_POLICY_NAME, what="a policy name", max_len=128),
                       description="policies merged before this one, by name"),
    "match": MATCH,
    "apply_once": StrList(_glob("a setting-key glob"),
                          description="setting keys (e.g. \"nic:*:mtu\") applied once and "
                                      "never re-applied by drift correction"),
})

SYSCTL = Table(
    values=AnyOf(Int(-(1 << 63), (1 << 64) - 1), Str(what="a string", allow_empty=True),
                 what="an integer or a string"),
    key=Str(_SYSCTL, what="a sysctl name under " + "|".join(_SYSCTL_ROOTS)
            + " with dot-separated parts (e.g. \"net.core.rmem_max\")", max_len=256),
    flatten=True,
    description="kernel settings by their sysctl name",
)

NIC = Table({
    "match": _glob("an interface-name glob", _NAME_GLOB),
    "mtu": Int(68, 65535, description="IPv4 minimum 68 up to the 16-bit maximum"),
    "txqueuelen": Int(0, (1 << 31) - 1, description="transmit queue length"),
}, required=("match",))

NCCL = Table(
    {"per_rank_nic": Bool(description="each rank gets its GPU's NIC: tunerctl run, tunerctl "
                                      "env --local-rank N and tunerd.torch.export_nccl_env "
                                      "set NCCL_IB_HCA (or NCCL_SOCKET_IFNAME) and "
                                      "UCX_NET_DEVICES for it; never written to nccl.conf")},
    values=AnyOf(Str(what="a string", allow_empty=True, max_len=1024),
                 Int(-(1 << 63), (1 << 63) - 1), Bool(),
                 what="a string, an integer or a boolean"),
    key=Str(r"NCCL_[A-Z0-9_]+", what="an NCCL variable name (NCCL_ and upper case)",
            max_len=128),
    description="lines of the managed block in /etc/nccl.conf",
)

BLOCK = Table({
    "match": _glob("a block-device-name glob", _NAME_GLOB),
    # blk-mq schedulers; the legacy ones (cfq, deadline, noop) left Linux in 5.0
    "scheduler": Enum(("none", "mq-deadline", "bfq", "kyber")),
    "read_ahead_kb": Int(0, 1 << 20),
    "nr_requests": Int(4, 1 << 16),  # BLKDEV_MIN_RQ is 4
}, required=("match",))

LIMITS = Table({
    "nofile": Int(1, NOFILE_MAX, description="default RLIMIT_NOFILE for bound jobs"),
})

CPU = Table({
    "housekeeping": Str(what="a cpulist (e.g. \"0-1\")", convert=_cpulist(True),
                        allow_empty=True, max_len=1024,
                        description="CPUs never given to jobs (cpulist)"),
    "governor": Enum(("performance", "powersave", "schedutil", "ondemand", "conservative",
                      "userspace")),
})

VM = Table({
    "transparent_hugepage": Enum(("always", "madvise", "never")),
    "transparent_hugepage_defrag": Enum(("always", "defer", "defer+madvise", "madvise",
                                         "never")),
    "numa_balancing": Bool(description="kernel.numa_balancing (off for pinned jobs)"),
})

GPU = Table({
    "persistence_mode": Bool(),
    "compute_mode": Enum(("default", "exclusive_process", "prohibited")),
    "power_limit_w": Int(1, 5000),
})

_ENV_NAME = Str(r"[A-Za-z_][A-Za-z0-9_]*", what="an environment variable name", max_len=256)

JOB_MATCH = Table({
    "cmdline": StrList(Str(what="a glob over the joined command line", max_len=1024)),
    "env": Table(values=Str(what="a glob over the variable's value", allow_empty=True,
                            max_len=1024), key=_ENV_NAME),
    "user": StrList(Str(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?", what="a user name", max_len=64)),
    "rank": Bool(description="the process is a rank of a training job (torchrun, srun, "
                             "mpirun, deepspeed, accelerate), by its environment and tree"),
}, description="every key given must match the process")

GPU_USE = Table({
    "enabled": Bool(description="place processes seen using a GPU (NVML's process lists, "
                                "an open /dev/nvidiaN) that carry no rank variable, "
                                "whatever launched them, as ranks of their launch tree's "
                                "job (default false; the bundled torch-training rule: true)"),
    "cmdline": StrList(Str(what="a glob over the joined command line", max_len=1024),
                       description="only GPU users whose command line matches one"),
    "env": Table(values=Str(what="a glob over the variable's value", allow_empty=True,
                            max_len=1024), key=_ENV_NAME,
                 description="only GPU users with every variable set and matching"),
    "user": StrList(Str(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?", what="a user name", max_len=64),
                    description="only GPU users of these users"),
}, description="processes placed at their first GPU use under this rule (tunerd.jobs.gpuuse)")

# training-side settings of the processes a rule bound (tunerd.torch applies them); their
# keys, ranges and AMP modes are tunerd.torch's, so the policy and the helpers agree
_TORCH_DOC = {
    "num_workers": "DataLoader num_workers",
    "pin_memory": "DataLoader pin_memory",
    "persistent_workers": "DataLoader persistent_workers (needs num_workers > 0)",
    "prefetch_factor": "DataLoader prefetch_factor (needs num_workers > 0)",
    "amp": "automatic mixed precision",
    "compile": "torch.compile the model",
}


def _torch_setting(key: str) -> Spec:
    if key == "amp":
        return Enum(torchkeys.AMP_MODES, description=_TORCH_DOC[key])
    if key in torchkeys.BOOLS:
        return Bool(description=_TORCH_DOC[key])
    lo, hi = torchkeys.INT_RANGES[key]
    return Int(lo, hi, description=_TORCH_DOC[key])


TORCH = Table({key: _torch_setting(key) for key in torchkeys.ENV},
              description="training-side settings tunerd.torch applies in the processes this "
                          "rule bound; every key optional")

PLACEMENTS = MODES  # tunerd.base.modes.Mode's values: the schema and the enum agree

JOB = Table({
    "name": Str(_POLICY_NAME, what="a rule name (letters, digits, '_', '.', '-')",
                max_len=128),
    "match": JOB_MATCH,
    "placement": Enum(PLACEMENTS, description="default gpu-local"),
    "cpus": Str(what="a cpulist (e.g. \"2-15\")", convert=_cpulist(False), max_len=1024,
                description="explicit CPUs, used instead of the placement"),
    "gpus": Int(0, 1024),
    "nofile": Int(1, NOFILE_MAX),
    "exclusive": Bool(),
    "exclusive_scope": Str(r"cgroup:/.*|pid:[0-9]+", what="\"cgroup:/PATH\" or \"pid:N\"",
                           max_len=1024),
    "workers": Int(0, 1024, description="DataLoader worker processes per rank; placement "
                                        "gives the rank room for them"),
    "self_pinned_memory": Enum(("bind", "leave"),
                               description="a rank that pinned its own CPUs (numactl, "
                                           "taskset): bind its memory to their NUMA "
                                           "node(s) (default bind) or leave it"),
    "gpu_memory": Bool(description="also bind the rank's memory to its GPUs' memory NUMA "
                                   "nodes (Grace with GPU memory onlined); default: the "
                                   "node of its CPUs only"),
    "torch": TORCH,
    "gpu_use": GPU_USE,
}, required=("name",))

IRQ = Table({
    "devices": StrList(Str(_NAME_GLOB, what="an interface/RDMA-device name glob or \"gpu\"",
                           max_len=256),
                       description="whose interrupts are placed: NIC names or globs "
                                   "(network interfaces, RDMA devices such as mlx5_*) and "
                                   "\"gpu\" for the GPUs' own interrupts"),
    "irqbalance": Enum(("ban", "leave"),
                       description="ban (default): irqbalance's --banirq list names every "
                                   "managed interrupt (a managed block in its environment "
                                   "file); leave: tunerd never touches irqbalance's files"),
    "cpus": Str(what="a cpulist (e.g. \"0-3\")", convert=_cpulist(False), max_len=1024,
                description="interrupts only ever go to these CPUs (still on their "
                            "device's NUMA node, never on a bound rank's CPU)"),
    "check_interval_ms": Int(100, 60000, description="how often a moved interrupt is "
                                                     "looked for and put back (default 1000)"),
}, description="interrupts kept on their device's NUMA node, housekeeping CPUs first, "
               "never on a CPU a bound rank holds")

PCIE = Table({
    "clear_acs": Bool(description="clear ACS source validation on the PCIe bridges between "
                                  "each GPU and its NIC (setpci ECAP_ACS+6.w; original saved, "
                                  "applied again at every start; never inside a VM)"),
}, description="opt-in changes to the PCIe path between each GPU and its NIC")

LEASES = Table({
    "user_exclusive": Bool(description="may non-root users take exclusive leases "
                                       "(default false)"),
    "max_per_user": Int(0, 1 << 20, description="leases one non-root user may hold "
                                               f"(default {DEFAULT_MAX_PER_USER})"),
    # a year is far beyond any job; larger values are typos for 0
    "alloc_ttl": Int(0, 366 * 86400, description="seconds an alloc lease that no process "
                                                 "holds may live; 0 = forever (default "
                                                 f"{DEFAULT_ALLOC_TTL})"),
}, description="what non-root users may do with leases")

FILE_SCHEMA = Table({
    "policy": POLICY,
    "sysctl": SYSCTL,
    "nic": TableArray(NIC, unique="match"),
    "nccl": NCCL,
    "block": TableArray(BLOCK, unique="match"),
    "limits": LIMITS,
    "cpu": CPU,
    "vm": VM,
    "gpu": GPU,
    "irq": IRQ,
    "pcie": PCIE,
    "job": TableArray(JOB, unique="name"),
    "leases": LEASES,
}, description="a tunerd policy file")

# arrays of tables and the key whose equal value makes a later entry override an earlier one
ARRAY_KEYS = {"nic": "match", "block": "match", "job": "name"}

# the normalized policy has every section, empty when no file sets it
SECTION_DEFAULTS: dict[str, Any] = {
    "sysctl": {}, "nic": [], "nccl": {}, "block": [], "limits": {}, "cpu": {}, "vm": {},
    "gpu": {}, "irq": {}, "pcie": {}, "job": [], "leases": {},
}


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of one policy file, generated from FILE_SCHEMA."""
    s = FILE_SCHEMA.json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://tunerd.invalid/policy.schema.json",
        "title": "tunerd policy file",
        **s,
    }
