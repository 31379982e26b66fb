"""Algorithm 1's collectives around any layer's local arithmetic, its parameters' placement,
and the layouts of a layer's input and output.

The autograd Function and the weight and bias set-up that :class:`par4d.nn.Linear` and
:class:`par4d.nn.Conv2d` share (and so every layer of par4d's models and every one
``par4d.parallelize`` makes): a layer brings its local arithmetic (a matmul, a convolution) and
its axes (``in_axis``, ``out_axis``); this module brings the all-gather over z, the all-reduces
over the in- and out-axes and the reduce-scatter of the weight's gradient, with the overlap
runtime's waits (``par4d.overlap``).

**Layouts in and out**, as data on the layer (as torch's ``ColwiseParallel(input_layouts=,
output_layouts=)``): ``"sharded"`` features are split over the layer's axis (its in-axis for the
input, its out-axis for the output: how Algorithm 1 takes and leaves them, so a normal layer
feeds a transposed one with no collective); ``"whole"`` features are on every rank of that axis,
as a layer nobody parallelized takes and gives them: the input is cut (free) and the output
all-gathered. **The weight's storage**: ``"out_in"`` as ``nn.Linear`` and ``nn.Conv2d`` keep it,
or ``"in_out"`` as Hugging Face's ``Conv1D`` (GPT-2) does, cut as the transpose of the former's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from par4d import comm
from par4d.layout import BATCH_AXES, REPLICAS, Placement, Split, place
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import GatherFeatures, SplitFeatures

LAYOUTS = ("sharded", "whole")
"""A layer's input or output features: split over the layer's axis, or whole on every rank of it."""
WEIGHT_LAYOUTS = ("out_in", "in_out")
"""How a layer stores its weight: (out, in, ...) as ``nn.Linear``; (in, out) as Hugging Face's ``Conv1D``."""


def check_layout(where: str, what: str, value: str, valid: tuple[str, ...] = LAYOUTS) -> None:
    """Raise a ValueError naming ``where`` unless ``value`` is one of ``valid``."""
    if value not in valid:
        raise ValueError(f"{where}: {what}={value!r}; give one of {', '.join(map(repr, valid))}")


class Algorithm1Layer(ShardedModule):
    """A layer whose weight Algorithm 1 splits: what :class:`Algorithm1` and the overlap runtime
    ask of :class:`par4d.nn.Linear` and :class:`par4d.nn.Conv2d`.

    Subclasses set ``grid``, ``in_axis`` / ``out_axis`` (:meth:`_set_layouts`), ``weight``
    and ``bias`` (:func:`algorithm1_parameters`), ``plain`` (:meth:`local_only`, once the grid is set),
    and give the local arithmetic
    (``local_forward``, ``local_input_grad``, ``local_weight_grad``, ``local_bias_grad``,
    ``add_bias``); ``feature_dim`` is the activations' dim that the axes split.
    """

    runtime = None          # the model's overlap runtime (par4d.overlap.set_overlap); None: every wait where issued
    gemm = None             # a plan for the local GEMMs (par4d.nn.gemm, par4d.nn.float8); None: plain a @ b
    feature_dim = -1        # features are the last dim (a convolution's channels: dim 1)
    input_layout = output_layout = "sharded"
    weight_layout = "out_in"
    # The grid splits nothing of the layer (its axes and z are 1): torch's own layer runs, whatever the layouts, since
    # cutting whole features to this rank's block and gathering them back are then no-ops (but were two autograd
    # nodes and a dozen Python calls a layer: a transformers model's data-parallel step has 29 such Linears).
    # Decided once, at build: the grid and the layouts are the layer's for good.
    plain = False

    def _set_layouts(self, where: str, transposed: bool, input_layout: str, output_layout: str,
                     weight_layout: str = "out_in") -> None:
        """The axes (normal: in over y, out over x; transposed: swapped) and the layouts, checked."""
        check_layout(where, "input_layout", input_layout)
        check_layout(where, "output_layout", output_layout)
        check_layout(where, "weight_layout", weight_layout, WEIGHT_LAYOUTS)
        self.in_axis, self.out_axis = ("x", "y") if transposed else ("y", "x")
        self.input_layout, self.output_layout, self.weight_layout = input_layout, output_layout, weight_layout

    def weight_rows(self) -> torch.Tensor:
        """The weight shard as Algorithm 1's Ŵ: (out / (G_out G_z), in / G_in, ...), rows over z,
        which the all-gather concatenates (a transposed view if stored (in, out))."""
        return self.weight.t() if self.weight_layout == "in_out" else self.weight

    def take(self, inp: torch.Tensor) -> torch.Tensor:
        """The input as Algorithm 1 takes it: whole features cut to this rank's block of the in-axis (on a
        :attr:`plain` layer, the whole features are that block: only made contiguous, as the cut makes them)."""
        if self.input_layout == "sharded":
            return inp
        if self.plain:
            return inp.contiguous()
        if self.feature_dim == -1:
            return SplitFeatures.apply(inp, self.grid, self.in_axis)
        moved = SplitFeatures.apply(inp.movedim(self.feature_dim, -1), self.grid, self.in_axis)
        return moved.movedim(-1, self.feature_dim).contiguous()

    def give(self, out: torch.Tensor) -> torch.Tensor:
        """The output as the layer's ``output_layout`` says: whole features all-gathered over the out-axis."""
        if self.output_layout == "sharded":
            return out
        if self.feature_dim == -1:
            return GatherFeatures.apply(out, self.grid, self.out_axis)
        return GatherFeatures.apply(out.movedim(self.feature_dim, -1), self.grid, self.out_axis).movedim(
            -1, self.feature_dim)

    def layouts_repr(self) -> str:
        """The layouts that are not the defaults, for ``extra_repr``."""
        return "".join(f", {name}={getattr(self, name)!r}" for name, default in (
            ("input_layout", "sharded"), ("output_layout", "sharded"), ("weight_layout", "out_in"))
            if getattr(self, name) != default)

    def local_only(self) -> bool:
        """Whether the grid splits nothing of this layer (then torch's own layer runs: nothing to gather or sum)."""
        return self.grid.size(self.in_axis, self.out_axis, "z") == 1


