"""Algorithm 1 of the 4D paper: one fully connected layer on the x * y * z grid.

Paper notation ``O = I W`` with ``I`` (m x k) and ``W`` (k x n); PyTorch stores
``A = W^T`` (n x k). Rank g(i, j, l) of a *normal* layer holds ``I_{l,j}`` (rows
block l over z, in-features block j over y) and ``Ŵ_{j,i}``: the (n/G_x x k/G_y)
block of A for out-features i and in-features j, of which it stores only its
1/G_z row shard. A *transposed* layer swaps the roles of x and y, so a normal
layer's output layout is exactly a transposed layer's input layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid, Indivisible
from par4d.nn.algorithm1 import Algorithm1, Algorithm1Layer, algorithm1_parameters

if TYPE_CHECKING:
    from par4d.nn.gemm import GemmPlan, LocalGemms


def _mm(gemm: LocalGemms | None, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    """``a @ b`` (2-D), in the form the layer's GEMM plan chose, if it has one
    (contiguous: the result is all-reduced in place)."""
    return a @ b if gemm is None else gemm.mm(a, b, name).contiguous()


class Linear(Algorithm1Layer):
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

    ``input_layout`` / ``output_layout``: ``"sharded"`` (Algorithm 1's, above) or ``"whole"``
    (every feature on every rank of the axis: cut on the way in, all-gathered on the way out), for
    a layer between layers nobody parallelized; ``weight_layout="in_out"`` stores the weight
    (in, out), as Hugging Face's ``Conv1D`` (:mod:`par4d.nn.algorithm1`).

    ``gemm``: a :class:`~par4d.nn.gemm.GemmPlan` for this layer's three matmuls (or a
    :class:`~par4d.nn.float8.Float8Gemm`: them in float8), or None
    (plain ``a @ b``); :func:`tune` sets it on every Linear of a model.

    ``runtime``: the overlaps of this layer's collectives, shared by the layers of one
    model (``par4d.overlap.set_overlap`` sets it); None: every collective is waited for where issued.
    """

    gemm: LocalGemms | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, transposed: bool = False, *,
                 grid: Grid, out_chunks: int = 1, seed: int = 0, name: str = "Linear", initialize: bool = True,
                 input_layout: str = "sharded", output_layout: str = "sharded", weight_layout: str = "out_in"):
        super().__init__()
        where = f"{name}(in_features={in_features}, out_features={out_features}, transposed={transposed})"
        self._set_layouts(where, transposed, input_layout, output_layout, weight_layout)
        g_in, g_out, g_z = grid.size(self.in_axis), grid.size(self.out_axis), grid.size("z")
        if in_features % g_in:
            raise Indivisible(f"{where}: in_features={in_features} is not divisible by {self.in_axis}={g_in}")
        if out_features % (out_chunks * g_out):
            raise Indivisible(f"{where}: out_features={out_features} is not divisible by "
                              f"out_chunks * {self.out_axis} = {out_chunks} * {g_out} = {out_chunks * g_out}")
        if (out_features // g_out) % g_z:
            raise Indivisible(f"{where}: the {out_features // g_out} out-features per {self.out_axis}-block "
                              f"(out_features / {self.out_axis}={g_out}) are not divisible by z={g_z}")
        self.grid, self.transposed, self.out_chunks = grid, transposed, out_chunks
        self.in_features, self.out_features = in_features, out_features
        algorithm1_parameters(self, out_features, in_features, (), bias, out_chunks, seed, initialize)
        self.plain = self.local_only()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if self.plain and self.gemm is None:
            return F.linear(self.take(inp), self.weight_rows(), self.bias)
        return self.give(Algorithm1.apply(self.take(inp), self.weight, self.bias, self))

    # Algorithm 1's local arithmetic (Algorithm1 runs the collectives around it).
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
        """The full weight (or its gradient) as stored, ``(out, in)`` or ``(in, out)``, on every rank (collective)."""
        return self.full_tensor(self.weight, grad)

    def full_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The full ``(out,)`` bias (or its gradient) on every rank (collective)."""
        if self.bias is None:
            return None
        return self.full_tensor(self.bias, grad)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"transposed={self.transposed}, bias={self.bias is not None}, shard={tuple(self.weight.shape)}"
                f"{self.layouts_repr()}")


def tune(model: nn.Module, plan: GemmPlan | None) -> nn.Module:
    """Run the matmuls of every par4d Linear of ``model`` through ``plan`` (None: plain
    ``a @ b``); returns the model."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemm = plan
    return model
