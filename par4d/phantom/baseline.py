"""The tensor-parallel baseline for phantom parallelism.

par4d's own Linear with x = p, alternating normal and transposed layers: that *is*
the conventional column/row (Megatron) scheme — a column-parallel layer followed by
a row-parallel one, one all-reduce of the activations forward per pair and one of
the input gradients backward. It is the strongest conventional TP baseline (fewer
and smaller collectives than the broadcast / all-gather / all-reduce /
reduce-scatter set of the phantom paper's Table II), so phantom is compared against
TP at its best.

Input: the full features (batch, n), replicated over x. Output: sharded over x
after an odd number of layers, replicated after an even number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.nn import Linear
from par4d.phantom.layers import feed_forward


class TensorParallelFFN(nn.Module):
    def __init__(self, n: int, depth: int, *, grid: Grid, activation: Callable[[torch.Tensor], torch.Tensor] = F.relu,
                 final_activation: bool = True, seed: int = 0):
        super().__init__()
        busy = [a for a in ("y", "z") if grid.size(a) > 1]
        if busy:
            raise ValueError(f"TensorParallelFFN runs on x and data; {', '.join(busy)} must be 1")
        self.activation, self.final_activation = activation, final_activation
        self.layers = nn.ModuleList(Linear(n, n, transposed=bool(i % 2), grid=grid, seed=seed * 1000 + i,
                                           name=f"layers.{i}") for i in range(depth))

    @property
    def output_sharded(self) -> bool:
        return len(self.layers) % 2 == 1

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return feed_forward(self.layers, y, self.activation, self.final_activation)
