"""The one training step: ``par4d train``, ``plan validate`` and its profiler, ``phantom
compare`` and every benchmark run this function, so what later changes the order of a step
(overlap, the pipeline, an offloaded optimizer) changes it once, for them all. A benchmark
that looks inside a step (``bench pipeline``'s order, ``bench offload``'s device memory)
does so through ``after_backward``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from par4d.grid import Grid
from par4d.nn.moe import update_expert_bias
from par4d.optim.data_parallel import gradient_sync
from par4d.optim.precision import FullPrecision, Precision
from par4d.pipeline import PipelineStats, run_pipeline, split_microbatches, weighted_backward


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | Precision, grid: Grid,
               batch: torch.Tensor | tuple[torch.Tensor, ...], *, loss: Callable[..., torch.Tensor] | None = None,
               grad_clip: float = 0.0, microbatches: int | None = None, pipeline_limit: int | None = None,
               after_backward: Callable[[PipelineStats | None], None] | None = None,
               report: dict | None = None) -> torch.Tensor:
    """One optimizer step of ``model`` on ``grid`` over this rank's ``batch``; returns this rank's loss
    (detached).

    ``batch``: this rank's shard of the inputs (:func:`par4d.shard_batch`), a tensor or a tuple of
    them; ``loss(*batch)`` runs the forward pass and returns the mean loss of this rank's samples
    (default: ``model`` itself, as par4d's GPT, ``model(idx, targets)``).
    ``optimizer``: a torch optimizer over the model's parameters (fp32), or a precision policy
    (:class:`~par4d.optim.precision.MixedPrecision`: its fp32 masters and their optimizer step, its loss
    scale multiplies the loss before backward; a step it skips changes nothing). Either way the
    policy's one ``step`` finishes the data-parallel sync, clips to ``grad_clip`` (0: no clipping),
    steps and zeroes the gradients.
    ``microbatches`` M > 1 without a pipeline is gradient accumulation: ``batch`` (each tensor cut
    along dim 0) runs in M forward and backward passes, one microbatch's activations at a time,
    each loss weighted by its share of the rows, so the gradient and the loss returned are the
    whole batch's; the data-parallel sync and the optimizer run once.
    On a grid with ``pipe > 1`` the model is one pipeline stage (par4d's GPT) and
    ``batch`` is ``(idx, targets)``: the message-driven pipeline runs forward and
    backward over ``microbatches`` microbatches (default: ``pipe``), at most ``pipeline_limit``
    in flight (default: ``pipe``).
    ``after_backward(stats)``: called once forward and backward are done, before the data-parallel
    sync finishes and the optimizer steps, with the pipeline's :class:`PipelineStats` (None without
    a pipeline): where a benchmark looks inside a step (a stage's order, device memory).
    ``report``: gets ``grad_norm``, the global gradient norm before clipping, where clipping computed it
    (``grad_clip > 0``; not for a step mixed precision skipped).
    """
    if not isinstance(batch, (torch.Tensor, tuple, list)):
        raise TypeError(f"train_step: batch is {type(batch).__name__}; give this rank's tensor or a tuple of them "
                        f"(the positional inputs of loss(*batch))")
    inputs = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    forward = model if loss is None else loss
    precision = optimizer if isinstance(optimizer, Precision) else FullPrecision(model, grid, optimizer)
    sync = gradient_sync(model, grid)
    if grid.size("pipe") > 1:           # forward and backward, microbatch by microbatch, stage by stage
        value, stats = run_pipeline(model, grid, *inputs, microbatches or grid.size("pipe"), pipeline_limit,
                                    loss_scale=precision.scale)
    else:
        stats = None
        count = microbatches or 1
        pieces, weights = split_microbatches(inputs, count) if count > 1 else ([inputs], [1.0])
        value = 0.0
        for micro, (piece, weight) in enumerate(zip(pieces, weights)):
            part = forward(*piece)      # forward: Algorithm 1's all-gathers over z, all-reduces over the in-axes
            # Each backward defers its reduce-scatters (ORS); only the last lets buckets start as they fill:
            # the data-parallel sum runs once per step, over the gradients accumulated in .grad.
            with sync.backward(last=micro == count - 1):
                weighted_backward(part, weight, precision.scale)  # input-gradient all-reduces, weight reduce-scatters
            value = part.detach() if count == 1 else value + part.detach().float() * weight   # as the pipeline's
    if after_backward is not None:
        after_backward(stats)
    # Finish the sync, clip, step (mixed precision: unscaled into the fp32 masters and rounded back;
    # offloaded: bucket by bucket as the all-reduce returns them), zero the gradients.
    precision.step(sync, grad_clip)
    update_expert_bias(model, sync.modules)   # a mixture's loss-free balancing, once per step (none without one)
    if report is not None and precision.grad_norm is not None:
        report["grad_norm"] = float(precision.grad_norm)
    return value.detach()
