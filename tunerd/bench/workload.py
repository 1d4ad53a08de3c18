"""The built-in training workload of ``tunerctl bench``: the guide's closing example.

nn.Linear(1024, 1024), MSE loss, Adam; synthetic data (4096 samples) through a
DataLoader with 4 workers, batch 256, shuffled; autocast (bf16 on CPU, fp16 with a
GradScaler on CUDA, as the guide does); gradient accumulation over 4 batches;
``optimizer.zero_grad(set_to_none=True)``. Three epochs (48 batches) by default.

Its settings go through ``tunerd.torch`` with the guide's values as arguments, so the
environment overrides (``TUNERD_NUM_WORKERS``, ``TUNERD_PIN_MEMORY``,
``TUNERD_AMP``, ``TUNERD_COMPILE`` ...) vary them for bench's arms and ``tune``.

It prints ``TUNERD_WORKLOAD {json}`` (what it ran with) and
``TUNERD_METRIC samples_per_second <value> higher``, measured over the batches after
the first ``TUNERD_BENCH_WARMUP`` (4; they include worker start-up and, with compile,
the compilation). ``TUNERD_BENCH_STEPS`` sets the number of batches. When no batch
was timed (a single batch) it prints no metric and exits 1.
The data stays on the CPU and batches move to the GPU in the loop: CUDA tensors
cannot be handed out by worker processes, which the guide's listing would try.
"""

from __future__ import annotations

import json
import os
import sys
import time

NAME = ("built-in training loop (tunerd.bench.workload, the guide's example): "
        "nn.Linear(1024, 1024) + MSE + Adam, batch 256, gradient accumulation 4, "
        "DataLoader with workers over 4096 synthetic samples")
SAMPLES = 4096
BATCH = 256
ACCUMULATION = 4
FEATURES = 1024


def _int_env(name: str, default: int) -> int:
    v = os.environ.get(name, "").strip()
    return int(v) if v.isdigit() else default


def main() -> int:
    steps = max(1, _int_env("TUNERD_BENCH_STEPS", 48))
    warmup = min(_int_env("TUNERD_BENCH_WARMUP", 4), steps - 1)

    import tunerd.torch as tt

    with tt.keep_affinity():
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, FEATURES).to(device)
    criterion = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp = tt.Amp(device, "fp16" if cuda else "bf16")
    model = tt.maybe_compile(model)
    x = torch.randn(SAMPLES, FEATURES)
    y = torch.randn(SAMPLES, FEATURES)
    kw = tt.dataloader_kwargs(num_workers=4, pin_memory=cuda)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True,
                        **kw)
    info = {"name": NAME, "torch": torch.__version__, "device": device.type,
            "num_workers": kw.get("num_workers", 0), "pin_memory": kw.get("pin_memory", False),
            "persistent_workers": kw.get("persistent_workers", False), "amp": amp.mode,
            "compile": hasattr(model, "_orig_mod"), "steps": steps,
            "warmup_steps": warmup, "batch_size": BATCH, "accumulation_steps": ACCUMULATION,
            "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}
    print("TUNERD_WORKLOAD " + json.dumps(info), flush=True)

    reporter = tt.StepReporter(batch_size=BATCH, loader=loader)
    done = 0
    t_start = 0.0
    while done < steps:
        for i, (inputs, targets) in enumerate(loader, 1):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with amp.autocast():
                outputs = model(inputs)
                loss = criterion(outputs.float(), targets) / ACCUMULATION
            amp.backward(loss)
            if i % ACCUMULATION == 0:
                amp.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            done += 1
            reporter.step()
            if done == warmup:
                t_start = time.perf_counter()
            if done >= steps:
                break
    elapsed = time.perf_counter() - t_start if warmup else None
    summary = reporter.close()
    measured = steps - warmup
    # without warm-up batches the reporter's rate: it times the batches after its first
    rate = measured * BATCH / elapsed if elapsed else summary.get("samples_per_s")
    mem = summary.get("memory") or {}
    print("memory: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()),
          file=sys.stderr)
    if not rate:
        # a rate of 0 would read as a measurement: say that nothing was timed
        print(f"tunerd.bench.workload: nothing was timed ({steps} batch(es), {warmup} "
              "warm-up): set TUNERD_BENCH_STEPS to 2 or more", file=sys.stderr)
        return 1
    print(f"TUNERD_METRIC samples_per_second {rate:.3f} higher", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
