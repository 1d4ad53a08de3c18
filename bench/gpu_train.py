#!/usr/bin/env python3
"""The guide's minimal training example, through tunerd.torch, for scripts/gpu-check.sh.

AMP (fp16 with a GradScaler on CUDA, bf16 on CPU, through ``tunerd.torch.Amp``),
gradient accumulation over 4 batches, a DataLoader with workers and ``pin_memory``
(``tunerd.torch.dataloader_kwargs``), and ``tunerd.torch.StepReporter`` sending step
time, samples/s and CUDA memory to the daemon (``tunerctl metrics``, ``top``).

``--sample-work N`` makes every sample cost N rounds of real CPU work in the worker
(a dataloader-bound job: binding and worker count then decide the throughput).
Prints ``TUNERD_METRIC samples_per_second V higher`` (what ``tunerctl bench`` reads)
and, last, ``GPU_TRAIN {json}`` with what it ran and measured.

    python bench/gpu_train.py --seconds 20
    tunerctl bench --quick --gpus 1 -- python bench/gpu_train.py --sample-work 3000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ACCUMULATION = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="batches to run (after --seconds)")
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="run at least this long (the check reads metrics meanwhile)")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--features", type=int, default=1024, help="model width (the guide: 1024)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sample-work", type=int, default=0,
                    help="CPU work per sample in the DataLoader worker (rounds)")
    ap.add_argument("--warmup", type=int, default=4, help="batches not timed")
    a = ap.parse_args()
    features, batch = a.features, a.batch

    import tunerd.torch as tt

    with tt.keep_affinity():
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, Dataset

    class Synthetic(Dataset):  # type: ignore[type-arg]
        """Random samples; ``work`` rounds of CPU work each, as a decoder would spend."""

        def __init__(self, n: int, work: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, features, generator=g)
            self.y = torch.randn(n, features, generator=g)
            self.work = work

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> Any:
            acc = i
            for k in range(self.work):  # pure-Python work: holds this worker's CPU
                acc = (acc * 1103515245 + k) & 0x7FFFFFFF
            x = self.x[i]
            return (x + (acc & 1) * 0.0), self.y[i]

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, features), nn.ReLU(),
                          nn.Linear(features, features)).to(device)
    criterion = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp = tt.Amp(device, "fp16" if cuda else "bf16")
    kw = tt.dataloader_kwargs(num_workers=a.workers, pin_memory=cuda)
    loader = DataLoader(Synthetic(a.samples, a.sample_work), batch_size=batch, shuffle=True,
                        drop_last=True, **kw)
    reporter = tt.StepReporter(batch_size=batch, interval=0.5, loader=loader)
    deadline = time.monotonic() + a.seconds
    done, t0 = 0, 0.0
    scaled = bool(amp.scaler.is_enabled())
    while done < a.steps or time.monotonic() < deadline:
        for i, (inputs, targets) in enumerate(loader, 1):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with amp.autocast():
                loss = criterion(model(inputs).float(), targets) / ACCUMULATION
            amp.backward(loss)
            if i % ACCUMULATION == 0:
                amp.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            done += 1
            reporter.step()
            if done == a.warmup:
                t0 = time.perf_counter()
            if done >= a.steps and time.monotonic() >= deadline:
                break
    elapsed = time.perf_counter() - t0 if t0 else 0.0
    summary = reporter.close()
    timed = done - a.warmup
    rate = timed * batch / elapsed if elapsed and timed > 0 else summary.get("samples_per_s")
    if rate:
        print(f"TUNERD_METRIC samples_per_second {rate:.3f} higher", flush=True)
    out = {"device": device.type, "torch": torch.__version__, "amp": amp.mode,
           "grad_scaler": scaled, "accumulation": ACCUMULATION,
           "num_workers": kw.get("num_workers", 0), "pin_memory": kw.get("pin_memory", False),
           "sample_work": a.sample_work, "steps": done, "samples_per_s": rate,
           "cpus": sorted(os.sched_getaffinity(0)),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "reporter": {k: summary.get(k) for k in ("daemon", "reports_sent", "step_time_s",
                                                    "samples_per_s", "memory")}}
    print("GPU_TRAIN " + json.dumps(out, default=str), flush=True)
    return 0 if rate else 1


if __name__ == "__main__":
    sys.exit(main())
