"""Phantom layers as a GPT's MLP (``GPTConfig(mlp="phantom")``), and the MLP's twin.

The residual stream, replicated over x, is split into x blocks (``SplitFeatures``:
slice forward, all-gather backward), runs fc -> GELU -> proj as phantom layers and is
gathered back (``GatherFeatures``: all-gather forward, slice backward: the gradient of
a replicated result needs no reduction). Both are factories for
:class:`par4d.models.GPT` and :class:`par4d.models.ReferenceGPT` (``mlp=``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.models.config import GPTConfig
from par4d.nn.collectives import GatherFeatures, SplitFeatures
from par4d.phantom.layers import PhantomLinear, PhantomLinearTwin


class PhantomMLP(nn.Module):
    """Phantom layers over x in place of the dense MLP (needs y = z = 1 and
    ``config.phantom_p`` equal to the grid's x)."""

    def __init__(self, config: GPTConfig, grid: Grid, name: str):
        super().__init__()
        if config.phantom_p != grid.size("x"):
            raise ValueError(f"GPTConfig.phantom_p={config.phantom_p} must equal the grid's x={grid.size('x')}")
        if grid.size("y") > 1 or grid.size("z") > 1:
            raise ValueError(f"a phantom MLP runs on x and data only; y={grid.size('y')} and "
                             f"z={grid.size('z')} must be 1")
        d, k = config.n_embd, config.phantom_k
        self.grid = grid
        self.fc = PhantomLinear(d, 4 * d, k, grid=grid, axis="x", name=f"{name}.fc", initialize=False)
        self.proj = PhantomLinear(4 * d, d, k, grid=grid, axis="x", name=f"{name}.proj", initialize=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = SplitFeatures.apply(h, self.grid, "x")                        # (B, T, D/G_x)
        return GatherFeatures.apply(self.proj(F.gelu(self.fc(local))), self.grid, "x")


class PhantomMLPTwin(nn.Module):
    """The single-device twin of :class:`PhantomMLP`: every rank's blocks stacked."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d, k, p = config.n_embd, config.phantom_k, config.phantom_p
        self.fc = PhantomLinearTwin(d, 4 * d, k, p)
        self.proj = PhantomLinearTwin(4 * d, d, k, p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(h)))
