"""Profiled compute: what one rank computes on each grid, timed on this machine.

torch's fake process group lets one process stand in for rank 0 of a job of any
size: its collectives return at once and move nothing. A training step timed there
is this rank's computation alone on grid (x, y, z, data): its own matmul shapes
(skinny ones run far below peak), the element-wise work replicated over x or y, the
optimizer on its shards. FLOPs over peak sees none of that: on 4 CPU ranks the
compute of ``x=4`` is 2.0x that of ``data=4`` here, with the same FLOPs per rank.

Runs in a fresh spawned process, so the caller's torch.distributed state is untouched.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


def as_choice(item: dict) -> dict:
    """A grid's sizes, or a choice (``sizes`` with ``microbatches`` and ``recompute``), as a choice."""
    return item if "sizes" in item else {"sizes": item}


def profile_compute(shapes: list[dict], threads: int, iters: int = 5) -> list[dict]:
    """Per grid in ``shapes`` (sizes, or choices as :func:`as_choice` reads them): ``seconds``, the median time
    of one training step of the bench GPT as rank 0 without communication, with ``threads`` torch threads (a
    pipeline's: its first stage's, which waits for nothing); and ``collectives``, the (kind, axes, elements) of
    every collective rank 0 issues in one step (its ledger, as in a real job)."""
    return _in_a_fresh_process("profile_compute", shapes, threads, _timed, iters)


def profile_memory(choices: list[dict], threads: int = 1) -> list[dict]:
    """Per choice (``sizes`` with pipe, ``microbatches``, ``recompute``): what rank 0 holds in one training step
    of the bench GPT (:class:`par4d.train.footprint.Footprint`'s row), measured without communication. Rank 0
    is the first pipeline stage, which holds the most microbatches at once."""
    return _in_a_fresh_process("profile_memory", choices, threads, _held)


def profile_layer_overhead(threads: int, repeats: int = 21) -> dict:
    """What a training step costs the host per microbatch at a negligible compute, with ``threads`` torch threads on
    the CPU: the bench GPT on one rank, on a batch of ``batch`` sequences of ``seq_len`` = 2 tokens, stepped with 1
    and with 4 microbatches in turn ``repeats`` times; ``microbatch_seconds``: what the median step gains per
    microbatch; ``layer_passes``: a microbatch's (3 per layer: its forward GEMM and two backward ones).
    calibrate takes the modelled GEMMs out of it (:func:`par4d.measure.calibrate.layer_overhead`)."""
    return _spawned(_overhead, threads, repeats)


def _in_a_fresh_process(name: str, items: list[dict], threads: int, measure, *args) -> list[dict]:
    """:func:`_as_rank0` in a spawned process (the caller's torch.distributed state untouched), the choices
    (:func:`as_choice`) all of one world size."""
    if not items:
        return []
    choices = [as_choice(item) for item in items]
    worlds = {math.prod(choice["sizes"].values()) for choice in choices}
    if len(worlds) != 1:
        raise ValueError(f"{name}: grids of one world size expected, got sizes {sorted(worlds)}")
    return _spawned(_as_rank0, choices, threads, measure, *args)


def _spawned(function, *args):
    """``function(*args)`` in a spawned process. An executor, not a Pool: if the child dies (killed, out of
    memory) this raises BrokenProcessPool instead of waiting forever."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def cores_shared(world: int, threads: int, cores: int, cuda: bool) -> float:
    """How many times slower a rank computes in the real job than alone: ranks
    time-share this machine's cores when ``world * threads`` exceeds them (all ranks
    of a local or emulated job run here); a GPU rank has its own device."""
    return 1.0 if cuda else max(1.0, world * threads / cores)


def _as_rank0(choices: list[dict], threads: int, measure, *args) -> list[dict]:
    """``measure(grid, step, *args)`` for each choice's :class:`~par4d.measure.grids.TrainingStep`, this process
    standing in for rank 0 of the job with torch's fake process group."""
    from par4d.grid import build_grid, validate_sizes
    from par4d.launch import device
    from par4d.measure.grids import TrainingStep

    world = math.prod(choices[0]["sizes"].values())
    rows = []
    with _fake_rank0(world, threads):
        for choice in choices:
            # Not par4d.init: its check that every rank asked for the same grid needs peers.
            grid = build_grid(validate_sizes(choice["sizes"], world), device(None))
            step = TrainingStep(grid, microbatches=choice.get("microbatches"),
                                recompute=choice.get("recompute", False))
            rows.append(measure(grid, step, *args))
            grid.close()
    return rows


@contextmanager
def _fake_rank0(world: int, threads: int):
    """This process as rank 0 of a job of ``world`` ranks with torch's fake process group (its collectives
    return at once and move nothing), with ``threads`` torch threads."""
    import torch
    import torch.distributed as dist

    # Registers the "fake" backend (torch has no public module for it; torchtitan's
    # fake-backend mode uses the same one).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(threads)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _timed(grid, step, iters: int) -> dict:
    """The median seconds of ``iters`` steps after the warm-up ones, and the collectives of one."""
    import torch

    from par4d.measure.grids import WARMUP, step_collectives

    for _ in range(WARMUP):
        step()
    collectives = step_collectives(grid, step)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        if grid.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "collectives": collectives}


def _overhead(threads: int, repeats: int) -> dict:
    import torch

    from par4d.grid import build_grid, validate_sizes
    from par4d.measure.grids import WARMUP, TrainingStep
    from par4d.plan.workload import MEASURED

    batch, seq_len = 4, 2
    times: dict[int, list[float]] = {1: [], 4: []}
    with _fake_rank0(1, threads):
        grid = build_grid(validate_sizes({"x": 1, "y": 1, "z": 1, "data": 1}, 1), torch.device("cpu"))  # CPU ranks'
        steps = {micro: TrainingStep(grid, batch_size=batch, seq_len=seq_len, microbatches=micro) for micro in times}
        for _ in range(WARMUP):
            for run in steps.values():
                run()
        for _ in range(repeats):
            for micro, run in steps.items():
                start = time.perf_counter()
                run()
                times[micro].append(time.perf_counter() - start)
        grid.close()
    one, four = (statistics.median(times[micro]) for micro in (1, 4))
    return {"microbatch_seconds": (four - one) / 3, "step_seconds": one, "batch": batch, "seq_len": seq_len,
            "layer_passes": 3 * sum(layer.count for layer in MEASURED.layers())}


def _held(grid, step) -> dict:
    """What one step holds (the optimizer's state exists from the first step on: one runs first)."""
    from par4d.train.footprint import measure_footprint

    step()
    return measure_footprint(step.model, step.precision, step).row()
