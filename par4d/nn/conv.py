"""Algorithm 1 of the 4D paper for a 2-D convolution: in-channels play k, out-channels n.

A convolution is a matmul per output pixel whose k is the in-channels times the kernel's
taps, so the paper's layout carries over: rank g(i, j, l) of a *normal* layer holds the
input's channel block j (over y) of its samples (over z and data) and Ŵ_{j,i}, the
(C_out/G_x x C_in/G_y x kh x kw) block of the weight, of which it stores only its 1/G_z
shard of the out-channels. Forward all-gathers Ŵ over z, convolves its channel block and
all-reduces the partial sums over the in-axis; backward all-reduces the input gradient
over the out-axis and reduce-scatters the weight gradient over z. A *transposed* layer
swaps x and y, so a normal layer's output is a transposed layer's input, as for
:class:`par4d.nn.Linear`. Activations are ``(B, C / G_in, H, W)``: channels are dim 1.

The overlaps (``par4d.overlap``) act on it as on :class:`par4d.nn.Linear`: Algorithm 1's
collectives and their waits are the same whatever the local arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

from par4d.grid import Grid, Indivisible
from par4d.nn.algorithm1 import Algorithm1, Algorithm1Layer, algorithm1_parameters


class Conv2d(Algorithm1Layer):
    """``nn.Conv2d`` (groups=1, zero padding, no dilation) with its weight split by Algorithm 1.

    Input ``(B, in_channels / G_in, H, W)``, samples split over data and z; output
    ``(B, out_channels / G_out, H', W')``, where (G_in, G_out) = (y, x) for a normal layer
    and (x, y) for ``transposed=True``. Initialization draws the full weight and bias from
    ``seed`` alone, as ``nn.Conv2d``'s (uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in =
    in_channels x kh x kw), so the assembled layer is the same on every grid.

    Placement (:mod:`par4d.layout`): the weight's out-channels (dim 0) over the out-axis, then
    each block's over z (Ŵ); its in-channels (dim 1) over the in-axis; the bias over the
    out-axis.

    ``input_layout`` / ``output_layout``: ``"sharded"`` (above) or ``"whole"`` channels on every
    rank of the axis, as :class:`par4d.nn.Linear`'s features."""

    feature_dim = 1     # channels

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int], stride: int = 1,
                 padding: int = 0, bias: bool = True, transposed: bool = False, *, grid: Grid, seed: int = 0,
                 name: str = "Conv2d", initialize: bool = True, input_layout: str = "sharded",
                 output_layout: str = "sharded"):
        super().__init__()
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        where = (f"{name}(in_channels={in_channels}, out_channels={out_channels}, kernel_size={(kh, kw)}, "
                 f"transposed={transposed})")
        self._set_layouts(where, transposed, input_layout, output_layout)
        g_in, g_out, g_z = grid.size(self.in_axis), grid.size(self.out_axis), grid.size("z")
        if min(in_channels, out_channels, kh, kw, stride) < 1 or padding < 0:
            raise ValueError(f"{where}: channels, kernel and stride must be >= 1 and padding >= 0 "
                             f"(stride={stride}, padding={padding})")
        if in_channels % g_in:
            raise Indivisible(f"{where}: in_channels={in_channels} is not divisible by {self.in_axis}={g_in}")
        if out_channels % (g_out * g_z):
            raise Indivisible(f"{where}: out_channels={out_channels} is not divisible by {self.out_axis} * z = "
                              f"{g_out} * {g_z} = {g_out * g_z}")
        self.grid, self.transposed = grid, transposed
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, (kh, kw)
        self.stride, self.padding = stride, padding
        algorithm1_parameters(self, out_channels, in_channels, (kh, kw), bias, 1, seed, initialize)
        self.plain = self.local_only()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return F.conv2d(self.take(inp), self.weight, self.bias, self.stride, self.padding)
        return self.give(Algorithm1.apply(self.take(inp), self.weight, self.bias, self))

    # Algorithm 1's local arithmetic, a convolution (par4d.nn.algorithm1.Algorithm1 runs the collectives).
    def local_forward(self, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv2d(inp, w, None, self.stride, self.padding).contiguous()   # all-reduced in place

    def local_input_grad(self, grad_out: torch.Tensor, w: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        return conv2d_input(inp.shape, w, grad_out.contiguous(), self.stride, self.padding).contiguous()

    def local_weight_grad(self, grad_out: torch.Tensor, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return conv2d_weight(inp, w.shape, grad_out.contiguous(), self.stride, self.padding)

    def local_bias_grad(self, grad_out: torch.Tensor) -> torch.Tensor:
        return grad_out.sum((0, 2, 3))

    def add_bias(self, out: torch.Tensor, bias: torch.Tensor) -> None:
        out += bias.view(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, transposed={self.transposed}, "
                f"bias={self.bias is not None}, shard={tuple(self.weight.shape)}{self.layouts_repr()}")
