"""LayerNorm and RMSNorm over a hidden dimension that is split over a grid axis.

Forward all-gathers each rank's per-row ``[mean, M2]`` (M2 = sum of squared
deviations from the local mean) over that axis and merges them exactly (Chan et
al.'s parallel variance), which stays accurate when the mean is large, unlike
``E[x^2] - E[x]^2``. Backward all-reduces ``[sum g, sum g x̂]`` (g = dL/dx̂). The
result equals ``torch.nn.LayerNorm`` on the full rows.

RMSNorm (Llama's, Mistral's, Qwen2's) all-reduces each row's sum of squares over the axis
(:class:`par4d.nn.collectives.SumOver`, whose backward all-reduces that sum's gradient); the rest is
elementwise on the local block, so autograd differentiates it.

HeadRMSNorm (Qwen3's per-head query and key norms) normalises each head's features, whole on the rank,
with one weight every head shares; where the heads are split over an axis, each rank gives that weight its
own heads' gradient, summed over the axis (:class:`par4d.nn.collectives.SumGradients`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d import comm
from par4d.grid import Grid
from par4d.layout import BATCH_AXES, Placement, Split, place
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import SumGradients, SumOver


class _ShardedLayerNorm(torch.autograd.Function):
    """all-gather of row statistics over ``axis`` in forward, all-reduce of their gradients in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid: Grid, axis: str, dim: int, eps: float):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))                  # half: fp32; float64 kept
        local_mean = xf.mean(-1, keepdim=True)                                  # (..., 1)
        local_m2 = (xf - local_mean).square().sum(-1, keepdim=True)
        stats = torch.cat([local_mean, local_m2], dim=-1).unsqueeze(0)           # (1, ..., 2)
        gathered = comm.all_gather(grid, stats, axis)                           # (G, ..., 2)
        means, m2s = gathered[..., 0:1], gathered[..., 1:2]
        mean = means.mean(0)                                                    # equal counts per rank
        m2 = m2s.sum(0) + (x.shape[-1] * (means - mean).square()).sum(0)
        rstd = torch.rsqrt(m2 / dim + eps)
        xhat = (xf - mean) * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.grid, ctx.axis, ctx.dim = grid, axis, dim
        return (xhat * weight + bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, rstd, weight = ctx.saved_tensors
        g = grad_out.to(xhat.dtype)
        grad_weight = (g * xhat).reshape(-1, xhat.shape[-1]).sum(0)
        grad_bias = g.reshape(-1, g.shape[-1]).sum(0)
        gxhat = g * weight
        stats = torch.stack([gxhat.sum(-1), (gxhat * xhat).sum(-1)], dim=-1)
        comm.all_reduce(ctx.grid, stats, ctx.axis)
        grad_x = rstd * (gxhat - stats[..., 0:1] / ctx.dim - xhat * stats[..., 1:2] / ctx.dim)
        return grad_x.to(grad_out.dtype), grad_weight, grad_bias, None, None, None, None


class LayerNorm(ShardedModule):
    """``torch.nn.LayerNorm(dim)`` on activations whose last dim is split over ``axis``."""

    def __init__(self, dim: int, *, grid: Grid, axis: str = "y", eps: float = 1e-5, name: str = "LayerNorm"):
        super().__init__()
        if dim % grid.size(axis):
            raise ValueError(f"{name}(dim={dim}): dim is not divisible by {axis}={grid.size(axis)}")
        self.grid, self.axis, self.dim, self.eps = grid, axis, dim, eps
        local = dim // grid.size(axis)
        placement = Placement((Split(0, axis),), grad_sum=BATCH_AXES)   # replicated over z: partial there
        self.weight = place(nn.Parameter(torch.ones(local, device=grid.device)), placement)
        self.bias = place(nn.Parameter(torch.zeros(local, device=grid.device)), placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid.size(self.axis) == 1:     # the whole row here: PyTorch's fused kernel
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        return _ShardedLayerNorm.apply(x, self.weight, self.bias, self.grid, self.axis, self.dim, self.eps)


class RMSNorm(ShardedModule):
    """Llama's RMSNorm (``x / sqrt(mean(x^2) + eps)`` in fp32, float64 kept, cast back to ``x``'s dtype,
    times the weight) on activations whose last dim is split over ``axis``."""

    def __init__(self, dim: int, *, grid: Grid, axis: str = "y", eps: float = 1e-6, name: str = "RMSNorm"):
        super().__init__()
        if dim % grid.size(axis):
            raise ValueError(f"{name}(dim={dim}): dim is not divisible by {axis}={grid.size(axis)}")
        self.grid, self.axis, self.dim, self.eps = grid, axis, dim, eps
        placement = Placement((Split(0, axis),), grad_sum=BATCH_AXES)   # replicated over z: partial there
        self.weight = place(nn.Parameter(torch.ones(dim // grid.size(axis), device=grid.device)), placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = xf.square().sum(-1, keepdim=True)
        if self.grid.size(self.axis) > 1:
            squares = SumOver.apply(squares, self.grid, self.axis)
        return self.weight * (xf * torch.rsqrt(squares / self.dim + self.eps)).to(x.dtype)


class HeadRMSNorm(nn.Module):
    """An RMSNorm over each head's ``dim`` features (``x / sqrt(mean(x^2) + eps)`` in fp32, float64 kept, cast
    back, times the weight) on heads split over ``axis``: the weight, whole on every rank, gets the sum of every
    rank's heads' gradients (its other sums, over the batch's axes, are the data-parallel sync's)."""

    def __init__(self, dim: int, *, grid: Grid, axis: str = "x", eps: float = 1e-6):
        super().__init__()
        self.grid, self.axis, self.eps = grid, axis, eps
        self.weight = nn.Parameter(torch.ones(dim, device=grid.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        weight = SumGradients.apply(self.weight, self.grid, self.axis)
        return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
