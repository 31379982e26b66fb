"""``par4d bench offload``: training with the optimizer offloaded to CPU memory, par4d against
PyTorch FSDP2 with ``CPUOffloadPolicy`` (what a PyTorch user picks to offload optimizer
state), on the same GPT, batch and ranks, every rank on ``data``.

Rows (bf16 compute, fp32 gradient reduction, AdamW, no gradient clipping; one job, the rows
interleaved round by round so a slow spell of the shared machine hits all of them):

* ``par4d offload``: fp32 masters and AdamW state in CPU memory, stepped through the device
  in buckets of ``bsize`` (the async-pipeline paper's Section V-B), each all-reduce bucket
  stepped as it returns while the later ones are in flight (Section V-C; the ``dp`` overlap);
* ``par4d offload, dp off``: the same, the data-parallel overlap off: the sync after
  backward, the step after the whole sync (the ablation of Section V-C and of the bucket
  launches during backward);
* ``par4d bf16``: masters and AdamW state beside the model (not offloaded), the ``dp``
  overlap on: what offloading costs;
* ``torch FSDP2 CPU offload``: ``fully_shard`` per block and at the root over every rank,
  ``CPUOffloadPolicy`` and ``MixedPrecisionPolicy(bf16, reduce fp32)``. It shards parameters
  and optimizer state over the ranks (ZeRO-3), where par4d's data axis replicates them and
  all-reduces gradients, as the paper's system does: the same training, not the same
  algorithm.

Each row reports ``s_per_iter`` (median over rounds x iterations, the slowest rank's: every
iteration is timed between barriers), ``ratio_to_best_torch``, the first step's loss (all rows
start from the same weights; par4d's rows agree exactly, FSDP2 to bf16 rounding) and, for
par4d, ``device_bytes``: what its parameters and optimizer hold on the device, counted from
the tensors (``4 phi + 16 bsize`` offloaded, phi = parameters per rank). On this machine the
"device" is the CPU, so memory is the count, not a saving; a GPU shows the saving.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par4d.bench.common import check_cluster, emit, launch, where
from par4d.grid import Grid
from par4d.launch import distributed_env, init, join
from par4d.launch.host import threads_per_rank
from par4d.layout import block, shard_batch
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.optim.data_parallel import global_mean
from par4d.optim.precision import MixedPrecision
from par4d.overlap import Overlap, set_overlap
from par4d.train.recipes.gpt import build_gpt
from par4d.train.step import train_step

ROWS = ("par4d offload", "par4d offload, dp off", "par4d bf16", "torch FSDP2 CPU offload")
LR = 1e-3
LOSS_RTOL = 2e-2        # bf16's rounding of the first step's loss between frameworks


@dataclass(frozen=True)
class OffloadBench:
    world: int
    config: GPTConfig
    batch: int          # global batch, in sequences, split over data
    bsize: int          # elements per offloaded bucket
    iters: int
    rounds: int
    seed: int = 0


def _batch(bench: OffloadBench) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(bench.seed)
    tokens = torch.randint(0, bench.config.vocab_size, (bench.batch, bench.config.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _par4d(bench: OffloadBench, grid: Grid, offload: bool, dp: bool) -> tuple[Callable[[], float], float, int]:
    """(a training step, the first step's loss, the device bytes of parameters, gradients and
    optimizer at their peak: after the first backward)."""
    model = set_overlap(build_gpt(bench.config, grid), Overlap(data_parallel=dp))
    precision = MixedPrecision(model, grid, torch.bfloat16, lambda params: torch.optim.AdamW(params, lr=LR),
                               offload_bsize=bench.bsize if offload else None)
    inputs, targets = _batch(bench)
    x, y = shard_batch(grid, inputs), shard_batch(grid, targets)

    def step(after_backward=None) -> torch.Tensor:
        return train_step(model, precision, grid, (x, y), after_backward=after_backward)

    held: list[int] = []
    first = float(global_mean(step(), grid))
    # The device bytes after backward of the second step (AdamW's state exists; the gradients are made, the
    # step not yet: not offloaded, the masters' fp32 gradients, 4 phi more, appear in the step).
    step(lambda _: held.append(precision.device_bytes()))
    return (lambda: float(step())), first, held[0]


def _fsdp(bench: OffloadBench) -> Callable[[], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (bench.world,))
    model = ReferenceGPT(bench.config)
    policy = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for layer in model.blocks:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    inputs, targets = _batch(bench)
    rows = block(bench.batch, bench.world, dist.get_rank())
    x, y = inputs[rows], targets[rows]

    def step() -> float:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)                      # the batch's mean loss, as par4d's rows report
        return t.item() / bench.world
    return step


def offload_worker(bench: OffloadBench) -> list[dict]:
    join(distributed_env())    # the emulated cluster starts bare ranks; under torchrun this joins its job
    torch.set_num_threads(threads_per_rank(bench.world))
    grid = init(data=bench.world)
    steps: dict[str, Callable[[], float]] = {}
    first: dict[str, float] = {}
    device: dict[str, int] = {}
    for name, offload, dp in ((ROWS[0], True, True), (ROWS[1], True, False), (ROWS[2], False, True)):
        steps[name], first[name], device[name] = _par4d(bench, grid, offload, dp)
    steps[ROWS[3]] = _fsdp(bench)
    first[ROWS[3]] = steps[ROWS[3]]()          # every row's first step from the same weights
    steps[ROWS[3]]()                           # and a second, untimed, as par4d's rows
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(bench.rounds):
        for name, step in steps.items():
            for _ in range(bench.iters):
                dist.barrier()
                began = time.perf_counter()
                step()
                dist.barrier()
                times[name].append(time.perf_counter() - began)
    phi = sum(p.numel() for p in build_gpt(bench.config, grid).parameters())
    rows = []
    for name in steps:
        rows.append({"framework": "torch" if name.startswith("torch") else "par4d", "name": name,
                     "s_per_iter": statistics.median(times[name]), "iters": len(times[name]),
                     "loss_first_step": first[name],
                     "loss_rel_diff_to_par4d": abs(first[name] - first[ROWS[0]]) / abs(first[ROWS[0]]),
                     "device_bytes": device.get(name), "params_per_rank": phi, "bsize": bench.bsize,
                     "grid": f"data={bench.world}"})
    best = min(r["s_per_iter"] for r in rows if r["framework"] == "torch")
    for row in rows:
        row["ratio_to_best_torch"] = row["s_per_iter"] / best
    grid.close()
    worst = max(r["loss_rel_diff_to_par4d"] for r in rows)
    if worst > LOSS_RTOL:
        raise RuntimeError(f"first-step losses disagree: {first} (relative {worst:.1e} > {LOSS_RTOL})")
    return rows


def launched_worker(bench: OffloadBench) -> list[dict]:
    rows = offload_worker(bench)
    dist.destroy_process_group()
    return rows


def settings(args: argparse.Namespace) -> OffloadBench:
    """The benchmark's settings from the CLI's arguments; bad ones raise before any rank starts."""
    if args.nproc < 1 or (args.nodes is not None and args.nodes < 1):
        raise ValueError(f"--nproc and --nodes must be >= 1 (got {args.nproc}, {args.nodes})")
    world = args.nproc * (args.nodes or 1)
    if world < 2:
        raise ValueError(f"bench offload needs at least 2 ranks (a data-parallel all-reduce); got {world}")
    if args.iters < 1 or args.rounds < 1:
        raise ValueError(f"--iters and --rounds must be >= 1 (got {args.iters}, {args.rounds})")
    if args.bsize < 1:
        raise ValueError(f"--bsize {args.bsize}: give a bucket of at least 1 element")
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by the {world} ranks (data={world})")
    config = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd,
                       n_head=args.n_head)
    GPT(config, grid=Grid.virtual({"data": world}))          # shape errors before any rank starts
    return OffloadBench(world, config, args.batch_size, args.bsize, args.iters, args.rounds)


def markdown(rows: list[dict]) -> str:
    lines = ["| row | s/iter (median) | x best torch | device bytes (params + optimizer) | first loss |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        held = "-" if r["device_bytes"] is None else f"{r['device_bytes']:,}"
        lines.append(f"| {r['name']} | {r['s_per_iter']:.3f} | {r['ratio_to_best_torch']:.2f}x | {held} | "
                     f"{r['loss_first_step']:.6f} |")
    return "\n".join(lines)


def run_bench_offload(args: argparse.Namespace) -> int:
    bench = settings(args)
    check_cluster(args.nproc, args.nodes, args.link)
    rows = launch(launched_worker, (bench,), args.nproc, args.nodes, args.link, "par4d-bench-offload")
    config, ranks = bench.config, where(args.nproc, args.nodes, args.link)
    for row in rows:
        row.update(workload=f"GPT {config.n_layer}x{config.n_embd}, batch {bench.batch}x{config.block_size}",
                   where=ranks)
    if not emit(rows, args.out, args.json):
        phi = rows[0]["params_per_rank"]
        print(f"GPT {config.n_layer} blocks x {config.n_embd} wide ({config.num_params():,} params), global batch "
              f"{bench.batch} x {config.block_size} tokens, data={bench.world}, {ranks}, bf16, buckets of "
              f"{bench.bsize:,} elements; median of {args.iters} x {args.rounds} rounds; 4 phi + 16 bsize = "
              f"{4 * phi + 16 * bench.bsize:,} bytes")
        print(markdown(rows))
        sys.stdout.flush()
    return 0


__all__ = ["ROWS", "OffloadBench", "markdown", "offload_worker", "run_bench_offload", "settings"]
