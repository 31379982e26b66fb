"""Where a rank's CPU goes in par4d's data=4 step and in DDP's, phase by phase (docs/benchmarks.md, "data=4
against DDP"): par4d's GPT and its single-device twin wrapped in DDP, on the same ranks and rows, stepped in
turns; the CPU of the forward, backward (DDP's sync runs inside it), par4d's sync finishing, and AdamW with the
zeroing: rank 0's medians (``time.process_time``: every thread of the process, gloo's included), then every
rank's summed, the rank's own thread (``time.thread_time``) apart from gloo's; each step's wall time (between
barriers) and their ratio step by step.

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


def _now() -> tuple[float, float]:
    """CPU seconds so far: the process's (every thread: gloo's too) and this thread's."""
    return time.process_time(), time.thread_time()


def _step_optimizer(optimizer: torch.optim.Optimizer, clock: list) -> list[tuple[float, float]]:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return clock + [_now()]


def _par4d_step(step: TrainingStep):
    grid, model, optimizer = step.grid, step.model, step.optimizer

    def run() -> list[tuple[float, float]]:
        clock = [_now()]
        sync = gradient_sync(model, grid)
        loss = model(step.x, step.y)
        clock.append(_now())
        with sync.backward():
            loss.backward()
        clock.append(_now())
        sync.finish()
        clock.append(_now())
        return _step_optimizer(optimizer, clock)

    return run


def _ddp_step(x: torch.Tensor, y: torch.Tensor):
    model = DistributedDataParallel(ReferenceGPT(CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run() -> list[tuple[float, float]]:
        clock = [_now()]
        loss = model(x, y)
        clock.append(_now())
        loss.backward()                     # DDP's all-reduces launched and waited for in here
        clock += [_now()] * 2               # (no sync of its own to finish)
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
    # per step and phase: (CPU of every thread, of the rank's own thread)
    seconds: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in steps}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(WARMUP + args.steps):
        for name in (list(steps) if i % 2 else list(steps)[::-1]):      # in turns, each first every other step
            dist.barrier()
            start = time.perf_counter()
            clock = steps[name]()
            dist.barrier()
            if i >= WARMUP:
                seconds[name].append([(b[0] - a[0], b[1] - a[1]) for a, b in zip(clock, clock[1:])])
                walls[name].append(time.perf_counter() - start)
    # Every rank's CPU summed, phase by phase: on 2 shared cores the step's time follows it.
    phases = len(PHASES)
    means = torch.tensor([[sum(r[k][j] for r in rows_) / args.steps for j in (0, 1) for k in range(phases)]
                          for rows_ in seconds.values()], dtype=torch.float64)
    dist.all_reduce(means)
    if grid.rank == 0:
        print(f"rank 0's CPU ms per step, median of {args.steps} ({args.workload}):", " ".join(PHASES))
        for name, rows_ in seconds.items():
            medians = [1e3 * statistics.median(r[k][0] for r in rows_) for k in range(phases)]
            print(f"{name:<10}", " ".join(f"{m:8.2f}" for m in medians), f"  sum {sum(medians):.2f}",
                  f"  wall {1e3 * statistics.median(walls[name]):.2f}")
        print("every rank's CPU ms per step, summed (mean):", " ".join(PHASES))
        for name, row in zip(seconds, means.tolist()):
            every, own = row[:phases], row[phases:]
            for label, values in (("all threads", every), ("rank's own", own),
                                  ("gloo's", [a - b for a, b in zip(every, own)])):
                print(f"{name:<10} {label:<11}", " ".join(f"{1e3 * v:8.2f}" for v in values),
                      f"  sum {1e3 * sum(values):.2f}")
        par4d, ddp = (sum(row[:phases]) for row in means.tolist())
        print(f"CPU of all ranks, ms per step: par4d {1e3 * par4d:.2f}, DDP {1e3 * ddp:.2f} ({par4d / ddp:.4f}x)")
        pairs = sorted(a / b for a, b in zip(*walls.values()))
        print(f"par4d / DDP wall, step by step: median {statistics.median(pairs):.4f}, "
              f"quartiles {pairs[len(pairs) // 4]:.4f}-{pairs[3 * len(pairs) // 4]:.4f}")
    grid.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
