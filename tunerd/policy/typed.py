"""The merged policy as typed, read-only values: what the tuners and services read.

The loader builds a ``PolicyModel`` from the merged, validated and normalized
policy (``Policy.data``), so every value here already passed the schema of
``tunerd.policy.sections``: types are exact, enums are one of their choices,
cpulists are parsed. Nothing in this module validates again, and it imports
nothing but the standard library and ``tunerd.base.cpulist`` (services import it on
start-up; the CLI's ``bind`` path never does).

An unset optional key is ``None`` (or the documented default), never absent, so
consumers read attributes instead of ``.get()`` chains. ``PolicyModel()`` is the
empty policy: no host setting, no rule, default lease limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeAlias

from tunerd.base.cpulist import parse_cpulist
from tunerd.base.modes import Mode, parse_mode

__all__ = [
    "DEFAULT_ALLOC_TTL",
    "DEFAULT_MAX_PER_USER",
    "BlockRule",
    "CpuSection",
    "GpuSection",
    "GpuUseSpec",
    "IrqSection",
    "JobSpec",
    "LeasePolicy",
    "Limits",
    "NcclValue",
    "NicRule",
    "PcieSection",
    "PolicyInfo",
    "PolicyModel",
    "SysctlValue",
    "TorchSettings",
    "VmSection",
    "build_model",
]

SysctlValue: TypeAlias = int | str
NcclValue: TypeAlias = str | int | bool

# [leases] defaults: a user may hold this many leases; an ``alloc`` lease that no
# process holds is released after this many seconds (a day: longer than any
# interactive session that forgot to release, shorter than a leaked lease matters)
DEFAULT_MAX_PER_USER = 64
DEFAULT_ALLOC_TTL = 86400


def _frozen_map(d: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(d or {}))


def _no_map() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """Which policies are in force: names and files in merge order (extends first)."""

    name: str = ""  # the last policy merged; "" when none applies
    names: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NicRule:
    """One ``[[nic]]`` entry: settings for the interfaces whose name matches the glob."""

    match: str
    mtu: int | None = None
    txqueuelen: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRule:
    """One ``[[block]]`` entry: queue settings for the block devices matching the glob."""

    match: str
    scheduler: str | None = None  # none | mq-deadline | bfq | kyber
    read_ahead_kb: int | None = None
    nr_requests: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    nofile: int | None = None  # default RLIMIT_NOFILE for rule and lease binds


@dataclass(frozen=True, slots=True)
class CpuSection:
    housekeeping: frozenset[int] = frozenset()  # CPUs never given to jobs
    governor: str | None = None


@dataclass(frozen=True, slots=True)
class VmSection:
    transparent_hugepage: str | None = None  # always | madvise | never
    transparent_hugepage_defrag: str | None = None
    numa_balancing: bool | None = None


@dataclass(frozen=True, slots=True)
class GpuSection:
    persistence_mode: bool | None = None
    compute_mode: str | None = None  # default | exclusive_process | prohibited
    power_limit_w: int | None = None


@dataclass(frozen=True, slots=True)
class IrqSection:
    """``[irq]``: whose interrupts tunerd places, and how it deals with irqbalance."""

    devices: tuple[str, ...] = ()  # NIC names/globs (netdevs, RDMA devices) and "gpu"
    irqbalance: str = "ban"  # ban (its --banirq list names them) | leave (its files untouched)
    cpus: frozenset[int] | None = None  # interrupts only ever go to these CPUs
    check_interval_ms: int = 1000  # how often a moved interrupt is looked for


@dataclass(frozen=True, slots=True)
class PcieSection:
    """``[pcie]``: opt-in changes to the PCIe path between each GPU and its NIC."""

    clear_acs: bool = False  # clear ACS source validation on the bridges between them


@dataclass(frozen=True, slots=True)
class TorchSettings:
    """A rule's ``torch`` table: what tunerd.torch applies in the processes it bound.

    Every key is optional; ``None`` means "leave the training script's own choice".
    """

    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    amp: str | None = None  # off | bf16 | fp16
    compile: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The keys that are set: the ``settings`` of a ``report`` reply."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One ``[[job]]`` rule after merging: which processes it binds, and how.

    ``cmdline``, ``env`` and ``users`` are the rule's ``match`` table; a process
    matches when every one given matches.
    """

    name: str
    cmdline: tuple[str, ...] = ()  # globs over the joined command line (any may match)
    env: Mapping[str, str] = field(default_factory=_no_map)  # var -> glob, all must match
    users: tuple[str, ...] = ()  # user names (or uids as strings)
    rank: bool = False  # only ranks of a training job (by environment and process tree)
    placement: Mode = Mode.GPU_LOCAL  # parsed from the schema-checked text (MODES)
    cpus: frozenset[int] | None = None  # explicit CPUs instead of the placement
    gpus: int | None = None
    nofile: int | None = None
    exclusive: bool = False
    exclusive_scope: str | None = None  # "cgroup:/PATH" | "pid:N"
    workers: int | None = None  # DataLoader worker processes per rank (placement room)
    self_pinned_memory: str = "bind"  # bind | leave: a self-pinned rank's memory
    gpu_memory: bool = False  # memory also on the GPUs' own (CPU-less) NUMA nodes
    torch: TorchSettings = TorchSettings()
    gpu_use: GpuUseSpec | None = None  # [job.gpu_use] with enabled = true: GPU users too

    def __post_init__(self) -> None:
        if type(self.placement) is not Mode:  # text from a caller: parsed here, once
            object.__setattr__(self, "placement", parse_mode(self.placement))


