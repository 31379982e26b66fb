"""The message-driven pipeline over the pipe axis (the async-pipeline paper's Algorithm 2).

Each pipeline stage is a group of ranks with the same ``pipe`` coordinate, holding a
contiguous run of the model's blocks (``GPTConfig.stage_blocks``) on its own x, y, z,
data sub-grid; a rank talks only to the ranks with its own coordinates in the stages
before and after it, and sends them its own shard of the residual stream (every block
takes and returns the same layout, so shards line up).

A step cuts this rank's batch shard into ``M`` microbatches. No schedule is fixed: a
stage runs whatever has arrived, an activation from the stage before (forward) or a
gradient from the stage after (backward), a backward first when both have (it frees a
microbatch's activations and, on the first stage, lets the next one in); the last stage
runs a microbatch's backward right after its forward; the first stage starts a new
microbatch whenever one finishes its backward, keeping at most ``limit`` in flight
(default ``pipe``: the paper's bound on activation memory, Lemma 5.1), and stage s holds at
most ``limit - s`` (no more can usefully wait for it: the depth of 1F1B's warm-up, so its
memory). Sends never block.

A message is the tensor alone, one point-to-point transfer: its shape is known to both
ends (the model's ``stream_shape`` of the microbatch's rows, so shapes may change between
batches), and messages of one kind leave a stage in microbatch order (forwards in the
order the first stage starts them, backwards in the order the last stage ends them), so
the n-th message of a kind is microbatch n. Receives are posted ``limit`` microbatches
ahead, so a message lands in its buffer as soon as it is sent.

The loss is the whole shard's: microbatch m's mean loss is weighted by its share of the
rows before its backward, so gradients accumulate to those of one pass over the shard
(:func:`split_microbatches`, :func:`weighted_backward`: ``train_step``'s gradient
accumulation without a pipeline cuts and weights its microbatches with them too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from par4d import comm
from par4d.grid import Grid
from par4d.pipeline.inbox import BACKWARD, FORWARD, SOURCE, Inbox
from par4d.pipeline.microbatches import split_microbatches, weighted_backward


@dataclass
class PipelineStats:
    """What one step did on this rank: its order of work (``F3``: forward of microbatch 3,
    ``B3``: its backward) and the most microbatches it held in flight at once."""

    microbatches: int
    order: list[str] = field(default_factory=list)
    max_in_flight: int = 0


def _send(grid: Grid, tensor: torch.Tensor, kind: int, micro: int, expected: tuple) -> comm.Handle:
    if (tuple(tensor.shape), tensor.dtype) != expected:
        raise ValueError(f"pipeline stage {grid.coord('pipe')} would send microbatch {micro} as "
                         f"{tuple(tensor.shape)} {tensor.dtype}, but the next stage expects {expected[0]} "
                         f"{expected[1]} (the model's stream_shape)")
    return comm.send(grid, tensor, "pipe", -SOURCE[kind], kind)


def run_pipeline(model: nn.Module, grid: Grid, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
                 limit: int | None = None, loss_scale: float = 1.0) -> tuple[torch.Tensor, PipelineStats]:
    """Forward and backward of this rank's batch shard through the pipeline; gradients
    accumulate in ``.grad`` (not yet summed over data and z). Returns the shard's mean loss
    (on every stage: the last stage's, with every stage's own, shared over pipe) and what this rank did.

    ``model`` has ``stage_forward(inputs, targets=None)``, ``stream_shape(rows, seq)``,
    ``first`` and ``last`` (par4d's GPT); and may have ``stage_axes``, the axes whose ranks join the same
    collectives inside a stage during a step (default x, y, z; a mixture of experts': data's too), and
    ``stage_loss()``, what a stage before the last adds to the loss at its last forward (a mixture's
    balance losses: each microbatch's backward starts from it too, and the loss returned counts it).
    Every stage gets the same ``inputs`` shape (token ids: used on the first stage, their shape on
    all), ``targets`` are used on the last; every stage must pass the same ``microbatches``.
    ``loss_scale`` multiplies what backward starts from (mixed precision's fp16 scale); the loss
    returned is not scaled."""
    stages = grid.size("pipe")
    limit = stages if limit is None else limit
    if limit < 1:
        raise ValueError(f"pipeline limit {limit}: at least one microbatch must be in flight")
    pieces, weights = split_microbatches((inputs, targets), microbatches)
    chunks_in, chunks_out = [piece[0] for piece in pieces], [piece[1] for piece in pieces]
    sizes = [len(chunk) for chunk in chunks_in]
    seq = inputs.shape[1]
    # Stage s holds at most limit - s microbatches: as many as can still come back to it
    # while the first stage holds limit (1F1B's warm-up depth), so a gradient that arrives
    # soon is not queued behind forwards whose gradients come late.
    cap = max(1, limit - grid.coord("pipe"))
    stats = PipelineStats(microbatches)
    kinds = (() if model.first else (FORWARD,)) + (() if model.last else (BACKWARD,))
    inbox = Inbox(grid, sizes, lambda r: model.stream_shape(r, seq), kinds, limit,
                  getattr(model, "stage_axes", ("x", "y", "z")))
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = {}
    sends: list[comm.Handle] = []
    loss_sum = torch.zeros(1, device=grid.device)
    started = finished = 0

    def forward(micro: int, received: torch.Tensor | None) -> None:
        nonlocal finished
        stats.order.append(f"F{micro}")
        stage_in = chunks_in[micro] if model.first else received.requires_grad_()
        if model.last:
            loss = model.stage_forward(stage_in, chunks_out[micro])
            loss_sum.add_(loss.detach() * weights[micro])
            stats.order.append(f"B{micro}")
            weighted_backward(loss, weights[micro], loss_scale)
            finished += 1
            sends.append(_send(grid, stage_in.grad, BACKWARD, micro, model.stream_shape(sizes[micro], seq)))
            return
        out = model.stage_forward(stage_in)
        extra = _stage_loss(model)
        if extra is not None:
            loss_sum.add_(extra.detach() * weights[micro])
        saved[micro] = (None if model.first else stage_in, out, extra)
        stats.max_in_flight = max(stats.max_in_flight, len(saved))
        sends.append(_send(grid, saved[micro][1].detach(), FORWARD, micro, model.stream_shape(sizes[micro], seq)))

    def start_next() -> None:
        nonlocal started
        if started < microbatches:
            started += 1
            forward(started - 1, None)

    def backward(micro: int, grad: torch.Tensor) -> None:
        nonlocal finished
        stats.order.append(f"B{micro}")
        stage_in, out, extra = saved.pop(micro)
        if extra is None:
            out.backward(grad)
        else:                                       # the stage's own loss, weighted as the last stage's
            torch.autograd.backward([out, extra], [grad, torch.full_like(extra, weights[micro] * loss_scale)])
        finished += 1
        if model.first:
            start_next()
        else:
            sends.append(_send(grid, stage_in.grad, BACKWARD, micro, model.stream_shape(sizes[micro], seq)))

    if model.first:
        for _ in range(min(limit, microbatches)):
            start_next()
    while finished < microbatches:
        kind, micro, tensor = inbox.take(forward=len(saved) < cap)
        if kind == FORWARD:
            forward(micro, tensor)
        else:
            backward(micro, tensor)
    for handle in sends:
        handle.wait()
    inbox.close()
    comm.all_reduce(grid, loss_sum, "pipe")          # the last stage's loss, and the others' own
    return loss_sum[0], stats


def _stage_loss(model: nn.Module) -> torch.Tensor | None:
    """What a stage before the last adds to the loss at its last forward (``model.stage_loss()``), where it
    has any that needs a gradient; None otherwise."""
    if model.last or not hasattr(model, "stage_loss"):
        return None
    extra = model.stage_loss()
    return extra if torch.is_tensor(extra) and extra.requires_grad else None


@torch.no_grad()
def evaluate_pipeline(model: nn.Module, grid: Grid, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean loss of this rank's shard, forward only, stage after stage (no microbatches:
    nothing is kept for a backward); on every stage."""
    shape, dtype = model.stream_shape(*inputs.shape[:2])
    h = inputs if model.first else comm.recv(grid, torch.empty(shape, dtype=dtype, device=grid.device), "pipe",
                                             -1, FORWARD).wait()
    out = model.stage_forward(h, targets if model.last else None)
    loss = torch.zeros(1, device=grid.device)
    if model.last:
        loss += out
    else:
        _send(grid, out, FORWARD, 0, (shape, dtype)).wait()
        loss += model.stage_loss() if hasattr(model, "stage_loss") else 0.0
    comm.all_reduce(grid, loss, "pipe")
    return loss[0]
