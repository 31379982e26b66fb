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


class SplitFeatures(torch.autograd.Function):
    """keep this rank's block of the last dim in forward, all-gather the blocks in backward
    (for a tensor replicated over ``axis`` entering a layer that wants it sharded)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        ctx.grid, ctx.axis = grid, axis
        size = full.shape[-1] // grid.size(axis)
        return full[..., grid.coord(axis) * size:(grid.coord(axis) + 1) * size].contiguous()

    @staticmethod
    def backward(ctx, grad_block: torch.Tensor):
        return comm.all_gather_dim(ctx.grid, grad_block, ctx.axis, dim=grad_block.dim() - 1), None, None


class GatherFeatures(torch.autograd.Function):
    """all-gather the blocks of the last dim in forward, keep this rank's block in backward
    (the gradient of a replicated result is the same on every rank: no reduction)."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        ctx.grid, ctx.axis, ctx.size = grid, axis, block.shape[-1]
        return comm.all_gather_dim(grid, block, axis, dim=block.dim() - 1)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        start = ctx.grid.coord(ctx.axis) * ctx.size
        return grad_full[..., start:start + ctx.size].contiguous(), None, None
