"""Helpers that run inside the pool's ranks."""

from __future__ import annotations

import par4d
from par4d.grid import Grid
from par4d.plan.model import factorizations

_grids: dict[tuple, Grid] = {}


def grid(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1) -> Grid:
    """A cached grid of this shape (building groups costs; tests reuse them)."""
    key = (x, y, z, data, pipe)
    if key not in _grids:
        _grids[key] = par4d.init(x=x, y=y, z=z, data=data, pipe=pipe)
    return _grids[key]


__all__ = ["factorizations", "grid"]
