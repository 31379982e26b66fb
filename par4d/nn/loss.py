"""Cross-entropy over a vocabulary split over a grid axis (logits never gathered).

Rank i of ``axis`` holds logits for vocabulary ids ``[i V/G, (i+1) V/G)``. Forward
all-reduces the row max (MAX) and then ``[sum exp, target logit]`` (SUM) over the
axis; backward is local: ``(softmax - onehot) / tokens``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from par4d import comm
from par4d.grid import Grid
from par4d.layout import local_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """two all-reduces over the vocabulary axis in forward, none in backward."""

    @staticmethod
    def forward(ctx, logits, targets, grid: Grid, axis: str):
        vocab_local = logits.shape[-1]
        start = local_range(grid, vocab_local * grid.size(axis), axis).start   # this rank's first id
        # (tokens, V/G); half logits in fp32, float64 kept (not rounded to fp32)
        flat = logits.reshape(-1, vocab_local).to(torch.promote_types(logits.dtype, torch.float32))
        tgt = targets.reshape(-1)
        row_max = flat.max(-1).values
        comm.all_reduce(grid, row_max, axis, op=torch.distributed.ReduceOp.MAX)
        shifted = flat - row_max[:, None]
        local = tgt - start
        mine = (local >= 0) & (local < vocab_local)
        index = local.clamp(0, vocab_local - 1)
        picked = torch.where(mine, shifted.gather(1, index[:, None])[:, 0], 0.0)
        exp = shifted.exp_()                                            # one (tokens, V/G) temporary
        stats = torch.stack([exp.sum(-1), picked], dim=-1)             # (tokens, 2)
        comm.all_reduce(grid, stats, axis)
        loss = stats[:, 0].log() - stats[:, 1]
        ctx.save_for_backward(exp.div_(stats[:, :1]), index, mine)     # softmax
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine = ctx.saved_tensors
        scale = grad_loss / softmax.shape[0]
        grad = softmax * scale
        # minus the one-hot of the target, on the rank that holds it (no host sync)
        grad.scatter_add_(1, index[:, None], (-scale * mine.to(grad.dtype))[:, None])
        return grad.reshape(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, grid: Grid,
                                 axis: str = "x") -> torch.Tensor:
    """Mean cross-entropy of this rank's tokens; ``logits`` (..., V / G_axis), ``targets`` (...) global ids.
    With the vocabulary whole on this rank (G_axis = 1), PyTorch's fused ``cross_entropy``."""
    if grid.size(axis) == 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return _VocabParallelCrossEntropy.apply(logits, targets, grid, axis)
