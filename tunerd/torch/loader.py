"""DataLoader settings sized to the CPUs this rank was given.

The guide's checklist: ``num_workers`` from the CPU cores (then measured),
``pin_memory=True`` for CUDA, prefetching, and workers kept across epochs. The
computed defaults, for a rank with S CPUs (its share when ranks share a set):

- CUDA: ``num_workers = max(1, S - 1)`` — the main process mostly queues kernels and
  waits, so it needs one CPU and the rest can prepare batches; CPU-only:
  ``num_workers = S // 2`` — the main process computes with its intra-op threads, so
  data loading gets at most half the CPUs; both at most 8 per rank (each worker holds
  its own copy of whatever the dataset touches; ``tunerctl tune`` measures beyond).
- ``pin_memory``: with CUDA only (page-locked buffers speed up host-to-device copies
  and mean nothing without a GPU);
- ``persistent_workers``: whenever there are workers (no re-fork every epoch);
- ``prefetch_factor``: torch's 2, only with workers (torch refuses it without).

Then the daemon's ``torch`` settings, then the environment (``TUNERD_NUM_WORKERS``
...) override them; see ``tunerd.torch.settings``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tunerd.torch.affinity import Allocation, allocation, check_process, make_worker_init_fn
from tunerd.torch.link import daemon_settings
from tunerd.torch.settings import (
    ENV,
    env_overrides,
    log,
    record,
    valid_settings,
    warn_once,
)

__all__ = ["LoaderPlan", "dataloader_kwargs", "loader_plan"]

MAX_AUTO_WORKERS = 8
LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


@dataclass
class LoaderPlan:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    cuda: bool
    allocation: Allocation
    sources: dict[str, str] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                              "persistent_workers": self.persistent_workers}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kw["prefetch_factor"] = self.prefetch_factor
        return kw

    def explain(self) -> str:
        parts = [f"{k}={getattr(self, k)} ({self.sources.get(k, 'computed')})"
                 for k in LOADER_KEYS]
        return f"DataLoader for {self.allocation.reason}: " + ", ".join(parts)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def loader_plan(*, cuda: bool | None = None, alloc: Allocation | None = None,
                num_workers: int | None = None, pin_memory: bool | None = None,
                persistent_workers: bool | None = None, prefetch_factor: int | None = None,
                settings: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> LoaderPlan:
    """Resolve the four DataLoader settings (raises on bad input; see dataloader_kwargs).

    Arguments given replace the computed defaults; ``settings`` (default: asked from
    the daemon) and then ``env`` (default: os.environ) override them.
    """
    cuda = _cuda_available() if cuda is None else cuda
    alloc = alloc or allocation()
    layers: list[tuple[str, Mapping[str, Any]]] = [
        ("argument", {k: v for k, v in {"num_workers": num_workers, "pin_memory": pin_memory,
                                        "persistent_workers": persistent_workers,
                                        "prefetch_factor": prefetch_factor}.items()
                      if v is not None}),
        ("daemon ([[job]] torch table)",
         daemon_settings() if settings is None else valid_settings(settings, "settings")),
        ("environment", env_overrides(env)),
    ]
    share = math.floor(alloc.share)
    computed_workers = max(1, share - 1) if cuda else share // 2
    computed_workers = min(MAX_AUTO_WORKERS, computed_workers)
    values: dict[str, Any] = {"num_workers": computed_workers, "pin_memory": cuda}
    sources = {"num_workers": f"computed: {'CUDA' if cuda else 'CPU'} training, "
                              f"{alloc.share:g} CPU(s) for this rank",
               "pin_memory": f"computed: {'CUDA' if cuda else 'no CUDA'}"}

    def apply(keys: tuple[str, ...]) -> None:
        for origin, layer in layers:
            for k in keys:
                if k in layer:
                    values[k] = layer[k]
                    sources[k] = (f"env {ENV[k]}" if origin == "environment"
                                  else origin)

    apply(("num_workers", "pin_memory"))
    workers = int(values["num_workers"])
    values["persistent_workers"] = workers > 0
    values["prefetch_factor"] = 2 if workers > 0 else None
    sources["persistent_workers"] = "computed: workers > 0"
    sources["prefetch_factor"] = "computed: torch's default" if workers else "computed: no workers"
    apply(("persistent_workers", "prefetch_factor"))
    if workers == 0:
        # torch refuses both without workers
        for k in ("persistent_workers", "prefetch_factor"):
            if values[k] not in (False, None):
                sources[k] = f"dropped ({sources[k]}): no workers"
        values["persistent_workers"], values["prefetch_factor"] = False, None
    return LoaderPlan(workers, bool(values["pin_memory"]), bool(values["persistent_workers"]),
                      values["prefetch_factor"], cuda, alloc, sources)


_explained = False


def dataloader_kwargs(*, cuda: bool | None = None, num_workers: int | None = None,
                      pin_memory: bool | None = None, persistent_workers: bool | None = None,
                      prefetch_factor: int | None = None,
                      worker_init_fn: Callable[[int], Any] | None = None,
                      pin_workers: bool = True,
                      settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.data.DataLoader``::

        loader = DataLoader(ds, batch_size=256, shuffle=True,
                            **tunerd.torch.dataloader_kwargs())

    num_workers, pin_memory, persistent_workers, prefetch_factor (see the module doc),
    and a ``worker_init_fn`` that pins each worker to its own CPU (``pin_workers``)
    and then calls yours. Never raises: on any failure it logs one warning and
    returns only the arguments you passed.
    """
    global _explained
    mine: dict[str, Any] = {k: v for k, v in {"num_workers": num_workers, "pin_memory": pin_memory,
                              "persistent_workers": persistent_workers,
                              "prefetch_factor": prefetch_factor}.items() if v is not None}
    try:
        check_process()
        plan = loader_plan(cuda=cuda, num_workers=num_workers, pin_memory=pin_memory,
                           persistent_workers=persistent_workers,
                           prefetch_factor=prefetch_factor, settings=settings)
        kw = plan.kwargs()
        if pin_workers and plan.num_workers > 0:
            kw["worker_init_fn"] = make_worker_init_fn(worker_init_fn,
                                                       num_workers=plan.num_workers,
                                                       alloc=plan.allocation)
        elif worker_init_fn is not None:
            kw["worker_init_fn"] = worker_init_fn
        if not _explained:
            _explained = True
            log.info("tunerd.torch: %s", plan.explain())
        record("dataloader", {**{k: getattr(plan, k) for k in LOADER_KEYS},
                              "cpus": list(plan.allocation.cpus),
                              "ranks_sharing": plan.allocation.ranks_sharing,
                              "pinned_workers": "worker_init_fn" in kw and pin_workers,
                              "sources": plan.sources})
        return kw
    except Exception as err:
        warn_once("dataloader_kwargs", "tunerd.torch: dataloader_kwargs failed (%r); using "
                  "only the arguments given", err)
        if worker_init_fn is not None:
            mine["worker_init_fn"] = worker_init_fn
        return mine
