"""Bottleneck findings for a bound job, from its recent sample history.

Every rule is a pure function of (job, columns): ``job`` is the latest job
sample, ``columns`` maps a history field (tunerd.monitor.history.JOB_FIELDS) to
its values, oldest first, NaN where not available. Rules are tested on recorded
sequences; the daemon runs them on its live rings (``tunerctl advise``).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tunerd.base.cpulist import format_cpulist

# Thresholds, with the reason for each number.
GPU_IDLE_BELOW = 0.5  # a GPU busy less than half the time is waiting for something
CPU_SATURATED_ABOVE = 0.9  # the job uses >90% of the CPUs it is bound to
IO_PRESSURE_ABOVE = 0.2  # PSI io "some" avg10: tasks stalled on I/O >20% of the time
IOWAIT_ABOVE = 0.2
DISK_BUSY_ABOVE = 0.9
LOCALITY_BELOW = 0.8  # <80% of pages on the bound nodes: remote accesses cost ~1.5-2x
FRAG_MIN_GAP_BYTES = 2 << 30  # reserved-but-unallocated memory worth reporting
FRAG_RATIO = 1.5
THROTTLE_SHARE = 0.2  # throttled in more than a fifth of the samples
FD_USED_ABOVE = 0.8
OVERSUB_FACTOR = 2.0  # runnable threads more than twice the CPUs
MIN_SAMPLES = 3
THROTTLE_POWER_THERMAL = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # see tunerd.monitor.gpu


@dataclass
class Finding:
    id: str
    severity: str  # "info" | "warning" | "critical"
    title: str
    evidence: dict[str, Any]
    why: str
    fix: str
    docs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Columns = dict[str, list[float]]


def _vals(cols: Columns, name: str) -> list[float]:
    return [v for v in cols.get(name, []) if v is not None and not math.isnan(v)]


def _median(vals: Sequence[float]) -> float | None:
    return statistics.median(vals) if vals else None


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def data_loading(job: dict[str, Any], cols: Columns) -> Finding | None:
    gpu = _vals(cols, "gpu_utilization_ratio")
    # the busy share of the job's CPUs counts its DataLoader worker processes too; the
    # job's own CPU time (cpu_ratio) is the fallback where per-CPU stats are missing
    cpu = _vals(cols, "cpus_busy_ratio") or _vals(cols, "cpu_ratio")
    if len(gpu) < MIN_SAMPLES or len(cpu) < MIN_SAMPLES:
        return None
    g, c = _median(gpu), _median(cpu)
    assert g is not None and c is not None
    if g >= GPU_IDLE_BELOW or c <= CPU_SATURATED_ABOVE:
        return None
    return Finding(
        "data-loading-bound", "warning", "GPU waits for input while the job's CPUs are full",
        {"gpu_utilization_median": _r(g), "cpu_saturation_median": _r(c),
         "bound_cpus": job.get("cpus"), "samples": min(len(gpu), len(cpu))},
        "The GPUs idle while every CPU the job may use is busy: data loading and "
        "augmentation on the CPU cannot keep up with the GPU.",
        "Give the job more CPUs (tunerctl bind PID --cpus LIST, or a wider placement) and "
        "raise DataLoader(num_workers=...) to use them; set pin_memory=True and "
        "persistent_workers=True; move decoding/augmentation to the GPU (e.g. DALI).",
        ["https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html"])


def io_bound(job: dict[str, Any], cols: Columns) -> Finding | None:
    psi = _vals(cols, "psi_io_some")
    iow = _vals(cols, "iowait_ratio")
    disk = _vals(cols, "disk_busy_max")
    p, w, d = _median(psi), _median(iow), _median(disk)
    hits = {k: v for k, v, lim in (("io_pressure_some_median", p, IO_PRESSURE_ABOVE),
                                   ("iowait_median", w, IOWAIT_ABOVE),
                                   ("disk_busy_max_median", d, DISK_BUSY_ABOVE))
            if v is not None and v > lim}
    if not hits or max(len(psi), len(iow), len(disk)) < MIN_SAMPLES:
        return None
    reads = _median(_vals(cols, "read_bytes_per_second"))
    gpu = _median(_vals(cols, "gpu_utilization_ratio"))
    # only the job's problem if it reads, or its GPU starves
    if not ((reads or 0) > 1 << 20 or (gpu is not None and gpu < GPU_IDLE_BELOW)):
        return None
    return Finding(
        "io-bound", "warning", "Storage I/O stalls the node while the job reads or waits",
        {**{k: _r(v) for k, v in hits.items()}, "job_read_bytes_per_second": _r(reads, 0),
         "gpu_utilization_median": _r(gpu)},
        "Tasks spend a large share of time waiting on block I/O (PSI io / iowait), or a "
        "disk is saturated; training steps wait for data.",
        "Stage the dataset on local NVMe (XFS/ext4) or page cache, use a sharded/streaming "
        "format (WebDataset, TFRecord), raise DataLoader prefetch_factor, check the block "
        "queue settings (tunerctl plan) and `tunerctl doctor --data-dir DIR`.")


def remote_numa(job: dict[str, Any], cols: Columns) -> Finding | None:
    loc = _vals(cols, "locality_ratio")
    if not loc or loc[-1] >= LOCALITY_BELOW:
        return None
    return Finding(
        "remote-numa-memory", "warning",
        f"Only {loc[-1]:.0%} of the job's memory is on its NUMA node(s)",
        {"locality_ratio": _r(loc[-1]), "threshold": LOCALITY_BELOW,
         "bound_mems": job.get("mems"), "numa_bytes": job.get("numa_bytes")},
        "CPU accesses to memory on a remote NUMA node are slower and cross the socket "
        "interconnect, which also carries GPU and NIC traffic.",
        f"Bind memory with the CPUs: tunerctl bind {job.get('pid')} --mems "
        f"{job.get('mems') or 'NODES'} (new allocations), and move existing pages with "
        f"`migratepages {job.get('pid')} <from-nodes> {job.get('mems') or 'NODES'}`; "
        "start jobs with `tunerctl run` so memory is local from the first page.")


def gpu_fragmentation(job: dict[str, Any], cols: Columns) -> Finding | None:
    res = _vals(cols, "torch_reserved_bytes")
    alloc = _vals(cols, "torch_allocated_bytes")
    if not res or not alloc:
        return None
    r, a = res[-1], alloc[-1]
    if r - a < FRAG_MIN_GAP_BYTES or r < FRAG_RATIO * a:
        return None
    return Finding(
        "gpu-memory-fragmentation", "warning",
        "PyTorch holds much more GPU memory than its tensors use",
        {"reserved_bytes": int(r), "allocated_bytes": int(a),
         "reserved_over_allocated": _r(r / a if a else math.inf, 2)},
        "The caching allocator keeps freed blocks that do not fit new requests; this can "
        "end in out-of-memory errors with plenty of memory nominally free.",
        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or max_split_size_mb:512), "
        "keep tensor shapes stable (pad variable-length batches), and avoid "
        "torch.cuda.empty_cache() in the step loop.",
        ["https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"])


def throttling(job: dict[str, Any], cols: Columns) -> Finding | None:
    bits = [int(v) for v in _vals(cols, "gpu_throttle_reasons")]
    if len(bits) < MIN_SAMPLES:
        return None
    hot = [b for b in bits if b & THROTTLE_POWER_THERMAL]
    share = len(hot) / len(bits)
    if share <= THROTTLE_SHARE:
        return None
    seen = 0
    for b in hot:
        seen |= b & THROTTLE_POWER_THERMAL
    from tunerd.monitor.gpu import THROTTLE_REASONS

    return Finding(
        "gpu-throttling", "critical" if seen & (0x8 | 0x40 | 0x80) else "warning",
        "The job's GPUs are slowed by power or thermal limits",
        {"throttled_share": _r(share), "reasons": [n for bit, n in THROTTLE_REASONS.items()
                                                   if seen & bit], "gpus": job.get("gpus")},
        "Clock throttling lowers the SM clock, so every step takes longer than it should.",
        "Check cooling and airflow (nvidia-smi -q -d PERFORMANCE,TEMPERATURE), the power "
        "limit (policy [gpu] power_limit_w, nvidia-smi -pl) and the PSU/power brake "
        "signals; hardware slowdown events warrant a hardware ticket.")


def fd_limit(job: dict[str, Any], cols: Columns) -> Finding | None:
    fds, lim = _vals(cols, "open_fds"), _vals(cols, "nofile_soft")
    if not fds or not lim or lim[-1] <= 0:
        return None
    used = fds[-1] / lim[-1]
    if used < FD_USED_ABOVE:
        return None
    return Finding(
        "fd-limit", "critical" if used >= 0.95 else "warning",
        f"The job uses {used:.0%} of its open-file limit",
        {"open_fds": int(fds[-1]), "nofile_soft": int(lim[-1]), "used_ratio": _r(used)},
        "DataLoader workers sharing tensors through file descriptors, datasets of many "
        "files and NCCL sockets use fds; at the limit the job fails with 'Too many open "
        "files'.",
        f"Raise the limit: tunerctl bind {job.get('pid')} --nofile 1048576 (or policy "
        "[limits] nofile); with DataLoader, torch.multiprocessing.set_sharing_strategy("
        "'file_system') also helps.")


def workers_crowded(job: dict[str, Any], cols: Columns) -> Finding | None:
    """DataLoader workers and the main process crowd too few CPUs (the guide's example).

    The job's own CPU time misses its workers (processes, not threads); the tree's
    CPU time (job + workers) against the CPUs it is bound to does not. Where a
    neighbour competes for the same CPUs (the job at nice 10 next to a CPU hog), the
    tree gets a small share of CPUs that are nevertheless all busy: the busy share of
    the job's CPUs as /proc/stat counts it (``cpus_busy_ratio``) shows that.
    """
    tree = _vals(cols, "tree_cpu_ratio")
    busy = _vals(cols, "cpus_busy_ratio")
    workers = _vals(cols, "workers")
    ncpus = _vals(cols, "ncpus")
    if (len(tree) < 2 and len(busy) < MIN_SAMPLES) or not workers or not ncpus:
        return None
    w, n = int(workers[-1]), int(ncpus[-1])
    t = _median(tree) if len(tree) >= 2 else None
    b = _median(busy) if len(busy) >= MIN_SAMPLES else None
    if w < 1 or w + 1 <= n or max(t or 0.0, b or 0.0) < CPU_SATURATED_ABOVE:
        return None
    return Finding(
        "data-loading-cpu-starved", "warning",
        f"{w} DataLoader worker(s) and the main process share {n} busy CPU(s)",
        {"workers": w, "ncpus": n, "tree_cpu_ratio_median": _r(t),
         "cpus_busy_ratio_median": _r(b),
         "job_cpu_ratio_median": _r(_median(_vals(cols, "cpu_ratio"))),
         "bound_cpus": job.get("cpus"), "worker_pids": (job.get("worker_pids") or [])[:16],
         "samples": max(len(tree), len(busy))},
        "Every CPU the job may use is busy, and its DataLoader workers (separate "
        "processes), the training loop and any other process on those CPUs take turns "
        "on them: the step waits for batches and the workers wait for CPU time. The "
        "job's own CPU share hides this; the share of the job with its workers, or the "
        "busy share of its CPUs where a neighbour takes the rest, shows it.",
        "Give the job at least one CPU per worker plus one for the training loop "
        "(tunerctl bind PID --cpus LIST, a [[job]] rule with workers = N, or tunerctl run "
        "--workers N), or lower num_workers to the CPUs it has "
        "(tunerd.torch.dataloader_kwargs() sizes it from the CPUs given).",
        ["https://pytorch.org/docs/stable/data.html#multi-process-data-loading"])


def cpu_oversubscription(job: dict[str, Any], cols: Columns) -> Finding | None:
    # runnable threads of the job with its workers' (the sampler sets tree_runnable on
    # every sample, never below runnable_threads); the job's own without that column
    run = _vals(cols, "tree_runnable") or _vals(cols, "runnable_threads")
    ncpus = _vals(cols, "ncpus")
    if not run or not ncpus:
        return None
    r, n = _median(run), ncpus[-1]
    assert r is not None
    if r <= OVERSUB_FACTOR * n or r < n + 2:
        return None
    return Finding(
        "cpu-oversubscription", "warning",
        f"{r:.0f} runnable threads compete for {n:.0f} CPU(s)",
        {"runnable_threads_median": _r(r, 1), "bound_cpus": job.get("cpus"),
         "ncpus": int(n), "threads": job.get("threads")},
        "More runnable threads than CPUs means time slicing, cache thrash and lock "
        "convoys; intra-op thread pools (OpenMP/MKL) default to every CPU of the node.",
        "Set OMP_NUM_THREADS / torch.set_num_threads() to the job's CPUs divided by the "
        "processes sharing them, lower DataLoader num_workers, or bind more CPUs.")


def nic_far(job: dict[str, Any], cols: Columns) -> Finding | None:
    """The NIC of one of the job's GPUs is on another NUMA node (``gpu_nics``: what the
    daemon adds to the job from tunerd.topology.iopath, GPU -> its NICs as JSON)."""
    pairs = job.get("gpu_nics") or {}
    far = [p for g in job.get("gpus") or [] for p in pairs.get(str(g), [])
           if p.get("tier") == "remote"]
    if not far:
        return None
    return Finding(
        "nic-far", "warning", "a GPU's NIC is on another NUMA node",
        {"pairs": [{"gpu": p["gpu"], "nic": p["device"], "nic_numa_node": p["numa_node"]}
                   for p in far]},
        "Network traffic of the GPU crosses the socket interconnect: multi-node bus "
        "bandwidth can drop to about half (NVIDIA/nccl-tests #347).",
        "Put a fabric NIC on the GPU's NUMA node, or run the ranks of this node's other "
        "GPUs; [nccl] per_rank_nic = true gives every rank the nearest NIC there is.")


# the placer's notes when a GPU's share of the node cannot hold a rank and its DataLoader
# workers (tunerd.jobs.placer: the rank then stays in its GPU's slice, never spreads)
_SLICE_NOTES = (
    re.compile(r"GPU (?P<gpus>[\d,-]+)'s slice has (?P<ncpus>\d+) CPU\(s\), too few for the "
               r"rank and its (?P<workers>\d+) DataLoader worker"),
    re.compile(r"GPU (?P<gpus>[\d,-]+)'s slice \(CPU [\d,-]+\) cannot give each of the "
               r"(?P<sharers>\d+) ranks on it room for (?P<workers>\d+) DataLoader worker"),
    re.compile(r"(?:^|; )(?P<ncpus>\d+) CPU\(s\) for a process with (?P<workers>\d+) "
               r"DataLoader worker\(s\): they will share them"),
)


def slice_too_small(job: dict[str, Any], cols: Columns) -> Finding | None:
    """The rank's GPU share of the node has too few CPUs for it and its DataLoader
    workers: what the placer noted when it bound the rank (``explanation``, from the
    job's record)."""
    text = str(job.get("explanation") or "")
    m = next((m for rx in _SLICE_NOTES if (m := rx.search(text)) is not None), None)
    if m is None:
        return None
    got = m.groupdict()
    gpus = got.get("gpus") or ",".join(str(g) for g in job.get("gpus") or []) or "?"
    return Finding(
        "slice-too-small", "warning",
        f"GPU {gpus}'s slice of the node is too small for the rank and its "
        f"{got['workers']} DataLoader worker(s)",
        {"gpus": gpus, "workers": int(got["workers"]),
         "slice_cpus": int(got["ncpus"]) if got.get("ncpus") else None,
         "ranks_on_gpu": int(got["sharers"]) if got.get("sharers") else None,
         "bound_cpus": job.get("cpus"), "note": m.group(0).lstrip("; ")[:300]},
        "Each GPU owns a slice of its NUMA node's cores (tunerctl topology); a rank stays "
        "in its GPU's slice so that jobs on other GPUs keep theirs. Here the slice has "
        "fewer CPUs than the rank and its DataLoader workers: they take turns on them.",
        "Lower num_workers to the CPUs given (tunerd.torch.dataloader_kwargs() sizes it), "
        "put fewer ranks on the GPU, or set workers in the [[job]] rule to what the slice "
        "holds; on a node with idle GPUs, the job may use their CPUs explicitly "
        "(tunerctl run --cpus LIST).")


def grace_binding_unmeasured(job: dict[str, Any], cols: Columns) -> Finding | None:
    """A rank bound to CPUs on a Grace node (Arm, NVLink-C2C between CPU and GPU:
    ``arch`` is what the daemon adds, ``platform.machine()``) whose binding was not
    measured to pay (``binding_measured``: nothing sets it yet but the caller)."""
    if job.get("arch") != "aarch64" or not job.get("gpus") or not job.get("cpus"):
        return None
    if job.get("binding_measured"):
        return None
    return Finding(
        "grace-binding-unmeasured", "info",
        "the rank is bound on a Grace node, where binding has not been measured to pay",
        {"arch": job["arch"], "cpus": job.get("cpus"), "gpus": job.get("gpus")},
        "On Grace the GPU reaches host memory over NVLink-C2C (900 GB/s), so a rank's "
        "CPUs matter less than on x86: pinning ranks measured -3% on GB200 in a public "
        "tuning note, while where pinned and offload buffers live matters (vLLM #30492: "
        "1.5x for CPU offload on the right node). tunerd keeps memory on the GPU's Grace "
        "node and never binds CPUs to a GPU-memory node.",
        "Measure it on this node: tunerctl bench --runs 7 --gpus 1 -- python train.py "
        "(A: unbound, B: tunerd's placement). If B does not win, leave the job unbound "
        "(a [[job]] rule with placement = \"none\", or run it outside tunerd).",
        ["docs/placement.md#grace-blackwell-dgx-b200-and-hgx-h200-the-node-map-per-platform"])


RULES: list[Callable[[dict[str, Any], Columns], Finding | None]] = [
    data_loading, workers_crowded, io_bound, remote_numa, gpu_fragmentation, throttling,
    fd_limit, cpu_oversubscription, nic_far, slice_too_small, grace_binding_unmeasured,
]


def self_pinned(cpus: frozenset[int], gpus: Sequence[int], slice_cpus: frozenset[int],
                cpu_nodes: frozenset[int], pages: dict[int, int]) -> list[Finding]:
    """A rank that pinned itself (numactl, taskset, torchrun --numa-binding), held by
    tunerd as an external owner of ``cpus``: its CPUs outside its GPUs' slice
    (``slice_cpus``), or most of its memory (``pages``: NUMA node -> pages) on nodes other
    than its CPUs' (``cpu_nodes``)."""
    out: list[Finding] = []
    gpu_text = ",".join(str(g) for g in gpus)
    outside = cpus - slice_cpus
    if gpus and slice_cpus and outside:
        out.append(Finding(
            "self-pinned-outside-slice", "warning",
            f"the rank pinned itself to CPUs outside GPU {gpu_text}'s slice",
            {"cpus": _cpus(cpus), "outside": _cpus(outside), "gpus": list(gpus),
             "slice": _cpus(slice_cpus)},
            "Its launcher (numactl/taskset, torchrun --numa-binding) chose CPUs that are "
            "not near its GPU: host-device copies cross the socket link, and the CPUs "
            "may be another GPU's ranks' share.",
            f"Pin it inside CPUs {_cpus(slice_cpus)} (tunerctl env --local-rank N prints "
            "the slice), or start it without numactl/taskset and let tunerd place it."))
    total = sum(pages.values())
    local = sum(n for node, n in pages.items() if node in cpu_nodes)
    if total and cpu_nodes and local / total < LOCALITY_BELOW:
        out.append(Finding(
            "self-pinned-remote-memory", "warning",
            "most of the self-pinned rank's memory is on another NUMA node than its CPUs",
            {"cpu_nodes": _cpus(cpu_nodes), "local_share": round(local / total, 3),
             "pages": {str(k): v for k, v in sorted(pages.items())}},
            "numactl --physcpubind (and torchrun --numa-binding) set CPUs only: memory "
            "stays wherever it was first touched; remote accesses cost ~1.5-2x.",
            "Keep [[job]] self_pinned_memory = \"bind\" (the default) so tunerd binds its "
            "memory to its CPUs' node, or add --membind to the launcher's numactl."))
    return out


def _cpus(ids: frozenset[int]) -> str:
    return format_cpulist(ids)


def advise(job: dict[str, Any], cols: Columns) -> list[Finding]:
    """Every finding the rules make for one job, most severe first."""
    order = {"critical": 0, "warning": 1, "info": 2}
    found = [f for rule in RULES if (f := rule(job, cols)) is not None]
    return sorted(found, key=lambda f: order.get(f.severity, 3))