class Algorithm1(torch.autograd.Function):
    """all-gather_z(Ŵ) + all-reduce over the in-axis in forward;
    all-reduce over the out-axis + reduce-scatter_z of dŴ in backward.

    With the layer's runtime (:mod:`par4d.overlap.runtime`) the gather may have been
    prefetched (OAG) or cached, the backward all-reduce is waited for after the weight
    gradient is computed (OAR), and the reduce-scatter after the whole backward pass
    (ORS). Only waits move: the arithmetic is the same in every case.

    The local arithmetic is the layer's (``local_forward``, ``local_input_grad``,
    ``local_weight_grad``, ``local_bias_grad``, ``add_bias``): a matmul here, a convolution
    for :class:`par4d.nn.Conv2d`; the collectives around it are Algorithm 1's either way.
    """

    @staticmethod
    def forward(ctx, inp, w_shard, bias, layer: Algorithm1Layer):
        grid, runtime = layer.grid, layer.runtime
        # W (n/G_out, k/G_in, ...), whichever way the weight is stored (w_shard: layer.weight, or one expert's
        # slice of a mixture's stacked weights; passed for autograd)
        rows = w_shard.t() if layer.weight_layout == "in_out" else w_shard
        w = runtime.gathers.gather(layer) if runtime else comm.all_gather(grid, rows, "z")
        # O_{l,i}: partial over in_axis, summed there (xy: chunk by chunk, each sum behind the next chunk's matmul)
        out = _in_chunks(layer, layer.in_axis, lambda part: layer.local_forward(part, w), inp)
        if bias is not None:
            layer.add_bias(out, bias)                        # after the sum: bias counted once
        ctx.save_for_backward(inp, w)                        # the paper caches I and W
        ctx.layer, ctx.has_bias = layer, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        inp, w = ctx.saved_tensors
        layer = ctx.layer
        grid, runtime = layer.grid, layer.runtime
        overlap = runtime.overlap if runtime else None
        grad_in = pending_in = None
        if ctx.needs_input_grad[0]:                          # not for a network's input
            # partial over out_axis; OAR: summed while the weight gradient is computed (xy: by chunks of rows)
            grad_in, pending_in = _in_chunks(layer, layer.out_axis,
                                             lambda part, rows: layer.local_input_grad(part, w, rows), grad_out, inp,
                                             defer=bool(overlap and overlap.all_reduce))
        grad_w_shard = None
        if ctx.needs_input_grad[1]:
            grad_w = layer.local_weight_grad(grad_out, inp, w)  # partial over z
            in_out = layer.weight_layout == "in_out"
            if overlap and overlap.reduce_scatter:
                # ORS: inside the step's backward the runtime defers it (None here) and accumulates it after.
                grad_w_shard = runtime.deferred.reduce_scatter(grid, layer, grad_w, in_out)
            else:
                grad_w_shard = comm.reduce_scatter(grid, grad_w, "z")
                grad_w_shard = grad_w_shard.t() if in_out else grad_w_shard
        grad_b = layer.local_bias_grad(grad_out) if ctx.has_bias else None  # partial over z and data
        for handle in pending_in or ():
            handle.wait()
        return grad_in, grad_w_shard, grad_b, None