@dataclass(frozen=True, slots=True)
class GpuUseSpec:
    """``[job.gpu_use]``: processes seen using a GPU are placed under the rule when its
    ``match`` keys (``match.rank`` aside) and these narrowing keys all match."""

    cmdline: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=_no_map)
    users: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """``[leases]``: what non-root users may do with leases."""

    user_exclusive: bool = False  # may non-root users take exclusive leases
    max_per_user: int = DEFAULT_MAX_PER_USER  # leases one non-root user may hold
    alloc_ttl: int = DEFAULT_ALLOC_TTL  # seconds an unheld alloc lease lives; 0 = forever


@dataclass(frozen=True, slots=True)
class PolicyModel:
    """The merged policy for one node, typed. ``PolicyModel()`` is the empty policy."""

    info: PolicyInfo = PolicyInfo()
    sysctl: Mapping[str, SysctlValue] = field(default_factory=_no_map)
    nic: tuple[NicRule, ...] = ()
    nccl: Mapping[str, NcclValue] = field(default_factory=_no_map)
    block: tuple[BlockRule, ...] = ()
    limits: Limits = Limits()
    cpu: CpuSection = CpuSection()
    vm: VmSection = VmSection()
    gpu: GpuSection = GpuSection()
    irq: IrqSection = IrqSection()
    pcie: PcieSection = PcieSection()
    nccl_per_rank_nic: bool = False  # [nccl] per_rank_nic: each rank gets its GPU's NIC
    jobs: tuple[JobSpec, ...] = ()
    apply_once: tuple[str, ...] = ()  # setting-key globs applied once, never drift-corrected
    leases: LeasePolicy = LeasePolicy()

    def section(self, name: str) -> object:
        """A host-settings section by its policy name (``sysctl``, ``nic``, ... ``gpu``)."""
        if name not in _HOST_SECTIONS:
            raise KeyError(f"not a host-settings section: {name!r}")
        return getattr(self, name)


_HOST_SECTIONS = frozenset({"sysctl", "nic", "nccl", "block", "vm", "cpu", "gpu", "irq", "pcie"})


def _opt_cpus(text: str | None) -> frozenset[int] | None:
    return None if text is None else parse_cpulist(text)


def _job(raw: Mapping[str, Any]) -> JobSpec:
    match = raw.get("match") or {}
    return JobSpec(
        name=raw["name"],
        cmdline=tuple(match.get("cmdline", ())),
        env=_frozen_map(match.get("env")),
        users=tuple(match.get("user", ())),
        rank=bool(match.get("rank", False)),
        placement=parse_mode(raw.get("placement", Mode.GPU_LOCAL)),
        cpus=_opt_cpus(raw.get("cpus")),
        gpus=raw.get("gpus"),
        nofile=raw.get("nofile"),
        exclusive=raw.get("exclusive", False),
        exclusive_scope=raw.get("exclusive_scope"),
        workers=raw.get("workers"),
        self_pinned_memory=raw.get("self_pinned_memory", "bind"),
        gpu_memory=bool(raw.get("gpu_memory", False)),
        torch=TorchSettings(**raw.get("torch", {})),
        gpu_use=_gpu_use(raw.get("gpu_use") or {}),
    )


def _gpu_use(raw: Mapping[str, Any]) -> GpuUseSpec | None:
    if not raw.get("enabled", False):
        return None
    return GpuUseSpec(cmdline=tuple(raw.get("cmdline", ())), env=_frozen_map(raw.get("env")),
                      users=tuple(raw.get("user", ())))


def build_model(data: Mapping[str, Any], sources: Sequence[str]) -> PolicyModel:
    """The typed view of a merged policy that passed validation (``Policy.data``'s shape)."""
    meta = data.get("policy", {})
    cpu = data.get("cpu", {})
    irq = data.get("irq", {})
    nccl = dict(data.get("nccl") or {})
    per_rank_nic = bool(nccl.pop("per_rank_nic", False))
    return PolicyModel(
        info=PolicyInfo(name=meta.get("name", ""), names=tuple(meta.get("names", ())),
                        sources=tuple(sources)),
        sysctl=_frozen_map(data.get("sysctl")),
        nic=tuple(NicRule(**e) for e in data.get("nic", ())),
        nccl=_frozen_map(nccl),
        nccl_per_rank_nic=per_rank_nic,
        block=tuple(BlockRule(**e) for e in data.get("block", ())),
        limits=Limits(**data.get("limits", {})),
        cpu=CpuSection(housekeeping=_opt_cpus(cpu.get("housekeeping")) or frozenset(),
                       governor=cpu.get("governor")),
        vm=VmSection(**data.get("vm", {})),
        gpu=GpuSection(**data.get("gpu", {})),
        irq=IrqSection(devices=tuple(irq.get("devices", ())),
                       irqbalance=irq.get("irqbalance", "ban"),
                       cpus=_opt_cpus(irq.get("cpus")),
                       check_interval_ms=irq.get("check_interval_ms", 1000)),
        pcie=PcieSection(**data.get("pcie", {})),
        jobs=tuple(_job(j) for j in data.get("job", ())),
        apply_once=tuple(meta.get("apply_once", ())),
        leases=LeasePolicy(**data.get("leases", {})),
    )
