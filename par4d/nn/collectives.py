"""Collective pairs as autograd Functions (each docstring states the pair)."""

from __future__ import annotations

import torch

from par4d import comm
from par4d.grid import Grid
from par4d.layout import gather_features, shard_features


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
        return shard_features(grid, full, axis).contiguous()

    @staticmethod
    def backward(ctx, grad_block: torch.Tensor):
        return gather_features(ctx.grid, grad_block, ctx.axis), None, None


class GatherFeatures(torch.autograd.Function):
    """all-gather the blocks of the last dim in forward, keep this rank's block in backward
    (the gradient of a replicated result is the same on every rank: no reduction)."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        ctx.grid, ctx.axis = grid, axis
        return gather_features(grid, block, axis)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        return shard_features(ctx.grid, grad_full, ctx.axis).contiguous(), None, None


class SumOver(torch.autograd.Function):
    """all-reduce over ``axis`` in forward, all-reduce over ``axis`` in backward (every rank's result
    depends on every rank's input: each input's gradient sums what all the results gave back)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        ctx.grid, ctx.axis = grid, axis
        return comm.all_reduce(grid, partial.clone(), axis)

    @staticmethod
    def backward(ctx, grad_sum: torch.Tensor):
        return comm.all_reduce(ctx.grid, grad_sum.clone(), ctx.axis), None, None


class SumFeatures(torch.autograd.Function):
    """all-reduce over ``axis`` in forward, nothing in backward: partial sums over a feature split whose
    result every rank of ``axis`` then uses alike (a router's logits), so each rank's part has the sum's
    gradient."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        return comm.all_reduce(grid, partial.contiguous(), axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class SumGradients(torch.autograd.Function):
    """nothing in forward, all-reduce over ``axis`` in backward: a tensor every rank of ``axis`` holds
    whole and applies to its own part of a feature split (a mixture's weights), so its gradient is the
    sum of the parts'. The pair of :class:`SumFeatures`."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
        ctx.grid, ctx.axis = grid, axis
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_reduce(ctx.grid, grad.contiguous().clone(), ctx.axis), None, None
