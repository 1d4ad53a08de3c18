"""A small built-in training workload for `tunerctl bench` (no command given).

With torch installed it trains a small MLP on synthetic data through a DataLoader
with worker processes (the part that CPU placement affects); without torch it runs
the same shape of work in pure Python threads. It prints
``TUNERD_METRIC samples_per_second <value> higher``.
"""

from __future__ import annotations

import os
import time


def _torch_workload(steps: int) -> float:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    n, dim = 4096, 256
    ds = TensorDataset(torch.randn(n, dim), torch.randint(0, 10, (n,)))
    workers = min(2, len(os.sched_getaffinity(0)))
    dl = DataLoader(ds, batch_size=128, shuffle=True, num_workers=workers,
                    persistent_workers=workers > 0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    seen, done = 0, 0
    t0 = time.perf_counter()
    while done < steps:
        for x, y in dl:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            seen += len(x)
            done += 1
            if done >= steps:
                break
    return seen / (time.perf_counter() - t0)


def _python_workload(steps: int) -> float:
    import threading

    batch = 256
    t0 = time.perf_counter()

    def work() -> None:
        acc = 0
        for i in range(steps * batch // 4):
            acc += (i * i) % 7

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return steps * batch / (time.perf_counter() - t0)


def main() -> None:
    steps = int(os.environ.get("TUNERD_BENCH_STEPS", "60"))
    try:
        import torch  # noqa: F401

        rate = _torch_workload(steps)
    except ImportError:
        rate = _python_workload(steps)
    print(f"TUNERD_METRIC samples_per_second {rate:.3f} higher", flush=True)


if __name__ == "__main__":
    main()
