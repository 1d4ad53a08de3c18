"""Training-side helpers: the guide's checklist applied from inside the training script.

::

    import tunerd.torch as tt
    with tt.keep_affinity():                  # only needed with KMP_AFFINITY/OMP_PROC_BIND
        import torch

    loader = DataLoader(ds, batch_size=256, shuffle=True, **tt.dataloader_kwargs())
    amp = tt.Amp(device)                      # autocast (+ GradScaler for fp16)
    model = tt.maybe_compile(model)           # torch.compile when asked
    rep = tt.StepReporter(batch_size=256)     # step time, samples/s, memory -> tunerd
    for x, y in loader:
        ...
        rep.step()

Every helper works without a daemon and never breaks training: one that fails logs
one warning and falls back. torch is imported only inside the helpers that need it
(this package imports without it). Settings resolve as computed default (or your
argument) < the daemon's ``[[job]]`` ``torch`` table < the environment
(``TUNERD_NUM_WORKERS``, ``TUNERD_PIN_MEMORY``, ``TUNERD_PERSISTENT_WORKERS``,
``TUNERD_PREFETCH_FACTOR``, ``TUNERD_AMP``, ``TUNERD_COMPILE``), which is how
``tunerctl bench`` and ``tunerctl tune`` vary them from outside.
"""

from __future__ import annotations

from tunerd.torch.affinity import (
    Allocation,
    WorkerPinner,
    allocation,
    check_process,
    keep_affinity,
    make_worker_init_fn,
    worker_init_fn,
)
from tunerd.torch.amp import Amp, cpu_has_native_bf16, maybe_compile
from tunerd.torch.link import daemon_settings, dataloader_workers
from tunerd.torch.loader import LoaderPlan, dataloader_kwargs, loader_plan
from tunerd.torch.ncclenv import export_nccl_env
from tunerd.torch.reporter import (
    StepReporter,
    report_memory,
    torch_memory_stats,
)
from tunerd.torch.settings import env_overrides

__all__ = [
    "Allocation",
    "Amp",
    "LoaderPlan",
    "StepReporter",
    "WorkerPinner",
    "allocation",
    "check_process",
    "cpu_has_native_bf16",
    "daemon_settings",
    "dataloader_kwargs",
    "dataloader_workers",
    "env_overrides",
    "export_nccl_env",
    "keep_affinity",
    "loader_plan",
    "make_worker_init_fn",
    "maybe_compile",
    "report_memory",
    "torch_memory_stats",
    "worker_init_fn",
]
