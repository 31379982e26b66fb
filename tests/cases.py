"""Helpers that run inside the pool's ranks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import par4d
from par4d.grid import Grid, build_grid, validate_sizes
from par4d.plan.model import factorizations

_current: dict[tuple, Grid] = {}


def grid(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1,
         nodes: tuple[int, ...] | None = None, hierarchical: str = "auto") -> Grid:
    """The grid of this shape, reused while tests ask for the same shape (building
    groups costs); the previous shape's grid is closed, since idle groups slow the
    pool's ranks (docs/planner.md). ``nodes``: each rank's node, declared (the pool's ranks
    share one host): collectives over groups that span the declared nodes go in stages."""
    key = (x, y, z, data, pipe, nodes, hierarchical)
    if key not in _current:
        for old in _current.values():
            old.close()
        _current.clear()
        sizes = dict(x=x, y=y, z=z, data=data, pipe=pipe)
        if nodes is None:
            _current[key] = par4d.init(**sizes, hierarchical=hierarchical)
        else:
            _current[key] = build_grid(validate_sizes(sizes, dist.get_world_size()), torch.device("cpu"),
                                       nodes, hierarchical)
    return _current[key]


@contextmanager
def float64() -> Iterator[None]:
    """Models and data built inside take float64 (par4d's layers, like torch's, take the default
    dtype): where a comparison runs several optimizer steps, fp32 would hold it to round-off that
    other CPUs' kernels sum in another order and AdamW amplifies; float64 proves exactness."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of every gradient it steps with (after the sync and clipping)."""

    def __init__(self, params, **settings):
        super().__init__(params, **settings)
        self.grads: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):
        self.grads.append([None if p.grad is None else p.grad.clone()
                           for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def assert_bitwise(what: str, ours, base) -> None:
    """``ours`` equals ``base`` bit for bit (tensors, or nested lists of them; None where both have none)."""
    if isinstance(base, list):
        assert len(ours) == len(base), f"{what}: {len(ours)} items, the other run {len(base)}"
        for i, (a, b) in enumerate(zip(ours, base)):
            assert_bitwise(f"{what}[{i}]", a, b)
        return
    if base is None or ours is None:
        assert ours is None and base is None, f"{what}: one side has no gradient"
        return
    if not torch.equal(ours, base):
        diff = (ours.double() - base.double()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max |diff| {diff:.3g})")


__all__ = ["RecordingAdamW", "assert_bitwise", "factorizations", "float64", "grid"]
