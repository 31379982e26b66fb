"""Helpers that run inside the pool's ranks."""

from __future__ import annotations

import par4d
from par4d.grid import Grid, _build, validate_sizes

_grids: dict[tuple, Grid] = {}


def grid(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1) -> Grid:
    """A cached grid of this shape (building groups costs; tests reuse them)."""
    key = (x, y, z, data, pipe)
    if key not in _grids:
        _grids[key] = par4d.init(x=x, y=y, z=z, data=data, pipe=pipe)
    return _grids[key]


def factorizations(world: int, axes=("x", "y", "z", "data")) -> list[dict[str, int]]:
    """Every assignment of sizes to ``axes`` whose product is ``world``."""
    out = [{}]
    for axis in axes:
        out = [dict(f, **{axis: d}) for f in out for d in range(1, world + 1) if world % d == 0]
    import math

    return [f for f in out if math.prod(f.values()) == world]


__all__ = ["grid", "factorizations", "validate_sizes", "_build"]