def _rows(layer: Algorithm1Layer, t: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """``t`` cut into ``chunks`` runs of rows (every dim but the features: a Linear's tokens, a
    convolution's images), the empty ones left out."""
    flat = t.reshape(-1, t.shape[-1]) if layer.feature_dim == -1 else t
    return [part for part in flat.tensor_split(chunks) if part.shape[0]]


def _in_chunks(layer: Algorithm1Layer, axis: str, compute, t: torch.Tensor, also: torch.Tensor | None = None,
               defer: bool = False):
    """``compute`` (a local matmul) summed over ``axis``: whole, or, with the layer's overlap runtime's
    ``row_chunks`` > 1, by chunks of ``t``'s rows (and ``also``'s, cut alike), each chunk's all-reduce
    waited for after the next chunk's matmul under ``xy`` and where issued without it. Forward
    (``also`` None): returns the sum. Backward: returns (the sum, the handles still to wait for), where
    ``defer`` (OAR) leaves every chunk's for the caller. Every rank of ``axis`` holds the same rows, so
    all issue the same chunks."""
    overlap = layer.runtime.overlap if layer.runtime else None
    # Float8 with one scale over all rows (par4d.nn.float8): a run of rows would get a scale of its own
    chunks = overlap.row_chunks if overlap and not (layer.gemm is not None and layer.gemm.whole_rows) else 1
    backward = also is not None
    parts = _rows(layer, t, chunks) if chunks > 1 and layer.grid.size(axis) > 1 else []
    if len(parts) < 2:                 # one chunk (or no rows): nothing to hide a sum behind
        out = compute(t, also) if backward else compute(t)
        pending = comm.all_reduce(layer.grid, out, axis, async_op=defer)
        return (out, [pending] if defer else []) if backward else out
    others = _rows(layer, also, chunks) if backward else [None] * len(parts)
    whole, start, handles = None, 0, []
    for part, other in zip(parts, others):
        out = compute(part, other) if backward else compute(part)
        if whole is None:     # each chunk is copied into its rows of the whole and summed there in place (one copy,
                              # as torch.cat would make; nothing to assemble after the waits)
            whole = out.new_empty((t.numel() // t.shape[-1] if layer.feature_dim == -1 else t.shape[0], *out.shape[1:]))
        rows = whole[start:start + out.shape[0]]
        rows.copy_(out)
        start += out.shape[0]
        handles.append(comm.all_reduce(layer.grid, rows, axis, async_op=overlap.xy or defer))
        if overlap.xy and not defer and len(handles) > 1:
            handles[-2].wait()                   # the previous chunk's sum ran behind this chunk's matmul
    whole = whole.reshape(*t.shape[:-1], whole.shape[-1]) if layer.feature_dim == -1 else whole
    waiting = [h for h in handles if not isinstance(h, torch.Tensor)]
    if backward and defer:
        return whole, waiting
    for handle in waiting:
        handle.wait()
    return (whole, []) if backward else whole


def algorithm1_parameters(layer: Algorithm1Layer, out_features: int, in_features: int, kernel: tuple[int, ...],
                          bias: bool, out_chunks: int, seed: int, initialize: bool) -> None:
    """Algorithm 1's weight and bias on ``layer`` (its ``grid``, axes and layouts set): the
    weight's out-features (dim 0) cut per chunk over the out-axis, its in-features (dim 1) over
    the in-axis, each block's rows over z (Ŵ), the ``kernel`` dims whole (stored ``"in_out"``:
    the transpose of that, dims swapped); the bias per chunk over the out-axis. Initialised as ``nn.Linear``
    and ``nn.Conv2d`` are (uniform within 1/sqrt(fan-in), drawn whole from ``seed``) unless
    the grid is virtual (meta: shapes only) or ``initialize`` is False (the caller loads next)."""
    grid = layer.grid
    g_in, g_out, g_z = grid.size(layer.in_axis), grid.size(layer.out_axis), grid.size("z")
    out_split = Split(0, layer.out_axis, chunks=out_chunks)
    # z sums Ŵ's gradient (the reduce-scatter); the bias is replicated over z and the in-axis.
    rows, cols = out_features // (g_out * g_z), in_features // g_in
    assert layer.weight_layout == "out_in" or not kernel, "a weight stored (in, out) is a matrix"
    if layer.weight_layout == "in_out":     # (in, out): the same shards, transposed
        layer.weight = place(nn.Parameter(torch.empty(cols, rows, device=grid.device)),
                             Placement((Split(1, layer.out_axis, chunks=out_chunks), Split(0, layer.in_axis),
                                        Split(1, "z")), grad_sum=REPLICAS))
    else:
        layer.weight = place(nn.Parameter(torch.empty(rows, cols, *kernel, device=grid.device)),
                             Placement((out_split, Split(1, layer.in_axis), Split(0, "z")), grad_sum=REPLICAS))
    layer.bias = None
    if bias:
        layer.bias = place(nn.Parameter(torch.empty(out_features // g_out, device=grid.device)),
                           Placement((out_split,), grad_sum=BATCH_AXES))
    if grid.device.type == "meta" or not initialize:
        return
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(in_features * math.prod(kernel))
    weight = torch.empty(out_features, in_features, *kernel).uniform_(-bound, bound, generator=generator)
    state = {"weight": weight.t() if layer.weight_layout == "in_out" else weight}
    if bias:
        state["bias"] = torch.empty(out_features).uniform_(-bound, bound, generator=generator)
    layer.load_full_state(state)
