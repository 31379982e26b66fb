"""``par4d bench grid``: the GPT on every valid grid, and PyTorch DDP / FSDP2 on its twin.

Every row trains the same model on the same global batch on the same ranks, one
row after another in one job, so the timings compare side by side. Per row: median
seconds per iteration (forward, backward, gradient sync, AdamW), tokens/s, model
FLOP/s as % of the matmul peak measured at start-up, and bytes communicated per
iteration: the sum over ranks of the per-rank message of every collective (par4d's
ledger unit). par4d and FSDP2 bytes are recorded as issued (ledger; a dispatch hook
on c10d ops for FSDP2); DDP's reducer calls collectives below Python, so its bytes
are its gradient bytes, which DDP all-reduces exactly once per iteration.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par4d.bench.common import emit, grid_row, sum_over_ranks
from par4d.bench.torch_peers import C10dBytes
from par4d.launch import launch_local
from par4d.launch.host import cpu_cores, threads_per_rank
from par4d.launch.peak import measure_matmul_peak
from par4d.layout import block
from par4d.measure.grids import BATCH, CONFIG, WARMUP, batch, grids, held_most, measure_grid, time_iterations
from par4d.models import ReferenceGPT


@dataclass(frozen=True)
class BenchSettings:
    nproc: int
    iters: int
    peak_flops: float
    warmup: int = WARMUP          # untimed steps before each row's (a test's rows need none)
    batch: int = BATCH            # sequences in the global batch (the demo's; a test's rows take fewer)


def _bench_par4d(sizes: dict[str, int], settings: BenchSettings) -> dict:
    times, per_rank, held = measure_grid(sizes, settings.iters, settings.batch, then=held_most,
                                         warmup=settings.warmup)
    row = grid_row("par4d", sizes, times, sum_over_ranks(per_rank), settings.peak_flops, "ledger", settings.batch)
    # What a step holds (par4d.train.footprint), the most of any rank. The peers' rows leave it out: their
    # buffers (DDP's reducer buckets, FSDP2's unsharded parameters) are outside what the footprint sees.
    return dict(row, held_bytes_per_rank=held["total"], held=held)


def _bench_torch(kind: str, settings: BenchSettings) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    sizes = {"data": world} if kind == "ddp" else {"z": world}
    twin = ReferenceGPT(CONFIG)
    if kind == "ddp":
        model = DistributedDataParallel(copy.deepcopy(twin))
    else:
        model = copy.deepcopy(twin)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.blocks:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = batch(settings.batch)
    rows = block(settings.batch, world, dist.get_rank())       # as par4d's data (or z) shards: rank r, r-th block
    x, y = inputs[rows], targets[rows]

    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_iterations(step, settings.iters, settings.warmup)
    if kind == "ddp":
        per_rank, source = sum(p.numel() * p.element_size() for p in twin.parameters()), "gradient bytes"
        name = "torch DDP"
    else:
        counter = C10dBytes()   # one more, untimed iteration: the dispatch hook costs time
        with counter:
            step()
        per_rank, source = counter.bytes, "c10d dispatch"
        name = "torch FSDP2"
    return dict(grid_row(name, sizes, times, sum_over_ranks(per_rank), settings.peak_flops, source, settings.batch),
                held_bytes_per_rank=None)


def bench_rows(settings: BenchSettings) -> list[dict]:
    """Every par4d grid of the job's ranks, then torch's DDP and FSDP2, on this rank's job."""
    torch.set_num_threads(threads_per_rank(settings.nproc))
    rows = [_bench_par4d(sizes, settings) for sizes in grids(settings.nproc, batch=settings.batch)]
    rows.append(_bench_torch("ddp", settings))
    rows.append(_bench_torch("fsdp", settings))
    for row in rows:
        row["matmul_peak_gflops"] = settings.peak_flops / 1e9
    return rows


def bench_worker(settings: BenchSettings) -> list[dict]:
    rows = bench_rows(settings)
    dist.destroy_process_group()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| name | grid (x y z data) | s/iter (median) | tokens/s | % of peak | MB/iter | bytes from |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['grid']} | {r['s_per_iter']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['percent_of_peak']:.1f} | {r['bytes_per_iter'] / 1e6:.2f} | {r['bytes_source']} |")
    return "\n".join(lines)


def run_bench_grid(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.iters < 1:
        raise ValueError(f"--nproc and --iters must be >= 1 (got {args.nproc}, {args.iters})")
    if not grids(args.nproc):
        raise ValueError(f"no grid of {args.nproc} ranks divides the benchmark model {CONFIG}")
    # The peak is measured before the ranks exist, so nothing competes for the cores.
    settings = BenchSettings(args.nproc, args.iters, measure_matmul_peak(threads=cpu_cores()))
    rows = launch_local(args.nproc, bench_worker, (settings,), run_id="par4d-bench")[0]
    if not emit(rows, args.out, args.json):
        print(f"GPT {CONFIG.n_layer} layers x {CONFIG.n_embd} wide, {CONFIG.num_params():,} params, "
              f"global batch {BATCH} x {CONFIG.block_size} tokens, {args.nproc} ranks, "
              f"median of {args.iters} iterations; matmul peak {rows[0]['matmul_peak_gflops']:.0f} GFLOP/s fp32")
        print(markdown(rows))
    sys.stdout.flush()
    return 0


__all__ = ["markdown", "run_bench_grid"]
