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
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import par4d
from par4d.data_parallel import sync_gradients
from par4d.grid import Grid
from par4d.launch import launch_local
from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.perf import cpu_cores, measure_matmul_peak, threads_per_rank
from par4d.plan.model import factorizations

CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
BATCH = 32
WARMUP = 2


@dataclass(frozen=True)
class BenchSettings:
    nproc: int
    iters: int
    peak_flops: float | None = None   # for % of peak in the rows; plan validate needs times only


def grids(world: int, config: GPTConfig = CONFIG, batch: int = BATCH) -> list[dict[str, int]]:
    """Every (x, y, z, data) shape of ``world`` ranks on which the model and batch divide."""
    shapes = []
    for sizes in factorizations(world):
        try:
            GPT(config, grid=Grid.virtual(sizes))
        except ValueError:
            continue
        if batch % (sizes["z"] * sizes["data"]) == 0:
            shapes.append(sizes)
    return shapes


class _C10dBytes(TorchDispatchMode):
    """Counts the per-rank input bytes of c10d collectives issued through the dispatcher."""

    OPS = ("allgather", "reduce_scatter", "allreduce", "_allgather_base", "_reduce_scatter_base")

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and any(name.startswith(op) for op in self.OPS):
            inputs = args[1] if name.startswith(("allgather", "reduce_scatter", "_allgather", "_reduce")) else args[0]
            for t in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
                for leaf in t if isinstance(t, (list, tuple)) else [t]:
                    if isinstance(leaf, torch.Tensor):
                        self.bytes += leaf.numel() * leaf.element_size()
        return func(*args, **(kwargs or {}))


def _time_iterations(step, iters: int) -> list[float]:
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def _row(name: str, sizes: dict[str, int], times: list[float], bytes_per_iter: float, peak: float,
         bytes_source: str) -> dict:
    s = statistics.median(times)
    tokens = BATCH * CONFIG.block_size / s
    flops = CONFIG.flops_per_token() * tokens
    return {"name": name, "grid": " ".join(f"{a}={sizes.get(a, 1)}" for a in ("x", "y", "z", "data")),
            "s_per_iter": s, "tokens_per_s": tokens, "percent_of_peak": 100 * flops / peak,
            "bytes_per_iter": int(bytes_per_iter), "bytes_source": bytes_source, "iters": len(times)}


def _batches():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def training_step(grid: Grid):
    """One iteration of the bench GPT on ``grid``: forward, backward, gradient sync, AdamW."""
    model = GPT(CONFIG, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _batches()
    x, y = shard_batch(grid, inputs), shard_batch(grid, targets)

    def step():
        loss = model(x, y)
        loss.backward()
        sync_gradients(model, grid)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def step_collectives(grid: Grid, step) -> list[tuple[str, tuple[str, ...], int]]:
    """(kind, axes, elements) of every collective one call of ``step`` issues on ``grid``."""
    with grid.ledger.capture() as entries:
        step()
    return [(e.kind, e.axes, e.elements) for e in entries]


def time_par4d(sizes: dict[str, int], iters: int) -> tuple[list[float], float]:
    """Seconds of ``iters`` training steps of the bench GPT on grid ``sizes``, and the
    ledger bytes per step of this rank. Closes the grid: idle groups of earlier grids
    would slow the grids measured after them."""
    grid = par4d.init(**sizes)
    step = training_step(grid)
    before = grid.ledger.total_bytes()
    times = _time_iterations(step, iters)
    per_rank = (grid.ledger.total_bytes() - before) / (WARMUP + iters)
    grid.close()
    return times, per_rank


def _bench_par4d(sizes: dict[str, int], settings: BenchSettings) -> dict:
    times, per_rank = time_par4d(sizes, settings.iters)
    return _row("par4d", sizes, times, _sum_over_ranks(per_rank), settings.peak_flops, "ledger")


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
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _batches()
    rows = slice(dist.get_rank() * BATCH // world, (dist.get_rank() + 1) * BATCH // world)
    x, y = inputs[rows], targets[rows]

    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = _time_iterations(step, settings.iters)
    if kind == "ddp":
        per_rank, source = sum(p.numel() * p.element_size() for p in twin.parameters()), "gradient bytes"
        name = "torch DDP"
    else:
        counter = _C10dBytes()   # one more, untimed iteration: the dispatch hook costs time
        with counter:
            step()
        per_rank, source = counter.bytes, "c10d dispatch"
        name = "torch FSDP2"
    return _row(name, sizes, times, _sum_over_ranks(per_rank), settings.peak_flops, source)


def bench_worker(settings: BenchSettings) -> list[dict]:
    torch.set_num_threads(threads_per_rank(settings.nproc))
    rows = [_bench_par4d(sizes, settings) for sizes in grids(settings.nproc)]
    rows.append(_bench_torch("ddp", settings))
    rows.append(_bench_torch("fsdp", settings))
    for row in rows:
        row["matmul_peak_gflops"] = settings.peak_flops / 1e9
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
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"GPT {CONFIG.n_layer} layers x {CONFIG.n_embd} wide, {CONFIG.num_params():,} params, "
              f"global batch {BATCH} x {CONFIG.block_size} tokens, {args.nproc} ranks, "
              f"median of {args.iters} iterations; matmul peak {rows[0]['matmul_peak_gflops']:.0f} GFLOP/s fp32")
        print(markdown(rows))
    sys.stdout.flush()
    return 0


__all__ = ["grids", "markdown", "run_bench_grid", "training_step"]
