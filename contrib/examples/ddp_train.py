"""DDP training on CPU with gloo: the guide's model, one DataLoader worker per rank.

    torchrun --nproc-per-node 2 contrib/examples/ddp_train.py --steps 60

Every rank trains nn.Linear(1024, 1024) with MSE and Adam on its shard of 8192
synthetic samples (DistributedSampler), batch 64, through a DataLoader with
``--workers`` (1) worker process. Rank 0 prints the job's throughput over the steps
after the first ``--warmup`` (5) as ``TUNERD_METRIC samples_per_second``, which
``tunerctl bench`` and bench/ddp_binding.py read.

Under tunerd, the bundled ``torch-training`` rule (``*train*.py*`` with LOCAL_RANK
set) binds each rank as it execs; ``--helpers`` also uses tunerd.torch
(``dataloader_kwargs`` pins the worker to its own CPU of the rank's set, and
``StepReporter`` reports step times to the daemon). ``--hold-dir DIR`` is for tests:
after the first batch each rank writes ``DIR/rank<R>.json`` (its pid, its workers'
pids) and waits until ``DIR/release`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="batches per rank")
    p.add_argument("--warmup", type=int, default=5, help="batches left out of the rate")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--helpers", action="store_true", help="use tunerd.torch")
    p.add_argument("--hold-dir", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def hold(directory: Path, rank: int, workers: list[int]) -> None:
    """Tests: say who we are, then wait for the test to look at /proc."""
    tmp = directory / f".rank{rank}.json"
    tmp.write_text(json.dumps({"pid": os.getpid(), "workers": workers}))
    tmp.rename(directory / f"rank{rank}.json")
    deadline = time.monotonic() + 120
    while not (directory / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> int:
    args = parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(1024, 1024))
    criterion = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(8192, 1024), torch.randn(8192, 1024))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    if args.helpers:
        import tunerd.torch as tt

        kw = tt.dataloader_kwargs(num_workers=args.workers, cuda=False)
        reporter = tt.StepReporter(batch_size=args.batch)
    else:
        kw = {"num_workers": args.workers, "persistent_workers": args.workers > 0}
        reporter = None
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True, **kw)

    done, epoch, t0 = 0, 0, time.perf_counter()
    while done < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = criterion(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            done += 1
            if reporter is not None:
                reporter.step()
            if done == 1 and args.hold_dir is not None:
                from tunerd.torch import dataloader_workers

                hold(args.hold_dir, rank, dataloader_workers())
            if done == args.warmup:
                t0 = time.perf_counter()
            if done >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    if reporter is not None:
        reporter.close()
    measured = args.steps - min(args.warmup, args.steps)
    if rank == 0 and measured > 0:
        rate = world * args.batch * measured / elapsed
        print(f"TUNERD_METRIC samples_per_second {rate:.3f} higher", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
