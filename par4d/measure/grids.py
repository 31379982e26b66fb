"""Measuring par4d's training step on real grids: the workload the planner is checked on.

``plan validate``, the planner's profiler and ``par4d bench grid`` all measure this
one GPT and batch (``CONFIG``, ``BATCH``), with the one training step
(:func:`par4d.train.step.train_step`) on every grid of a world size that divides them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from par4d.compiled import compile_afresh
from par4d.grid import Grid
from par4d.launch import init
from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig
from par4d.optim.precision import FullPrecision
from par4d.overlap import Overlap
from par4d.plan.cost import factorizations
from par4d.plan.workload import MEASURED
from par4d.train.step import train_step

CONFIG, BATCH = MEASURED.config, MEASURED.global_batch
WARMUP = 2


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


def choices(world: int) -> list[dict]:
    """What ``plan validate`` measures on ``world`` ranks: every (x, y, z, data) grid of :func:`grids` at one
    microbatch without recomputation (the grids the paper's models rank); then choices the full model makes
    beyond them: a pipeline of 2 and of 4 stages (up to the model's blocks) over data, at P and 2P microbatches;
    and on the pure data and pure z grids, two microbatches, and recomputation."""
    out = [{"sizes": sizes, "microbatches": 1, "recompute": False} for sizes in grids(world)]
    one = dict(x=1, y=1, z=1, data=1)
    for pipe in (2, 4):
        if world % pipe or pipe > CONFIG.n_layer:
            continue
        data = world // pipe
        for micro in (pipe, 2 * pipe):
            if BATCH % data == 0 and micro <= BATCH // data:
                out.append({"sizes": dict(one, data=data, pipe=pipe), "microbatches": micro, "recompute": False})
    for axis in ("data", "z"):
        sizes = dict(one, **{axis: world})
        if sizes in grids(world):
            out += [{"sizes": sizes, "microbatches": 2, "recompute": False},
                    {"sizes": sizes, "microbatches": 1, "recompute": True}]
    return out


def batch(size: int = BATCH, seq_len: int = CONFIG.block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (inputs, targets) every measurement trains on: ``size`` sequences of ``seq_len`` seeded tokens."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


class TrainingStep:
    """One training step of the GPT on ``grid`` (forward, backward, gradient sync, AdamW) on a global batch of
    ``batch_size`` sequences of ``seq_len`` tokens, to call repeatedly; ``overlap``: the GPT's (None: every
    overlap on; with a pipeline, those that act there), ``microbatches`` per step (None: the default),
    ``recompute``: every block recomputed in backward; ``compile``: a backend compiling each block
    (par4d.compiled), or none. Its ``model`` and ``optimizer`` are there to look at."""

    def __init__(self, grid: Grid, batch_size: int = BATCH, seq_len: int = CONFIG.block_size,
                 overlap: Overlap | None = None, microbatches: int | None = None, recompute: bool = False,
                 compile: str = "none"):
        if grid.size("pipe") > 1:
            overlap = (overlap or Overlap()).in_pipeline()
        self.model = GPT(CONFIG, grid=grid, overlap=overlap, recompute=1 if recompute else 0)
        compile_afresh(self.model, compile)
        self.compile_seconds: float | None = None     # the compiling step's beyond a timed one's (measure_grid)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.precision = FullPrecision(self.model, grid, self.optimizer)
        self.grid, self.microbatches = grid, microbatches
        inputs, targets = batch(batch_size, seq_len)
        self.x, self.y = shard_batch(grid, inputs), shard_batch(grid, targets)

    def __call__(self) -> torch.Tensor:
        return train_step(self.model, self.precision, self.grid, (self.x, self.y), microbatches=self.microbatches)


def training_step(grid: Grid, batch_size: int = BATCH, seq_len: int = CONFIG.block_size,
                  overlap: Overlap | None = None) -> Callable[[], torch.Tensor]:
    """:class:`TrainingStep` with the default microbatches and no recomputation."""
    return TrainingStep(grid, batch_size, seq_len, overlap)


def held_most(grid: Grid, step: TrainingStep) -> dict:
    """What one more call of ``step`` holds (par4d.train.footprint's row), each term the most any rank held
    (collective: every rank of ``grid`` calls it)."""
    from par4d.train.footprint import measure_footprint

    row = measure_footprint(step.model, step.precision, step).row()
    keys = [k for k, v in row.items() if isinstance(v, int)]
    most = torch.tensor([float(row[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(keys, most.tolist())}


def step_collectives(grid: Grid, step: Callable[[], object]) -> list[tuple[str, tuple[str, ...], int]]:
    """(kind, axes, elements) of every collective one call of ``step`` issues on ``grid``."""
    with grid.ledger.capture() as entries:
        step()
    return [(e.kind, e.axes, e.elements) for e in entries]


def compile_seconds(first: float | None, times: list[float]) -> float | None:
    """What compiling cost: the compiling step's seconds (``first``, a compiled model's first step, timed apart)
    beyond the timed steps' median; None where nothing was compiled."""
    return None if first is None else first - statistics.median(times)


def time_iterations(step: Callable[[], object], iters: int, warmup: int = WARMUP) -> list[float]:
    """Seconds of ``iters`` calls of ``step`` after ``warmup`` untimed ones, each between barriers."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def measure_grid(sizes: dict[str, int], iters: int, batch_size: int = BATCH, seq_len: int = CONFIG.block_size,
                 overlap: Overlap | None = None, hierarchical: str = "auto",
                 then: Callable[[Grid, TrainingStep], object] | None = None, microbatches: int | None = None,
                 recompute: bool = False, warmup: int = WARMUP, compile: str = "none"
                 ) -> tuple[list[float], float, object]:
    """Seconds of ``iters`` training steps on grid ``sizes`` (global batch of ``batch_size`` sequences of
    ``seq_len`` tokens) and the ledger bytes per step of this rank, on a grid built with ``hierarchical``, and
    what ``then(grid, step)`` returns after the timing (None without it: a benchmark's own look at the grid).
    ``compile``: each block compiled by this backend, the first step (compiling) timed apart, before the
    warm-up: ``step.compile_seconds``, its seconds beyond the timed steps' median.
    Closes the grid: idle groups of earlier grids would slow the grids measured after them."""
    grid = init(**sizes, hierarchical=hierarchical)
    # overlap None: par4d.Overlap(), every overlap on
    step = TrainingStep(grid, batch_size, seq_len, overlap, microbatches, recompute, compile)
    before = grid.ledger.total_bytes()
    compiling = time_iterations(step, 1, 0)[0] if compile != "none" else None   # apart from the timed ones
    times = time_iterations(step, iters, warmup)
    step.compile_seconds = compile_seconds(compiling, times)
    per_rank = (grid.ledger.total_bytes() - before) / (warmup + iters + (compile != "none"))
    extra = then(grid, step) if then is not None else None
    grid.close()
    return times, per_rank, extra
