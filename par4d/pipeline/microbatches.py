"""Microbatches: a rank's batch shard cut into pieces whose weighted losses and accumulated
gradients are the whole shard's (the pipeline's microbatches, and ``train_step``'s gradient
accumulation without a pipeline)."""

from __future__ import annotations

import torch


def split_microbatches(inputs: tuple[torch.Tensor, ...], microbatches: int
                       ) -> tuple[list[tuple[torch.Tensor, ...]], list[float]]:
    """This rank's batch shard ``inputs`` (each cut along dim 0, rows alike) in ``microbatches``
    pieces (``torch.tensor_split``: the first ``rows % microbatches`` one row longer), and each
    piece's weight, its share of the rows: the pieces' mean losses so weighted sum to the shard's
    mean loss, and their backward passes accumulate the shard's gradient (the pipeline's
    microbatches, and ``train_step``'s gradient accumulation without one)."""
    rows = inputs[0].shape[0]
    if any(t.shape[0] != rows for t in inputs):
        raise ValueError(f"microbatches cut every input along dim 0, but their rows differ: "
                         f"{[t.shape[0] for t in inputs]}")
    if not 1 <= microbatches <= rows:
        raise ValueError(f"microbatches={microbatches}: give 1 to this rank's {rows} sequences "
                         f"(the batch over data x z)")
    pieces = list(zip(*(torch.tensor_split(t, microbatches) for t in inputs)))
    return pieces, [len(piece[0]) / rows for piece in pieces]


def weighted_backward(loss: torch.Tensor, weight: float, loss_scale: float = 1.0) -> None:
    """Backward from a microbatch's mean ``loss`` times its ``weight`` (:func:`split_microbatches`)
    and mixed precision's ``loss_scale``; gradients add to ``.grad``. A factor of 1 multiplies
    nothing (one microbatch, no scale: the plain ``loss.backward()``)."""
    factor = weight * loss_scale
    (loss * factor if factor != 1.0 else loss).backward()
