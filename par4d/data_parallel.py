"""Gradient synchronization over the batch shards (data x z).

Each rank back-propagates the mean loss of its own samples. The z reduce-scatter
of Algorithm 1 already summed Ŵ's gradient over z; every other gradient is still
partial over the axes in its :class:`~par4d.layout.Placement`'s ``grad_sum``. This
module sums the rest (bucketed: one all-reduce per group of axes and bucket) and
divides by the number of batch shards G_data * G_z, so every gradient equals the
single-device gradient of the mean loss over the global batch.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from par4d import comm
from par4d.grid import TENSOR_AXES, Grid
from par4d.layout import Placement, placement_of

BUCKET_BYTES = 25 * 2**20


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    buckets, current, size = [], [], 0
    for t in tensors:
        if current and size + t.numel() * t.element_size() > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += t.numel() * t.element_size()
    return buckets + ([current] if current else [])


def _placement(name: str, param: torch.Tensor) -> Placement:
    placement = placement_of(param)
    if placement is None:
        raise ValueError(f"parameter {name!r} is not a par4d parameter (no placement); "
                         f"build the model from par4d.nn layers")
    return placement


@torch.no_grad()
def sync_gradients(model: nn.Module, grid: Grid, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum every parameter's gradient over its partial axes; divide by G_data * G_z.

    Call after ``backward()`` and before the optimizer step, on every rank.
    """
    groups: dict[tuple[str, ...], list[torch.Tensor]] = defaultdict(list)
    for name, param in model.named_parameters():
        placement = _placement(name, param)
        if param.grad is not None:
            groups[placement.grad_sum].append(param.grad)
    scale = 1.0 / grid.size("z", "data")
    for axes in sorted(groups):
        if grid.size(*axes) == 1:     # nothing to sum: no flatten and copy back, only the scale
            if scale != 1.0:
                for grad in groups[axes]:
                    grad.mul_(scale)
            continue
        for bucket in _buckets(groups[axes], bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            comm.all_reduce(grid, flat, *axes)
            flat.mul_(scale)
            for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(synced)


@torch.no_grad()
def global_mean(value: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Mean of a per-rank batch statistic over the batch shards (data x z)."""
    out = value.detach().clone().reshape(1)
    comm.all_reduce(grid, out, "z", "data")
    return out[0] / grid.size("z", "data")


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, grid: Grid) -> torch.Tensor:
    """Scale all gradients so their global 2-norm is at most ``max_norm``; returns the
    norm before clipping (as ``torch.nn.utils.clip_grad_norm_`` on the single-device model).

    Call after :func:`sync_gradients`. Each shard counts once: a gradient replicated over
    tensor axes (x, y, z) it is not sharded on is divided by that replication, and the
    sum of squares is all-reduced over (x, y, z); data replicas are identical.
    """
    total = torch.zeros(1, dtype=torch.float64, device=grid.device)
    grads = []
    for name, param in model.named_parameters():
        placement = _placement(name, param)
        if param.grad is None:
            continue
        copies = grid.size(*[a for a in TENSOR_AXES if a not in placement.sharded])
        # The shard's norm in its own dtype (no float64 copy of the gradient), summed in float64.
        total += torch.linalg.vector_norm(param.grad).double().square() / copies
        grads.append(param.grad)
    comm.all_reduce(grid, total, "x", "y", "z")
    norm = total.sqrt().float()
    clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)   # a tensor: no host sync to decide whether to clip
    for grad in grads:
        grad.mul_(clip)
    return norm[0]
