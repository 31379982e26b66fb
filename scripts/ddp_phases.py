"""Where a rank's CPU goes in par4d's data=4 step and in DDP's, phase by phase (docs/benchmarks.md, "data=4
against DDP"): par4d's GPT and its single-device twin wrapped in DDP, on the same ranks and rows, stepped in
turns; rank 0's ``time.process_time`` (every thread of the process, gloo's included) of the forward, backward
(DDP's sync runs inside it), par4d's sync finishing, and AdamW with the zeroing; medians over the steps; every
rank's CPU summed; each step's wall time (between barriers) and their ratio step by step.

Stepped in turns, the two share one process's allocator: what one keeps allocated the other's freed memory lands
on, so a step that alone would fault its pages in again each time (par4d's sync before its buffers were kept) shows
none here. Count page faults of each alone too (docs/benchmarks.md).

    .venv/bin/torchrun --nproc-per-node 4 scripts/ddp_phases.py [--workload demo|comm-bound] [--steps 110]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from par4d.launch import init
from par4d.layout import block
from par4d.measure.grids import BATCH, CONFIG, TrainingStep, batch
from par4d.models import ReferenceGPT
from par4d.optim.data_parallel import gradient_sync

PHASES = ("forward", "backward", "sync", "optimizer")
WARMUP = 10


def _step_optimizer(optimizer: torch.optim.Optimizer, clock: list[float]) -> list[float]:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return clock + [time.process_time()]


def _par4d_step(step: TrainingStep):
    grid, model, optimizer = step.grid, step.model, step.optimizer

    def run() -> list[float]:
        clock = [time.process_time()]
        sync = gradient_sync(model, grid)
        loss = model(step.x, step.y)
        clock.append(time.process_time())
        with sync.backward():
            loss.backward()
        clock.append(time.process_time())
        sync.finish()
        clock.append(time.process_time())
        return _step_optimizer(optimizer, clock)

    return run


def _ddp_step(x: torch.Tensor, y: torch.Tensor):
    model = DistributedDataParallel(ReferenceGPT(CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run() -> list[float]:
        clock = [time.process_time()]
        loss = model(x, y)
        clock.append(time.process_time())
        loss.backward()                     # DDP's all-reduces launched and waited for in here
        clock += [time.process_time()] * 2  # (no sync of its own to finish)
        return _step_optimizer(optimizer, clock)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("demo", "comm-bound"), default="comm-bound")
    parser.add_argument("--steps", type=int, default=110)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sequences, seq_len = (BATCH, CONFIG.block_size) if args.workload == "demo" else (4, 32)
    grid = init(data=4)
    inputs, targets = batch(sequences, seq_len)
    rows = block(sequences, grid.world_size, grid.rank)
    steps = {"par4d": _par4d_step(TrainingStep(grid, sequences, seq_len)),
             "torch DDP": _ddp_step(inputs[rows], targets[rows])}
    seconds: dict[str, list[list[float]]] = {name: [] for name in steps}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(WARMUP + args.steps):
        for name in (list(steps) if i % 2 else list(steps)[::-1]):      # in turns, each first every other step
            dist.barrier()
            start = time.perf_counter()
            clock = steps[name]()
            dist.barrier()
            if i >= WARMUP:
                seconds[name].append([b - a for a, b in zip(clock, clock[1:])])
                walls[name].append(time.perf_counter() - start)
    # Every rank's CPU (gloo's threads included) summed: on 2 shared cores the step's time follows it.
    total = torch.tensor([sum(sum(r) for r in rows_) for rows_ in seconds.values()], dtype=torch.float64)
    dist.all_reduce(total)
    if grid.rank == 0:
        print(f"rank 0's CPU ms per step, median of {args.steps} ({args.workload}):", " ".join(PHASES))
        for name, rows_ in seconds.items():
            medians = [1e3 * statistics.median(r[k] for r in rows_) for k in range(len(PHASES))]
            print(f"{name:<10}", " ".join(f"{m:8.2f}" for m in medians), f"  sum {sum(medians):.2f}",
                  f"  wall {1e3 * statistics.median(walls[name]):.2f}")
        par4d, ddp = total.tolist()
        print(f"CPU of all ranks, ms per step: par4d {1e3 * par4d / args.steps:.2f}, DDP {1e3 * ddp / args.steps:.2f} "
              f"({par4d / ddp:.4f}x)")
        pairs = sorted(a / b for a, b in zip(*walls.values()))
        print(f"par4d / DDP wall, step by step: median {statistics.median(pairs):.4f}, "
              f"quartiles {pairs[len(pairs) // 4]:.4f}-{pairs[3 * len(pairs) // 4]:.4f}")
    grid.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
