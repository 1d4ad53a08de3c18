"""Choose GPUs, CPUs and memory nodes for a job on a node's topology.

GPUs — among the free ones, the set with the best interconnect. Each pair costs

    10 * base + spread        base: NVLink max(1, 19 - links) (NV18 = 1, NV2 = 17),
                                     PIX 20, PXB 30, PHB 40, NODE 50, SYS 60
                              spread: 0 same NUMA node, 1 same socket, 2 across sockets

so any NVLink beats any PCIe path, more NVLinks beat fewer, and among equal links
GPUs that share a NUMA node win. A set's **score** is ``1_000_000 * worst pair +
sum of pairs`` (lower is better; 0 for one GPU): the slowest link bounds a ring
all-reduce, so it decides first, the total breaks ties. The search is exhaustive
(every k-subset of the free GPUs) up to ``EXACT_LIMIT`` subsets, greedy beyond.
Equal scores go to the set nearest the GPUs already busy (it keeps the free ones
together for the next job), then to the lowest indexes: results are deterministic.

CPUs — never a housekeeping CPU, never one another job holds exclusively, always
inside ``allowed_cpus`` (the daemon's cpuset). Whole physical cores (every SMT
sibling) are taken before split ones; cores are taken in core order so a request
fills one L3 group before the next. When the local CPUs run out the choice spills
to the nearest NUMA node by SLIT distance, and ``explanation`` says so. Modes:

  gpu-local     the GPUs' slices of the node map (tunerd.topology.nodemap: each GPU
                its share of its NUMA node's cores), else their local CPUs [default]
  node          every CPU of the GPUs' NUMA node(s)
  socket        every CPU of the GPUs' package(s)
  exclusive     gpu-local, whole cores, held by this job alone
  core-complex  one L3 group (CCX) per GPU inside its local CPUs, like
                ``torchrun --numa-binding=core-complex`` (torch.numa.binding.AffinityMode,
                https://docs.pytorch.org/docs/main/elastic/numa.html)
  none          no locality: every eligible CPU

Counts: ``cpus=None`` shared means every eligible CPU of the domain. Exclusive
(``exclusive=True`` or mode ``exclusive``) with ``cpus=None`` means a fair share:
per GPU, the node's whole cores divided by the GPUs on that node (DGX H100: 14
cores = 28 CPUs per GPU); in node/socket mode the whole domain; without GPUs one
core. An explicit exclusive count is rounded up to whole cores.

Memory nodes are the NUMA nodes of the chosen CPUs.

On a replayed topology (``tunerd --topology``) pass ``allowed_cpus=None``: the
daemon's own cpuset describes this machine, not the recorded one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import PlacementError, UsageError
from tunerd.base.jsontypes import JSONObject
from tunerd.base.modes import MODES, Mode, parse_mode
from tunerd.topology.model import Gpu, Link, Topology
from tunerd.topology.nodemap import node_map

__all__ = [
    "EXACT_LIMIT",
    "MODES",
    "Mode",
    "Placement",
    "PlacementError",
    "PlacementRequest",
    "gpu_set_score",
    "is_exclusive",
    "pair_cost",
    "place",
]


# Mode and MODES live in tunerd.base.modes (watch/ and policy/ carry a mode too and may
# not import jobs/); re-exported here, where the bind domain has always imported them.


def is_exclusive(exclusive: bool, mode: Mode | None) -> bool:
    """Exclusivity decided once: the exclusive flag, or the "exclusive" placement mode."""
    return bool(exclusive) or mode == Mode.EXCLUSIVE


PCIE_BASE = {"PIX": 20, "PXB": 30, "PHB": 40, "NODE": 50, "SYS": 60}
WORST_WEIGHT = 1_000_000
EXACT_LIMIT = 20_000  # subsets examined exhaustively (C(16, 8) = 12870 fits)


@dataclass(frozen=True)
class PlacementRequest:
    gpus: int = 0
    cpus: int | None = None
    mode: Mode = Mode.GPU_LOCAL
    exclusive: bool = False
    gpu_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if type(self.mode) is not Mode:  # text from a caller: parsed here, once
            object.__setattr__(self, "mode", parse_mode(self.mode))


@dataclass(frozen=True)
class Placement:
    """Where a job goes: one type from the decision to the binder.

    ``cpus``/``mems`` of None mean "leave as it is" (a bind that only sets memory
    nodes or limits). ``notes`` say what was adjusted on the way (an allocation
    smaller than asked, ranks sharing CPUs, a replayed topology); ``applicable`` is
    False when the placement was computed on a replayed topology whose CPUs or
    memory nodes this machine lacks, so nothing may be applied.
    """

    cpus: frozenset[int] | None
    mems: frozenset[int] | None
    gpus: tuple[int, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    score: int = 0
    explanation: str = ""
    notes: tuple[str, ...] = ()
    applicable: bool = True

    @classmethod
    def given(cls, cpus: frozenset[int] | None, mems: frozenset[int] | None,
              gpus: tuple[int, ...] = (), explanation: str = "") -> Placement:
        """A placement the caller chose itself (``--cpus``/``--mems``, a rule's cpus)."""
        return cls(cpus=cpus, mems=mems, gpus=gpus, explanation=explanation)

    def with_notes(self, *notes: str, applicable: bool | None = None) -> Placement:
        return replace(self, notes=(*self.notes, *(n for n in notes if n)),
                       applicable=self.applicable if applicable is None else applicable)

    def to_json(self) -> JSONObject:
        return {"gpus": list(self.gpus), "gpu_uuids": list(self.gpu_uuids),
                "cpus": None if self.cpus is None else format_cpulist(self.cpus),
                "mems": None if self.mems is None else format_cpulist(self.mems),
                "score": self.score, "explanation": self.explanation,
                "notes": list(self.notes), "applied": self.applicable}


# -- derived indexes, computed once per topology ---------------------------------
@dataclass
class _Index:
    gpus: dict[int, Gpu]
    cost: dict[tuple[int, int], int]
    core_cpus: dict[int, tuple[int, ...]]  # core id -> its online CPUs
    cpu_core: dict[int, int]
    core_node: dict[int, int]
    core_l3: dict[int, int | None]
    node_cores: dict[int, tuple[int, ...]]
    package_nodes: dict[int, frozenset[int]]
    node_package: dict[int, int]
    distance: dict[int, dict[int, int]]


def _index(topo: Topology) -> _Index:
    idx = topo._cache.get("placement")
    if isinstance(idx, _Index):
        return idx
    core_cpus: dict[int, list[int]] = {}
    for c in sorted(topo.cpus.values(), key=lambda c: c.id):
        core_cpus.setdefault(c.core_id, []).append(c.id)
    core_node = {k: topo.cpus[v[0]].numa_node for k, v in core_cpus.items()}
    node_cores: dict[int, list[int]] = {n: [] for n in topo.numa_nodes}
    for k in sorted(core_cpus):
        node_cores.setdefault(core_node[k], []).append(k)
    node_package: dict[int, int] = {}
    for c in topo.cpus.values():
        node_package.setdefault(c.numa_node, c.package)
    package_nodes: dict[int, set[int]] = {}
    for n, p in node_package.items():
        package_nodes.setdefault(p, set()).add(n)
    distance = {n: dict(node.distances) for n, node in topo.numa_nodes.items()}
    gpus = {g.index: g for g in topo.gpus}
    cost: dict[tuple[int, int], int] = {}
    for a, b in itertools.combinations(sorted(gpus), 2):
        cost[(a, b)] = cost[(b, a)] = pair_cost(topo.link(a, b), gpus[a], gpus[b],
                                                node_package)
    idx = _Index(gpus=gpus, cost=cost,
                 core_cpus={k: tuple(v) for k, v in core_cpus.items()},
                 cpu_core={c.id: c.core_id for c in topo.cpus.values()},
                 core_node=core_node, core_l3={k: topo.cpus[v[0]].l3_id
                                               for k, v in core_cpus.items()},
                 node_cores={k: tuple(v) for k, v in node_cores.items()},
                 package_nodes={k: frozenset(v) for k, v in package_nodes.items()},
                 node_package=node_package, distance=distance)
    topo._cache["placement"] = idx
    return idx


def pair_cost(link: Link | None, a: Gpu, b: Gpu, node_package: Mapping[int, int]) -> int:
    """Cost of one GPU pair (see the module docstring); lower is better."""
    if a.numa_node is not None and a.numa_node == b.numa_node:
        spread = 0
    elif (a.numa_node is not None and b.numa_node is not None
          and node_package.get(a.numa_node) == node_package.get(b.numa_node)):
        spread = 1
    else:
        spread = 2
    if link is None:  # not recorded: judge by NUMA placement alone
        base = PCIE_BASE["NODE"] if spread == 0 else PCIE_BASE["SYS"]
    elif link.kind == "NVLINK":
        base = max(1, 19 - link.nvlinks)
    else:
        base = PCIE_BASE.get(link.kind, PCIE_BASE["SYS"])
    return 10 * base + spread


def gpu_set_score(topo: Topology, gpus: Iterable[int]) -> int:
    """``WORST_WEIGHT * worst pair cost + sum of pair costs`` over a GPU set."""
    cost = _index(topo).cost
    return _score(cost, tuple(gpus))


def _score(cost: Mapping[tuple[int, int], int], gs: tuple[int, ...]) -> int:
    worst = total = 0
    for i in range(len(gs)):
        for j in range(i + 1, len(gs)):
            c = cost[(gs[i], gs[j])]
            total += c
            if c > worst:
                worst = c
    return worst * WORST_WEIGHT + total


# -- GPUs ---------------------------------------------------------------------
def _holders(ids: Iterable[int], held: Mapping[int, str], what: str) -> str:
    by: dict[str, list[int]] = {}
    for i in ids:
        by.setdefault(held[i], []).append(i)
    return "; ".join(f"{what} {format_cpulist(v)} held by {h}" for h, v in sorted(by.items()))


def _choose_gpus(topo: Topology, idx: _Index, req: PlacementRequest,
                 busy: Mapping[int, str]) -> tuple[tuple[int, ...], int]:
    """(GPUs, score): the named ones checked, else the best ``req.gpus`` free ones."""
    if req.gpu_ids is not None:
        ids = _named_gpus(topo, idx, req, busy)
        return ids, _score(idx.cost, ids)
    k = req.gpus
    if k == 0:
        return (), 0
    free = tuple(sorted(set(idx.gpus) - set(busy)))
    if k > len(free):
        held = sorted(set(idx.gpus) & set(busy))
        raise PlacementError(
            f"need {k} GPU(s), {len(free)} free on {topo.hostname}"
            + (f" (GPU {format_cpulist(free)})" if free else "")
            + (f"; {_holders(held, busy, 'GPU')}" if held else ""),
            free_gpus=list(free), busy_gpus={str(k): v for k, v in busy.items()})
    busy_ids = [b for b in busy if b in idx.gpus]
    cost = idx.cost

    def key(gs: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        near_busy = sum(cost[(g, b)] for g in gs for b in busy_ids)
        return (_score(cost, gs), near_busy, gs)

    if math.comb(len(free), k) <= EXACT_LIMIT:
        best = min(itertools.combinations(free, k), key=key)
    else:
        best = min(_greedy_sets(cost, free, k), key=key)
    return best, _score(cost, best)


def _named_gpus(topo: Topology, idx: _Index, req: PlacementRequest,
                busy: Mapping[int, str]) -> tuple[int, ...]:
    """``req.gpu_ids``, sorted, once each: refused when repeated, unknown or busy."""
    assert req.gpu_ids is not None
    ids = tuple(sorted(set(req.gpu_ids)))
    if len(ids) != len(req.gpu_ids):
        raise UsageError(f"GPU list repeats an index: {list(req.gpu_ids)}")
    if req.gpus and req.gpus != len(ids):
        raise UsageError(f"asked for {req.gpus} GPUs but named {len(ids)}: {list(ids)}")
    unknown = [i for i in ids if i not in idx.gpus]
    if unknown:
        raise UsageError(f"no GPU {', '.join(map(str, unknown))} on {topo.hostname} "
                         f"(GPUs: {format_cpulist(idx.gpus) or 'none'})")
    taken = [i for i in ids if i in busy]
    if taken:
        free_now = sorted(set(idx.gpus) - set(busy))
        raise PlacementError(
            f"GPU {format_cpulist(taken)} not free: {_holders(taken, busy, 'GPU')}; "
            f"free GPUs: {format_cpulist(free_now) or 'none'}",
            free_gpus=free_now, busy_gpus={str(k): v for k, v in busy.items()})
    return ids


def _greedy_sets(cost: Mapping[tuple[int, int], int], free: tuple[int, ...],
                 k: int) -> set[tuple[int, ...]]:
    """Too many subsets to try: grow one set from every seed, each step adding the GPU
    that raises (worst pair, sum of pairs) least."""
    cands: set[tuple[int, ...]] = set()
    for seed in free:
        chosen = [seed]
        worst = total = 0
        while len(chosen) < k:
            pick: tuple[int, int, int] | None = None
            for g in free:
                if g in chosen:
                    continue
                add = [cost[(g, c)] for c in chosen]
                cand = (max(worst, *add), total + sum(add), g)
                if pick is None or cand < pick:
                    pick = cand
            assert pick is not None
            worst, total = pick[0], pick[1]
            chosen.append(pick[2])
        cands.add(tuple(sorted(chosen)))
    return cands


# -- CPUs ---------------------------------------------------------------------
def _gpu_nodes(topo: Topology, gpus: Iterable[Gpu]) -> list[int]:
    out: list[int] = []
    for g in gpus:
        if g.numa_node is not None and g.numa_node in topo.numa_nodes:
            nodes = [g.numa_node]
        else:
            nodes = sorted({topo.cpus[c].numa_node for c in g.local_cpus if c in topo.cpus})
        out += [n for n in nodes if n not in out]
    return out


def _order_nodes(idx: _Index, home: list[int]) -> list[int]:
    """All nodes, home ones first, then by distance from the nearest home node."""
    def dist(n: int) -> int:
        return min((idx.distance.get(h, {}).get(n, 10 if h == n else 255) for h in home),
                   default=255)
    rest = sorted((n for n in idx.node_cores if n not in home), key=lambda n: (dist(n), n))
    return [*home, *rest]


class _Picker:
    """Takes CPUs core by core from a ranked candidate list."""

    def __init__(self, idx: _Index, eligible: frozenset[int]) -> None:
        self.idx = idx
        self.eligible = eligible

    def cores_in(self, nodes: Iterable[int], within: frozenset[int] | None
                 ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(whole cores, split cores) as CPU tuples.

        Core order inside a node; nodes take turns (round robin), so a job whose
        GPUs sit on two nodes gets CPUs on both, in proportion.
        """
        per_whole: list[list[tuple[int, ...]]] = []
        per_split: list[list[tuple[int, ...]]] = []
        for n in nodes:
            whole: list[tuple[int, ...]] = []
            split: list[tuple[int, ...]] = []
            for core in self.idx.node_cores.get(n, ()):
                all_cpus = self.idx.core_cpus[core]
                ok = tuple(c for c in all_cpus if c in self.eligible
                           and (within is None or c in within))
                if not ok:
                    continue
                (whole if len(ok) == len(all_cpus) else split).append(ok)
            per_whole.append(whole)
            per_split.append(split)
        return _round_robin(per_whole), _round_robin(per_split)


def _round_robin(lists: list[list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    if len(lists) == 1:
        return lists[0]
    return [x for group in itertools.zip_longest(*lists) for x in group if x is not None]


def _fair_share_cores(topo: Topology, idx: _Index, gpus: list[Gpu],
                      usable: frozenset[int]) -> int:
    total = 0
    for g in gpus:
        nodes = [g.numa_node] if g.numa_node is not None else _gpu_nodes(topo, [g])
        if not nodes:
            total += 1
            continue
        node = nodes[0]
        on_node = sum(1 for h in topo.gpus if h.numa_node == node) or 1
        cores = sum(1 for core in idx.node_cores.get(node, ())
                    if all(c in usable for c in idx.core_cpus[core]))
        total += max(1, cores // on_node)
    return max(1, total)


def place(topo: Topology, req: PlacementRequest, *,
          busy_gpus: Mapping[int, str] | None = None,
          exclusive_cpus: Mapping[int, str] | None = None,
          housekeeping: frozenset[int] = frozenset(),
          allowed_cpus: frozenset[int] | None = None) -> Placement:
    """Choose GPUs, CPUs and memory nodes for ``req`` (see the module docstring).

    The steps, in order: check the request, choose the GPUs (``_start``), the domain
    (which NUMA nodes and which CPUs in them are local), the candidate cores in
    placement order, how many CPUs, the CPUs themselves (spilling to the nearest
    node when the domain is short), and the result with its notes.
    """
    job = _start(topo, req, dict(busy_gpus or {}), dict(exclusive_cpus or {}),
                 housekeeping, allowed_cpus)
    dom = _domain(job)
    cand = _candidates(job, dom)
    count = _cpu_count(job, cand)
    chosen = _choose_cpus(job, dom, cand, count)
    return _result(job, dom, cand, chosen)


# -- the steps of place() ---------------------------------------------------------
@dataclass
class _Job:
    """One ``place`` call: the request, its GPUs, the CPUs it may take, its notes."""

    topo: Topology
    idx: _Index
    req: PlacementRequest
    gpu_ids: tuple[int, ...]
    gpus: list[Gpu]
    score: int
    exclusive: bool
    housekeeping: frozenset[int]
    allowed: frozenset[int] | None
    held: dict[int, str]  # CPU -> who holds it exclusively
    usable: frozenset[int]  # online, not housekeeping, inside ``allowed``
    eligible: frozenset[int]  # usable and not held
    picker: _Picker
    notes: list[str]


@dataclass(frozen=True)
class _Domain:
    """Where the job counts as local: ``home`` NUMA nodes, and inside them ``within``
    (None: every CPU of them); ``sliced``: ``within`` is the GPUs' node-map slices."""

    home: list[int]
    within: frozenset[int] | None = None
    sliced: bool = False


@dataclass(frozen=True)
class _Candidates:
    """Cores to take from, in placement order; ``inner``: CPUs of the domain proper."""

    whole: list[tuple[int, ...]]
    split: list[tuple[int, ...]]
    inner: int


def _check(req: PlacementRequest) -> None:
    if req.gpus < 0 or (req.cpus is not None and req.cpus < 1):
        raise UsageError(f"bad request: gpus={req.gpus}, cpus={req.cpus} "
                         "(gpus >= 0, cpus >= 1)")


def _start(topo: Topology, req: PlacementRequest, busy: dict[int, str], held: dict[int, str],
           housekeeping: frozenset[int], allowed: frozenset[int] | None) -> _Job:
    """The request checked, its GPUs chosen, the CPUs it may take."""
    _check(req)
    idx = _index(topo)
    gpu_ids, score = _choose_gpus(topo, idx, req, busy)
    gpus = [idx.gpus[i] for i in gpu_ids]
    usable = topo.online_cpus() - housekeeping
    if allowed is not None:
        usable &= allowed
    eligible = usable - frozenset(held)
    return _Job(topo=topo, idx=idx, req=req, gpu_ids=gpu_ids, gpus=gpus, score=score,
                exclusive=is_exclusive(req.exclusive, req.mode),
                housekeeping=housekeeping, allowed=allowed, held=held, usable=usable,
                eligible=eligible, picker=_Picker(idx, eligible),
                notes=_gpu_notes(topo, gpu_ids, gpus, score))


def _gpu_notes(topo: Topology, gpu_ids: tuple[int, ...], gpus: list[Gpu],
               score: int) -> list[str]:
    if not gpu_ids:
        return []
    links = (topo.link(a, b) for a, b in itertools.combinations(gpu_ids, 2))
    pairs = sorted({lk.label for lk in links if lk is not None})
    notes = [f"GPU {format_cpulist(gpu_ids)}" + (f" ({'/'.join(pairs)})" if pairs else "")
             + f", score {score}"]
    mig = [g.index for g in gpus if g.mig_enabled]
    if mig:
        notes.append(f"GPU {format_cpulist(mig)} in MIG mode (placed as whole GPUs)")
    return notes


def _domain(job: _Job) -> _Domain:
    """Which nodes (and which CPUs inside them) count as local."""
    if job.req.mode == Mode.NONE:
        return _Domain(sorted(job.idx.node_cores))
    if job.gpus:
        return _gpu_domain(job)
    return _gpuless_domain(job)


def _gpu_domain(job: _Job) -> _Domain:
    idx, mode = job.idx, job.req.mode
    home = _gpu_nodes(job.topo, job.gpus)
    within: frozenset[int] | None = None
    sliced = False
    if mode in (Mode.GPU_LOCAL, Mode.EXCLUSIVE, Mode.CORE_COMPLEX):
        within, sliced = _gpu_local_cpus(job)
    elif mode == Mode.SOCKET:
        pkgs = {idx.node_package.get(n) for n in home}
        home = sorted(n for p in pkgs if p is not None for n in idx.package_nodes[p])
    return _Domain(home or sorted(idx.node_cores), within, sliced)


def _gpu_local_cpus(job: _Job) -> tuple[frozenset[int] | None, bool]:
    """(the GPUs' local CPUs, whether they are their slices of the node map).

    Each GPU's slice of the node (tunerd.topology.nodemap): a rank on another GPU of
    the same NUMA node, of any job, has its own slice; an allocation holding none of
    the slice falls back to the CPUs near the GPUs.
    """
    own = node_map(job.topo, job.housekeeping).slice_cpus(job.gpu_ids)
    if job.allowed is not None and own and not own & job.usable:
        job.notes.append(f"the allocation holds no CPU of GPU {format_cpulist(job.gpu_ids)}'s "
                         "slice: its CPUs near the GPU instead")
        own = frozenset()
    local = own or frozenset().union(*(g.local_cpus for g in job.gpus))
    return local or None, bool(own)


def _gpuless_domain(job: _Job) -> _Domain:
    """No GPUs: the node with the most eligible CPUs (all nodes when nothing is asked)."""
    idx = job.idx
    if job.req.cpus is None and not job.exclusive:
        home = sorted(idx.node_cores)
    elif idx.node_cores:
        home = [max(sorted(idx.node_cores),
                    key=lambda n: sum(len([c for c in idx.core_cpus[k] if c in job.eligible])
                                      for k in idx.node_cores[n]))]
    else:
        home = []
    if job.req.mode == Mode.SOCKET and home:
        home = sorted(idx.package_nodes[idx.node_package[home[0]]])
    return _Domain(home)


def _candidates(job: _Job, dom: _Domain) -> _Candidates:
    """The domain's free cores in placement order: its local CPUs first, then the rest
    of its nodes (not for a shared request filling its slice), core-complex groups."""
    whole, split = job.picker.cores_in(dom.home, dom.within)
    inner = sum(len(c) for c in whole + split)
    shared_slice = dom.sliced and job.req.cpus is None and not job.exclusive and inner > 0
    if dom.within is not None and not shared_slice:
        # node-local CPUs outside the GPU's local set come next (shared, every free CPU
        # of the slice: never the others')
        w2, s2 = job.picker.cores_in(
            dom.home, frozenset(c for c in job.eligible if c not in dom.within))
        whole, split = whole + w2, split + s2
    if job.req.mode == Mode.CORE_COMPLEX and job.req.cpus is None:
        whole, split = _core_complex(job.topo, job.idx, job.gpus, whole, split, dom.within)
    return _Candidates(whole, split, inner)


def _cpu_count(job: _Job, cand: _Candidates) -> int | None:
    """How many CPUs: the request's, or an exclusive job's fair share; exclusive counts
    rounded up to whole cores. None: shared, every eligible CPU of the domain."""
    smt = max((len(v) for v in job.idx.core_cpus.values()), default=1)
    count = job.req.cpus
    if count is None and job.exclusive:
        count = _exclusive_count(job, cand, smt)
    if job.exclusive and count is not None and count % smt:
        job.notes.append(f"{count} CPUs rounded up to whole cores")
        count += smt - count % smt
    return count


def _exclusive_count(job: _Job, cand: _Candidates, smt: int) -> int:
    mode = job.req.mode
    if mode in (Mode.NODE, Mode.SOCKET):
        count = sum(len(c) for c in cand.whole) or smt
    elif job.gpus:
        count = _fair_share_cores(job.topo, job.idx, job.gpus, job.usable) * smt
    else:
        count = smt
    if mode == Mode.CORE_COMPLEX:
        count = min(count, sum(len(c) for c in cand.whole)) or smt
    return count


def _choose_cpus(job: _Job, dom: _Domain, cand: _Candidates, count: int | None) -> list[int]:
    """The CPUs: from the candidates, then the nearest other nodes; refused when short."""
    farther = _order_nodes(job.idx, dom.home)[len(dom.home):]
    if count is None:
        chosen = _every_free(job, cand, farther)
    else:
        chosen = _counted(job, cand, count, farther)
        if len(chosen) < count:
            raise _cpu_error(job, count)
    if not chosen:
        raise _cpu_error(job, count or 1)
    return chosen


def _every_free(job: _Job, cand: _Candidates, farther: list[int]) -> list[int]:
    """Shared, every eligible CPU of the domain; when the local nodes are full, the
    nearest node that has room."""
    chosen = [c for core in cand.whole + cand.split for c in core]
    if chosen:
        return chosen
    for n in farther:
        w, s = job.picker.cores_in([n], None)
        if w or s:
            job.notes.append(f"no free CPU near the GPUs; using NUMA node {n}")
            return [c for core in w + s for c in core]
    return []


def _counted(job: _Job, cand: _Candidates, count: int, farther: list[int]) -> list[int]:
    """``count`` CPUs (fewer if the node is short): the candidates, then the nearest
    other node, filled before the next."""
    chosen = _take(cand.whole, cand.split, count, job.exclusive)
    before = len(chosen)
    if before >= count:
        return chosen
    for n in farther:
        w2, s2 = job.picker.cores_in([n], None)
        chosen += _take(w2, s2, count - len(chosen), job.exclusive)
        if len(chosen) >= count:
            break
    if len(chosen) > before:
        spilled = sorted({job.topo.cpus[c].numa_node for c in chosen[before:]})
        job.notes.append(f"spilled {len(chosen) - before} CPU(s) to NUMA node "
                         f"{format_cpulist(spilled)}: only {before} free near the GPUs")
    return chosen


def _result(job: _Job, dom: _Domain, cand: _Candidates, chosen: list[int]) -> Placement:
    topo, notes = job.topo, job.notes
    cpus = frozenset(chosen)
    if dom.sliced and dom.within is not None and not cpus <= dom.within:
        outside = cpus - dom.within
        notes.append(f"GPU {format_cpulist(job.gpu_ids)}'s slice "
                     f"({format_cpulist(dom.within)}) has {cand.inner} free CPU(s): "
                     f"{len(outside)} taken from other GPUs' slices ({format_cpulist(outside)})")
    mems = frozenset(topo.cpus[c].numa_node for c in cpus)
    ncores = len({job.idx.cpu_core[c] for c in cpus})
    notes.append(f"CPU {format_cpulist(cpus)} ({len(cpus)} CPUs on {ncores} cores, "
                 f"{'exclusive' if job.exclusive else 'shared'}, mode {job.req.mode})")
    notes.append(f"memory node {format_cpulist(mems)}")
    return Placement(gpus=job.gpu_ids, gpu_uuids=tuple(g.uuid for g in job.gpus), cpus=cpus,
                     mems=mems, score=job.score, explanation="; ".join(notes))


def _core_complex(topo: Topology, idx: _Index, gpus: list[Gpu], whole: list[tuple[int, ...]],
                  split: list[tuple[int, ...]], within: frozenset[int] | None
                  ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """One L3 group (core complex) per GPU, as torch's ``core-complex`` affinity does.

    The k-th GPU of a NUMA node starts at the k-th L3 group of that node, so workers
    of one node land on different complexes when there are enough; a group with no
    free CPU is skipped, and a group is never given twice in one placement.
    """
    groups: dict[int | None, list[tuple[int, ...]]] = {}
    for core in whole + split:
        groups.setdefault(idx.core_l3[idx.cpu_core[core[0]]], []).append(core)
    if not groups:
        return whole, split
    order = sorted(groups, key=lambda k: -1 if k is None else k)
    keep: list[int | None] = []
    targets: list[Gpu | None] = [*gpus] or [None]  # no GPUs: one group
    for g in targets:
        local = g.local_cpus if g is not None and g.local_cpus else within
        mine = [k for k in order if local is None or any(c[0] in local for c in groups[k])]
        mine = mine or order
        start = 0
        if g is not None and g.numa_node is not None:
            peers = sorted(h.index for h in topo.gpus if h.numa_node == g.numa_node)
            start = peers.index(g.index) if g.index in peers else 0
        for k in mine[start % len(mine):] + mine[:start % len(mine)]:
            if k not in keep:
                keep.append(k)
                break
    kept = [c for k in keep for c in groups[k]]
    whole_set = set(whole)
    return ([c for c in kept if c in whole_set], [c for c in kept if c not in whole_set])


def _take(whole: list[tuple[int, ...]], split: list[tuple[int, ...]], count: int,
          exclusive: bool) -> list[int]:
    """``count`` CPUs: whole cores first; shared requests may then use split cores."""
    out: list[int] = []
    for core in whole:
        if len(out) + len(core) <= count:
            out += core
        if len(out) == count:
            return out
    if exclusive:
        return out
    for core in split + whole:  # leftover: single threads (odd counts, partial cores)
        for c in core:
            if c not in out:
                out.append(c)
                if len(out) == count:
                    return out
    return out


def _cpu_error(job: _Job, count: int) -> PlacementError:
    held, eligible = job.held, job.eligible
    parts = [f"need {count} {'exclusive ' if job.exclusive else ''}CPU(s) on "
             f"{job.topo.hostname}, {len(eligible)} free ({format_cpulist(eligible) or 'none'})"]
    in_use = sorted(c for c in held if c in job.usable)
    if in_use:
        parts.append(_holders(in_use, held, "CPU"))
    if job.housekeeping:
        parts.append(f"CPU {format_cpulist(job.housekeeping)} reserved for housekeeping")
    return PlacementError("; ".join(parts), free_cpus=format_cpulist(eligible),
                          held_cpus={str(k): v for k, v in held.items()})


# -- helpers for the placing service ----------------------------------------------
def whole_cores(topo: Topology, cpus: Iterable[int]) -> frozenset[int]:
    """``cpus`` grown to whole physical cores: every SMT sibling of each CPU.

    Housekeeping CPUs are reserved by the core: a job on the sibling of a
    housekeeping CPU would share its core's execution units with the daemons
    the operator kept it for.
    """
    out: set[int] = set()
    for c in cpus:
        cpu = topo.cpus.get(c)
        out |= set(cpu.siblings) if cpu is not None and cpu.siblings else {c}
    return frozenset(out)


def per_gpu_cpu_share(topo: Topology, gpu: int, usable: frozenset[int],
                      housekeeping: frozenset[int] = frozenset()) -> int:
    """CPUs one GPU's process should get so that all GPUs sharing its CPUs fit side by side.

    E.g. a DGX H100: 4 GPUs per socket, 112 CPUs per socket -> 28 CPUs per GPU.
    ``usable``: the CPUs jobs may have (online, no housekeeping, inside the allocation).
    """
    gpus = {g.index: g for g in topo.gpus}
    g = gpus.get(gpu)
    if g is None:
        return max(1, len(usable))
    own = node_map(topo, housekeeping).slice_cpus((gpu,)) & usable
    if own:  # its slice of the node map, inside the allocation
        return len(own)
    local = (frozenset(g.local_cpus) or topo.online_cpus()) & usable or usable
    sharing = sum(1 for o in topo.gpus if ((frozenset(o.local_cpus) or local) & local))
    return max(1, len(local) // max(1, sharing))


def mems_of(topo: Topology, cpus: Iterable[int]) -> frozenset[int]:
    """NUMA nodes holding ``cpus`` (for an explicit CPU list)."""
    out = {topo.cpus[c].numa_node for c in cpus if c in topo.cpus}
    return frozenset(n for n in out if n is not None and n >= 0)


def ordered_cpus(topo: Topology, cpus: Iterable[int],
                 near: Iterable[int] = ()) -> list[int]:
    """``cpus`` in placement order: the CPUs local to ``near`` first, then by core.

    Cores stay together (a core's SMT siblings are adjacent), so contiguous
    slices of the result are whole cores wherever the count allows.
    """
    idx = _index(topo)
    near_set = frozenset(near)
    pool = set(cpus)
    by_core: dict[int, list[int]] = {}
    for c in sorted(pool):
        by_core.setdefault(idx.cpu_core.get(c, -1 - c), []).append(c)
    cores = sorted(by_core, key=lambda k: (not (set(by_core[k]) & near_set), k))
    return [c for k in cores for c in by_core[k]]
