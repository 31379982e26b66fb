"""Ranks and their job: :func:`init` joins the job and builds a Grid over it.

Where ranks come from is :mod:`~par4d.launch.ranks` (torchrun's and srun's variables); par4d's own local
launcher is :mod:`~par4d.launch.local`; joining the job (rendezvous, process group, device) is
:mod:`~par4d.launch.join`; this host's cores, memory and matmul peak are :mod:`~par4d.launch.host` and
:mod:`~par4d.launch.peak`; an emulated multi-node cluster is :mod:`~par4d.launch.cluster`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from par4d.launch.join import JOIN_TIMEOUT, device, join
from par4d.launch.local import (
    Interrupted,
    RankFailed,
    children,
    environment,
    free_port,
    launch_local,
    wait_for_children,
)
from par4d.launch.ranks import DistEnv, distributed_env

if TYPE_CHECKING:   # torch is imported where a rank joins a job: `par4d plan` needs none
    from par4d.grid import Grid

__all__ = ["JOIN_TIMEOUT", "DistEnv", "Interrupted", "RankFailed", "children", "device", "distributed_env",
           "environment", "free_port", "init", "join", "launch_local", "wait_for_children"]


def init(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1, hierarchical: str = "auto",
         expert: int = 1, context: int = 1) -> Grid:
    """Build the grid ``x * y * z * context * data * pipe`` over the current job (``context``: each sequence
    cut over that many ranks, par4d.nn.ring), ``expert`` folded over ``data`` (a mixture's experts spread
    over that many of its ranks: par4d.nn.MoE). A model's overlaps are
    its own (``par4d.overlap.set_overlap``; par4d's GPT and U-Net take ``overlap=``).

    Joins an existing torch.distributed job or initializes one from the
    environment (torchrun, srun, or par4d's launcher): gloo on CPU, NCCL where CUDA
    is present. The shape is validated on every rank before any collective. Every rank
    tells its node (host and network namespace); collectives over groups that span nodes
    go in stages as ``hierarchical`` says (par4d.hierarchy.MODES).
    """
    import torch.distributed as dist

    from par4d.grid import build_grid, validate_sizes
    from par4d.hierarchy import check_mode, node_indices, node_key

    check_mode(hierarchical)
    requested = {"x": x, "y": y, "z": z, "context": context, "data": data, "pipe": pipe,
                 **({"expert": expert} if expert != 1 else {})}
    env = distributed_env()
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = env.world_size if env is not None else 1
    sizes = validate_sizes(requested, world)
    join(env)
    keys = _check_same_on_every_rank(sizes, hierarchical, node_key())
    grid = build_grid(sizes, device(env), node_indices(keys), hierarchical)
    if hierarchical == "auto":
        _measure_stages(grid)
    return grid


PROBE_ELEMENTS = 1 << 18      # 1 MB of fp32: enough for the link's rate to show (~10 ms a try at 1 Gbit/s)
PROBE_TRIES = 5
PROBE_MARGIN = 1.1    # staged is kept unless measured 10% slower than flat: a probe on busy cores is noisy, and
                      # where staging loses (fast links) it loses by far more than the margin


def _measure_stages(grid: Grid) -> None:
    """Under ``--hierarchical auto``, keep staging a group's collectives only where a staged all-reduce
    of PROBE_ELEMENTS was not slower than the flat one (by PROBE_MARGIN) on this job: fast links and busy
    cores can make the node stages cost more than the link bytes they save. Each side's best of
    PROBE_TRIES; the slowest rank's times decide, so every rank decides alike. The probes stay out of
    the grid's ledger."""
    import functools
    import time

    import torch
    import torch.distributed as dist

    from par4d import staged

    decided: dict[int, bool] = {}      # by link group: ("z",) and ("z", "data") at data=1 share their stages
    with grid.unrecorded():
        for key, stages in grid.stage_candidates():
            if id(stages.link) in decided:
                grid.set_staging(key, decided[id(stages.link)])
                continue
            tensor, group = torch.ones(PROBE_ELEMENTS, device=grid.device), grid.group(*key)
            seconds = []
            flat = functools.partial(dist.all_reduce, tensor, group=group)
            for run in (flat, functools.partial(staged.all_reduce, grid, stages, tensor, key, False)):
                best = float("inf")
                for _ in range(PROBE_TRIES):
                    start = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - start)
                seconds.append(best)
            slowest = torch.tensor(seconds, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            decided[id(stages.link)] = bool(slowest[1] < PROBE_MARGIN * slowest[0])
            grid.set_staging(key, decided[id(stages.link)])


def _check_same_on_every_rank(sizes: dict[str, int], hierarchical: str, node: str) -> list[str]:
    """Ranks that ask for different grids would build mismatched groups and hang. Returns every
    rank's ``node``, gathered in the same collective."""
    import torch.distributed as dist

    from par4d.grid import describe

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sizes, hierarchical, node))
    modes = {mode for _, mode, _ in every}
    if len(modes) > 1:
        raise ValueError(f"ranks asked par4d.init for different --hierarchical settings: {sorted(modes)}")
    every, keys = [s for s, _, _ in every], [k for _, _, k in every]
    if any(other != sizes for other in every):
        shapes: dict[str, list[int]] = {}
        for rank, other in enumerate(every):
            shapes.setdefault(describe(other), []).append(rank)
        listing = "; ".join(f"ranks {ranks}: {shape}" for shape, ranks in shapes.items())
        raise ValueError(f"ranks asked par4d.init for different grids ({listing})")
    return keys
