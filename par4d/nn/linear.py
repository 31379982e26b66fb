"""Algorithm 1 of the 4D paper: one fully connected layer on the x * y * z grid.

Paper notation ``O = I W`` with ``I`` (m x k) and ``W`` (k x n); PyTorch stores
``A = W^T`` (n x k). Rank g(i, j, l) of a *normal* layer holds ``I_{l,j}`` (rows
block l over z, in-features block j over y) and ``Ŵ_{j,i}``: the (n/G_x x k/G_y)
block of A for out-features i and in-features j, of which it stores only its
1/G_z row shard. A *transposed* layer swaps the roles of x and y, so a normal
layer's output layout is exactly a transposed layer's input layout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from par4d import comm
from par4d.grid import Grid
from par4d.layout import Placement, Split, place
from par4d.nn.base import ShardedModule

if TYPE_CHECKING:
    from par4d.nn.gemm import GemmPlan


def _mm(gemm: GemmPlan | None, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    """``a @ b`` (2-D), in the form the layer's GEMM plan chose, if it has one
    (contiguous: the result is all-reduced in place)."""
    return a @ b if gemm is None else gemm.mm(a, b, name).contiguous()


class _Algorithm1(torch.autograd.Function):
    """all-gather_z(Ŵ) + all-reduce over the in-axis in forward;
    all-reduce over the out-axis + reduce-scatter_z of dŴ in backward."""

    @staticmethod
    def forward(ctx, inp, w_shard, bias, grid: Grid, in_axis: str, out_axis: str, gemm: GemmPlan | None):
        w = comm.all_gather(grid, w_shard, "z")            # (n/G_out, k/G_in)
        rows = inp.reshape(-1, inp.shape[-1])                # (rows, k/G_in)
        out = _mm(gemm, rows, w.t(), "forward").reshape(*inp.shape[:-1], w.shape[0])  # partial over in_axis
        comm.all_reduce(grid, out, in_axis)                  # O_{l,i}
        if bias is not None:
            out += bias                                      # after the sum: bias counted once
        ctx.save_for_backward(inp, w)                        # the paper caches I and W
        ctx.grid, ctx.out_axis, ctx.has_bias, ctx.gemm = grid, out_axis, bias is not None, gemm
        return out

    @staticmethod
    def backward(ctx, grad_out):
        inp, w = ctx.saved_tensors
        grid = ctx.grid
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])  # (rows, n/G_out)
        grad_in = None
        if ctx.needs_input_grad[0]:                          # not for a network's input
            grad_in = _mm(ctx.gemm, rows_out, w, "input-grad").reshape(*grad_out.shape[:-1], w.shape[1])
            comm.all_reduce(grid, grad_in, ctx.out_axis)     # (..., k/G_in), was partial over out_axis
        grad_w = _mm(ctx.gemm, rows_out.t(), inp.reshape(-1, inp.shape[-1]), "weight-grad")  # partial over z
        grad_w_shard = comm.reduce_scatter(grid, grad_w, "z")
        grad_b = rows_out.sum(0) if ctx.has_bias else None  # partial over z and data
        return grad_in, grad_w_shard, grad_b, None, None, None, None


class Linear(ShardedModule):
    """``y = x A^T + b`` with A split by Algorithm 1 over the grid.

    Input ``(..., in_features / G_in)``, rows split over data and z; output
    ``(..., out_features / G_out)``, where (G_in, G_out) = (y, x) for a normal layer
    and (x, y) for ``transposed=True``.

    ``out_chunks=c`` treats the out-features as c equal chunks (e.g. q, k, v) each
    split over the out-axis, so a rank's output is ``[chunk_0 block, ..., chunk_c-1 block]``.

    Initialization draws the full weight from ``seed`` alone (``nn.Linear``'s
    uniform(-1/sqrt(k), 1/sqrt(k))), so the assembled weight is the same on every grid.

    Placement (:mod:`par4d.layout`): the weight's out-features (dim 0) are cut per chunk
    over the out-axis, its in-features (dim 1) over the in-axis, and each resulting block's
    rows over z (Algorithm 1's Ŵ); the bias's out-features per chunk over the out-axis.

    ``gemm``: a :class:`~par4d.nn.gemm.GemmPlan` for this layer's three matmuls, or None
    (plain ``a @ b``); :func:`tune` sets it on every Linear of a model.
    """

    gemm: GemmPlan | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, transposed: bool = False, *,
                 grid: Grid, out_chunks: int = 1, seed: int = 0, name: str = "Linear", initialize: bool = True):
        super().__init__()
        self.in_axis, self.out_axis = ("x", "y") if transposed else ("y", "x")
        g_in, g_out, g_z = grid.size(self.in_axis), grid.size(self.out_axis), grid.size("z")
        where = f"{name}(in_features={in_features}, out_features={out_features}, transposed={transposed})"
        if in_features % g_in:
            raise ValueError(f"{where}: in_features={in_features} is not divisible by {self.in_axis}={g_in}")
        if out_features % (out_chunks * g_out):
            raise ValueError(f"{where}: out_features={out_features} is not divisible by "
                             f"out_chunks * {self.out_axis} = {out_chunks} * {g_out} = {out_chunks * g_out}")
        if (out_features // g_out) % g_z:
            raise ValueError(f"{where}: the {out_features // g_out} out-features per {self.out_axis}-block "
                             f"(out_features / {self.out_axis}={g_out}) are not divisible by z={g_z}")
        self.grid, self.transposed, self.out_chunks = grid, transposed, out_chunks
        self.in_features, self.out_features = in_features, out_features
        out_split = Split(0, self.out_axis, chunks=out_chunks)
        # z sums Ŵ's gradient (the reduce-scatter); the bias is replicated over z and the in-axis.
        self.weight = place(nn.Parameter(torch.empty(out_features // (g_out * g_z), in_features // g_in,
                                                     device=grid.device)),
                            Placement((out_split, Split(1, self.in_axis), Split(0, "z")), grad_sum=("data",)))
        self.bias = None
        if bias:
            self.bias = place(nn.Parameter(torch.empty(out_features // g_out, device=grid.device)),
                              Placement((out_split,), grad_sum=("z", "data")))
        if grid.device.type == "meta" or not initialize:
            return  # shapes only (a virtual grid), or the caller loads full tensors next
        generator = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(in_features)
        weight = torch.empty(out_features, in_features).uniform_(-bound, bound, generator=generator)
        state = {"weight": weight}
        if bias:
            state["bias"] = torch.empty(out_features).uniform_(-bound, bound, generator=generator)
        self.load_full_state(state)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return _Algorithm1.apply(inp, self.weight, self.bias, self.grid, self.in_axis, self.out_axis, self.gemm)

    def full_weight(self, grad: bool = False) -> torch.Tensor:
        """The full ``(out, in)`` weight (or its gradient) on every rank (collective)."""
        return self.full_tensor(self.weight, grad)

    def full_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The full ``(out,)`` bias (or its gradient) on every rank (collective)."""
        if self.bias is None:
            return None
        return self.full_tensor(self.bias, grad)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"transposed={self.transposed}, bias={self.bias is not None}, shard={tuple(self.weight.shape)}")


def tune(model: nn.Module, plan: GemmPlan | None) -> nn.Module:
    """Run the matmuls of every par4d Linear of ``model`` through ``plan`` (None: plain
    ``a @ b``); returns the model."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemm = plan
    return model
