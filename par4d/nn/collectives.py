"""Collective pairs as autograd Functions (each docstring states the pair)."""

from __future__ import annotations

import torch

from par4d import comm
from par4d.grid import Grid


class GatherShards(torch.autograd.Function):
    """all-gather over ``axis`` in forward, reduce-scatter over ``axis`` in backward."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        ctx.grid, ctx.axis = grid, axis
        return comm.all_gather(grid, shard, axis)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        return comm.reduce_scatter(ctx.grid, grad_full, ctx.axis), None, None


def gather_shards(shard: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
    return GatherShards.apply(shard, grid, axis)
