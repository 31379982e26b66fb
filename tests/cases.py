"""Helpers that run inside the pool's ranks."""

from __future__ import annotations

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


__all__ = ["factorizations", "grid"]
