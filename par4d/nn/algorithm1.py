"""Algorithm 1's collectives around any layer's local arithmetic, and its parameters' placement.

The autograd Function and the weight and bias set-up that :class:`par4d.nn.Linear`,
:class:`par4d.nn.Conv2d` and the layers ``par4d.parallelize`` makes all share: a layer brings
its local arithmetic (a matmul, a convolution) and its axes (``in_axis``, ``out_axis``); this
module brings the all-gather over z, the all-reduces over the in- and out-axes and the
reduce-scatter of the weight's gradient, with the overlap runtime's waits.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from par4d import comm
from par4d.layout import Placement, Split, place
from par4d.nn.base import ShardedModule


class Algorithm1(torch.autograd.Function):
    """all-gather_z(Ŵ) + all-reduce over the in-axis in forward;
    all-reduce over the out-axis + reduce-scatter_z of dŴ in backward.

    With the layer's runtime (:mod:`par4d.nn.runtime`) the gather may have been
    prefetched (OAG) or cached, the backward all-reduce is waited for after the weight
    gradient is computed (OAR), and the reduce-scatter after the whole backward pass
    (ORS). Only waits move: the arithmetic is the same in every case.

    The local arithmetic is the layer's (``local_forward``, ``local_input_grad``,
    ``local_weight_grad``, ``local_bias_grad``, ``add_bias``): a matmul here, a convolution
    for :class:`par4d.nn.Conv2d`; the collectives around it are Algorithm 1's either way.
    """

    @staticmethod
    def forward(ctx, inp, w_shard, bias, layer: ShardedModule):
        grid, runtime = layer.grid, layer.runtime
        w = runtime.gathers.gather(w_shard) if runtime else comm.all_gather(grid, w_shard, "z")  # (n/G_out, k/G_in)
        out = layer.local_forward(inp, w)                    # partial over in_axis
        comm.all_reduce(grid, out, layer.in_axis)            # O_{l,i}
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
            grad_in = layer.local_input_grad(grad_out, w, inp)
            # partial over out_axis; OAR: summed while the weight gradient is computed
            pending_in = comm.all_reduce(grid, grad_in, layer.out_axis, async_op=bool(overlap and overlap.all_reduce))
        grad_w_shard = None
        if ctx.needs_input_grad[1]:
            grad_w = layer.local_weight_grad(grad_out, inp, w)  # partial over z
            if overlap and overlap.reduce_scatter and runtime.deferred.armed and grid.size("z") > 1:
                # ORS: autograd gets no gradient here; the runtime accumulates it after backward.
                runtime.deferred.defer(layer.weight, comm.reduce_scatter(grid, grad_w, "z", async_op=True))
            else:
                grad_w_shard = comm.reduce_scatter(grid, grad_w, "z")
        grad_b = layer.local_bias_grad(grad_out) if ctx.has_bias else None  # partial over z and data
        if isinstance(pending_in, comm.Handle):
            pending_in.wait()
        return grad_in, grad_w_shard, grad_b, None


def algorithm1_parameters(layer: ShardedModule, out_features: int, in_features: int, kernel: tuple[int, ...],
                          bias: bool, out_chunks: int, seed: int, initialize: bool) -> None:
    """Algorithm 1's weight and bias on ``layer`` (a :class:`Linear` or a Conv2d, its ``grid``,
    ``in_axis`` and ``out_axis`` set): the weight's out-features (dim 0) cut per chunk over the
    out-axis, its in-features (dim 1) over the in-axis, each block's rows over z (Ŵ), the
    ``kernel`` dims whole; the bias per chunk over the out-axis. Initialised as ``nn.Linear``
    and ``nn.Conv2d`` are (uniform within 1/sqrt(fan-in), drawn whole from ``seed``) unless
    the grid is virtual (meta: shapes only) or ``initialize`` is False (the caller loads next)."""
    grid = layer.grid
    g_in, g_out, g_z = grid.size(layer.in_axis), grid.size(layer.out_axis), grid.size("z")
    out_split = Split(0, layer.out_axis, chunks=out_chunks)
    # z sums Ŵ's gradient (the reduce-scatter); the bias is replicated over z and the in-axis.
    layer.weight = place(nn.Parameter(torch.empty(out_features // (g_out * g_z), in_features // g_in, *kernel,
                                                  device=grid.device)),
                         Placement((out_split, Split(1, layer.in_axis), Split(0, "z")), grad_sum=("data",)))
    layer.bias = None
    if bias:
        layer.bias = place(nn.Parameter(torch.empty(out_features // g_out, device=grid.device)),
                           Placement((out_split,), grad_sum=("z", "data")))
    if grid.device.type == "meta" or not initialize:
        return
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(in_features * math.prod(kernel))
    state = {"weight": torch.empty(out_features, in_features, *kernel).uniform_(-bound, bound, generator=generator)}
    if bias:
        state["bias"] = torch.empty(out_features).uniform_(-bound, bound, generator=generator)
    layer.load_full_state(state)
