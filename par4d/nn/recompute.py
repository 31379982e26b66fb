"""Activation recomputation over segments of blocks (``torch.utils.checkpoint``).

A network of blocks cut into segments of ``every`` blocks keeps only each segment's
input during the forward pass and recomputes the segment's activations in backward.
The async-pipeline paper's spacing (Section V-A; :func:`par4d.models.config.recompute_spacing`)
picks ``every`` as the divisor of the block count closest to its square root. The
recomputed forward runs the same operations on the same values, so gradients are
bit for bit those without recomputation (tested).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, noop_context_fn


def _run(blocks: Sequence[nn.Module], h: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        h = block(h, *extra)
    return h


@contextlib.contextmanager
def _within(outer: contextlib.AbstractContextManager, inner: Callable[[], contextlib.AbstractContextManager]):
    """``outer`` and, inside it, ``inner()`` (made when entered: a recomputation happens in backward)."""
    with outer, inner():
        yield


@contextlib.contextmanager
def flag_recomputation(blocks: Sequence[nn.Module]):
    """Tell the modules of ``blocks`` that keep a ``recomputing`` flag that their forward is a recomputation
    (a mixture's load is counted once per step, not again: :class:`par4d.nn.moe.Mixture`)."""
    flagged = [m for block in blocks for m in block.modules() if hasattr(m, "recomputing")]
    for module in flagged:
        module.recomputing = True
    try:
        yield
    finally:
        for module in flagged:
            module.recomputing = False


def run_blocks(blocks: Sequence[nn.Module], h: torch.Tensor, every: int, runtime=None,
               observe: Callable[[], contextlib.AbstractContextManager] | None = None,
               extra: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """``h`` through ``blocks`` in order (each given ``extra`` besides: a packed window's documents); with
    ``every`` > 0, each run of ``every`` blocks is one
    recomputed segment (its weights gathered again or taken from the cache of ``runtime``, the
    model's ``par4d.overlap`` LayerRuntime, if it has one). ``observe()``: a context entered around
    each segment's recomputation, inside torch's (``par4d.train.footprint`` counts what it keeps)."""
    if every <= 0:
        return _run(blocks, h, *extra)
    if len(blocks) % every:
        raise ValueError(f"recompute every {every} blocks: {len(blocks)} blocks do not split into such segments")
    base = runtime.gathers.checkpoint_contexts if runtime is not None else noop_context_fn
    for start in range(0, len(blocks), every):
        segment = blocks[start:start + every]

        def contexts(segment=segment):
            forward, recompute = base()
            recompute = _within(recompute, lambda: flag_recomputation(segment))
            return forward, recompute if observe is None else _within(recompute, observe)
        h = checkpoint(_run, segment, h, *extra, use_reentrant=False, context_fn=contexts)
    return h
