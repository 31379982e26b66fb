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
import torch.nn.functional as F

from par4d import comm
from par4d.grid import Grid
from par4d.layout import Placement, Split, place
from par4d.nn.base import ShardedModule
from par4d.nn.runtime import LayerRuntime
from par4d.overlap import Overlap

if TYPE_CHECKING:
    from par4d.nn.gemm import GemmPlan


def _mm(gemm: GemmPlan | None, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    """``a @ b`` (2-D), in the form the layer's GEMM plan chose, if it has one
    (contiguous: the result is all-reduced in place)."""
    return a @ b if gemm is None else gemm.mm(a, b, name).contiguous()


class _Algorithm1(torch.autograd.Function):
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
    def forward(ctx, inp, w_shard, bias, layer: Linear):
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

    ``runtime``: the overlaps of this layer's collectives, shared by the Linears of one
    model (:func:`set_overlap` sets it); None: every collective is waited for where issued.
    """

    gemm: GemmPlan | None = None
    runtime: LayerRuntime | None = None   # the model's overlap runtime (set_overlap); None: synchronous

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
        algorithm1_parameters(self, out_features, in_features, (), bias, out_chunks, seed, initialize)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if self.gemm is None and self.grid.size(self.in_axis, self.out_axis, "z") == 1:
            return F.linear(inp, self.weight, self.bias)   # nothing to gather or sum: PyTorch's fused layer
        return _Algorithm1.apply(inp, self.weight, self.bias, self)

    # Algorithm 1's local arithmetic (_Algorithm1 runs the collectives around it).
    def local_forward(self, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = inp.reshape(-1, inp.shape[-1])                                    # (rows, k/G_in)
        return _mm(self.gemm, rows, w.t(), "forward").reshape(*inp.shape[:-1], w.shape[0])

    def local_input_grad(self, grad_out: torch.Tensor, w: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])                      # (rows, n/G_out)
        return _mm(self.gemm, rows_out, w, "input-grad").reshape(*grad_out.shape[:-1], w.shape[1])

    def local_weight_grad(self, grad_out: torch.Tensor, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])
        return _mm(self.gemm, rows_out.t(), inp.reshape(-1, inp.shape[-1]), "weight-grad")

    def local_bias_grad(self, grad_out: torch.Tensor) -> torch.Tensor:
        return grad_out.reshape(-1, grad_out.shape[-1]).sum(0)

    def add_bias(self, out: torch.Tensor, bias: torch.Tensor) -> None:
        out += bias

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


def set_overlap(model: nn.Module, settings: Overlap | None) -> nn.Module:
    """Overlap the collectives of every par4d Linear of ``model`` as ``settings`` say (None:
    synchronous), with one runtime for the whole model: each forward of ``model`` begins an
    iteration of its recorded gather order (OAG). Returns the model."""
    previous = getattr(model, "par4d_runtime", None)
    if previous is not None and previous.hook is not None:
        previous.hook.remove()
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    grids = {id(layer.grid) for layer in layers}
    if len(grids) > 1:
        raise ValueError(f"set_overlap: the Linears of {type(model).__name__} live on {len(grids)} different grids; "
                         f"one model's overlap runtime serves one grid")
    runtime = None
    if settings is not None and layers:
        runtime = LayerRuntime(layers[0].grid, settings)
        runtime.hook = model.register_forward_pre_hook(lambda module, args: runtime.gathers.begin())
    for layer in layers:
        layer.runtime = runtime
    model.par4d_runtime, model.par4d_overlap = runtime, settings
    return model
