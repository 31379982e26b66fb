"""Embedding table sharded like a Linear weight: rows over z, features over an axis.

Forward gathers the rows over z (as Algorithm 1 gathers Ŵ) and looks tokens up in
the ``(num_embeddings, dim / G_axis)`` block; backward reduce-scatters the table
gradient over z. The output is an activation with features split over ``axis``
(``y``: the input layout of a normal Linear) and replicated over the other, or with
``output_layout="whole"`` every feature on every rank (all-gathered over ``axis``), for the
layers of a model nobody parallelized. ``padding_idx`` is ``nn.Embedding``'s: that row's
gradient is zero.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid, Indivisible
from par4d.layout import REPLICAS, Placement, Split, place
from par4d.nn.algorithm1 import check_layout
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import GatherFeatures, gather_shards


class Embedding(ShardedModule):
    def __init__(self, num_embeddings: int, dim: int, *, grid: Grid, axis: str = "y", seed: int = 0,
                 std: float = 1.0, name: str = "Embedding", initialize: bool = True, output_layout: str = "sharded",
                 padding_idx: int | None = None):
        super().__init__()
        g_axis, g_z = grid.size(axis), grid.size("z")
        where = f"{name}(num_embeddings={num_embeddings}, dim={dim})"
        check_layout(where, "output_layout", output_layout)
        self.output_layout, self.padding_idx = output_layout, padding_idx
        if dim % g_axis:
            raise Indivisible(f"{where}: dim={dim} is not divisible by {axis}={g_axis}")
        if num_embeddings % g_z:
            raise Indivisible(f"{where}: num_embeddings={num_embeddings} is not divisible by z={g_z}")
        self.grid, self.axis, self.num_embeddings, self.dim = grid, axis, num_embeddings, dim
        # Rows over z (gathered in forward like Ŵ, so z sums the gradient), features over axis.
        self.weight = place(nn.Parameter(torch.empty(num_embeddings // g_z, dim // g_axis, device=grid.device)),
                            Placement((Split(1, axis), Split(0, "z")), grad_sum=REPLICAS))
        if grid.device.type == "meta" or not initialize:
            return  # shapes only (a virtual grid), or the caller loads full tensors next
        generator = torch.Generator().manual_seed(seed)
        self.load_full_state({"weight": torch.randn(num_embeddings, dim, generator=generator) * std})

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if self.grid.size(self.axis, "z") == 1:
            return F.embedding(indices, self.weight, self.padding_idx)     # nothing to gather, either layout
        table = gather_shards(self.weight, self.grid, "z")   # (num_embeddings, dim / G_axis)
        out = F.embedding(indices, table, self.padding_idx)
        return GatherFeatures.apply(out, self.grid, self.axis) if self.output_layout == "whole" else out
