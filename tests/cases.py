"""Helpers that run inside the pool's ranks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

import par4d
from par4d.grid import Grid
from par4d.plan.model import factorizations

_current: dict[tuple, Grid] = {}


def grid(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1) -> Grid:
    """The grid of this shape, reused while tests ask for the same shape (building
    groups costs); the previous shape's grid is closed, since idle groups slow the
    pool's ranks (docs/planner.md)."""
    key = (x, y, z, data, pipe)
    if key not in _current:
        for old in _current.values():
            old.close()
        _current.clear()
        _current[key] = par4d.init(x=x, y=y, z=z, data=data, pipe=pipe)
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


__all__ = ["factorizations", "float64", "grid"]
