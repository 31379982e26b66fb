"""Layouts as data: how parameters and activations are split over the grid.

Activations (DESIGN §2): rows (whole samples) are split over ``data`` then ``z``;
features are split over ``x`` or ``y`` and replicated over the other. Parameters
carry a :class:`ParamSpec` saying which axes shard them and over which axes their
gradient is still a partial sum after backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from par4d.grid import AXES, Grid

TENSOR_AXES = ("x", "y", "z")


@dataclass(frozen=True)
class ParamSpec:
    """Placement of one parameter.

    sharded: tensor axes (x, y, z) over which ranks hold different pieces; over
        the remaining tensor axes the parameter is replicated.
    grad_sum: axes over which the gradient left by backward is still partial
        (``data`` always; ``z`` unless a reduce-scatter over z already summed it).
    """

    sharded: tuple[str, ...]
    grad_sum: tuple[str, ...]

    def __post_init__(self) -> None:
        for axis in self.sharded + self.grad_sum:
            assert axis in AXES, axis


def mark(param: nn.Parameter, *, sharded: tuple[str, ...], grad_sum: tuple[str, ...]) -> nn.Parameter:
    param._par4d_spec = ParamSpec(sharded, grad_sum)  # type: ignore[attr-defined]
    return param


def spec(param: torch.Tensor) -> ParamSpec | None:
    return getattr(param, "_par4d_spec", None)


def block(length: int, parts: int, index: int) -> slice:
    """The ``index``-th of ``parts`` equal contiguous blocks of ``length``."""
    size = length // parts
    return slice(index * size, (index + 1) * size)


def batch_slice(grid: Grid, batch: int) -> slice:
    """Rows of a global batch held by this rank: blocks over data, then z inside."""
    if batch % grid.size("data", "z"):
        raise ValueError(f"global batch of {batch} samples is not divisible by data * z = "
                         f"{grid.size('data')} * {grid.size('z')} = {grid.size('data', 'z')}")
    shard = grid.coord("data") * grid.size("z") + grid.coord("z")
    return block(batch, grid.size("data", "z"), shard)


def shard_batch(grid: Grid, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's samples (dim 0) of a global batch."""
    return tensor[batch_slice(grid, tensor.shape[0])]


def shard_features(grid: Grid, tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """This rank's block of the last dim, split over ``axis``."""
    return tensor[..., block(tensor.shape[-1], grid.size(axis), grid.coord(axis))]


def shard_activation(grid: Grid, tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """A global activation (batch, ..., features) in par4d's layout."""
    return shard_features(grid, shard_batch(grid, tensor), axis)
