"""Phantom parallelism (the phantom paper, Section III; notation in docs/phantom.md).

A feed-forward layer of width n_in -> n_out on the p ranks of one grid axis. Rank j
holds its feature shard ``y^(j)`` (n_in/p) and, for the layer:

    L^(j)    (n_out/p x n_in/p)   the local block
    C^(j)    (k x n_in/p)         the compressor: k ghost neurons g^(j) = C^(j) y^(j)
    D^(i,j)  (n_out/p x k)        one decompressor per other rank i
    b^(j)    (n_out/p)

Forward: ``z^(j) = L^(j) y^(j) + sum_{i != j} D^(i,j) g^(i)`` with the ghosts of all
ranks all-gathered; backward reduce-scatters the gradients of the received ghosts
back to their owners (the paper's Algorithm 1: all-gather forward, reduce-scatter
backward). Inputs and outputs stay sharded across layers. As one matrix, the layer
is the block matrix ``W[j, j] = L^(j)``, ``W[j, i] = D^(i,j) C^(i)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.layout import REPLICAS, Placement, Split, place
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import gather_shards


def parameter_count(n: int, depth: int, p: int, k: int, bias: bool = True) -> int:
    """Parameters of a depth-``depth`` phantom FFN of width ``n`` on ``p`` ranks:
    per layer ``n^2/p`` (local blocks) + ``k n`` (compressors) + ``(p-1) k n``
    (decompressors) = ``n^2/p + p k n``, plus ``n`` biases."""
    if n % p:
        raise ValueError(f"width n={n} is not divisible by p={p}")
    return depth * (n * n // p + p * k * n + (n if bias else 0))


class PhantomLinear(ShardedModule):
    """One phantom layer ``n_in -> n_out`` over grid axis ``axis`` (p = its size).

    Input ``(batch, n_in / p)``: this rank's feature shard, batch split over ``data``.
    Output ``(batch, n_out / p)`` before the activation: ``L y + sum D g + b``.
    """

    def __init__(self, n_in: int, n_out: int, k: int, *, grid: Grid, axis: str = "x", bias: bool = True,
                 seed: int = 0, name: str = "PhantomLinear", initialize: bool = True):
        super().__init__()
        p = grid.size(axis)
        busy = [a for a in ("x", "y", "z") if a != axis and grid.size(a) > 1]
        if busy:
            raise ValueError(f"{name}: phantom layers run on one axis ({axis}) and data; "
                             f"{', '.join(f'{a}={grid.size(a)}' for a in busy)} must be 1")
        for what, width in (("n_in", n_in), ("n_out", n_out)):
            if width % p:
                raise ValueError(f"{name}: {what}={width} is not divisible by {axis}={p}")
        if k < 1:
            raise ValueError(f"{name}: k={k} ghost neurons must be >= 1")
        self.grid, self.axis, self.p, self.k = grid, axis, p, k
        self.n_in, self.n_out = n_in, n_out
        self.rank = grid.coord(axis)
        local_in, local_out = n_in // p, n_out // p
        params = {
            "local": (local_out, local_in),
            "compressor": (k, local_in),
            "decompressors": (p - 1, local_out, k),
        }
        # A rank's own blocks: the full state stacks every rank's along a leading dim (p is
        # part of a phantom model's shape); the bias is one n_out vector cut over the axis.
        # The ghosts' reduce-scatter already summed every gradient over the axis.
        stacked = Placement((Split(0, axis, stacked=True),), grad_sum=REPLICAS)
        for pname, shape in params.items():
            setattr(self, pname, place(nn.Parameter(torch.empty(shape, device=grid.device)), stacked))
        self.bias = place(nn.Parameter(torch.zeros(local_out, device=grid.device)),
                          Placement((Split(0, axis),), grad_sum=REPLICAS)) if bias else None
        if grid.device.type != "meta" and initialize:
            self._init(seed)

    def _init(self, seed: int) -> None:
        """This rank's blocks drawn from (``seed``, rank) alone, uniform(-1/sqrt(fan_in), +)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + self.rank)
        fan_in = self.n_in // self.p
        with torch.no_grad():
            for param, scale in ((self.local, fan_in), (self.compressor, fan_in), (self.decompressors, self.k)):
                param.copy_(torch.empty(param.shape).uniform_(-1, 1, generator=gen) / math.sqrt(scale))

    def others(self) -> list[int]:
        """The ranks whose ghosts this rank decompresses, in decompressor order."""
        return [i for i in range(self.p) if i != self.rank]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        lead = y.shape[:-1]
        rows = y.reshape(-1, y.shape[-1])                                 # (B, n_in/p), B = all leading dims
        ghosts = rows @ self.compressor.t()                               # (B, k)
        out = rows @ self.local.t()                                       # (B, n_out/p)
        if self.p > 1:
            every = gather_shards(ghosts, self.grid, self.axis).view(self.p, rows.shape[0], self.k)  # (p, B, k)
            remote = every[self.others()]                                 # (p-1, B, k)
            out = out + torch.einsum("ibk,iok->bo", remote, self.decompressors)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, out.shape[-1])

    @torch.no_grad()
    def blocks(self, grad: bool = False) -> list[tuple[torch.Tensor, ...]]:
        """Every rank's ``(L, C, D, b)`` (or their gradients), on every rank (collective)."""
        from par4d import comm

        tensors = [self.local, self.compressor, self.decompressors] + ([self.bias] if self.bias is not None else [])
        parts = [(t.grad if grad else t).reshape(-1) for t in tensors]
        every = comm.all_gather(self.grid, torch.cat(parts)[None], self.axis)    # (p, size)
        sizes = [t.numel() for t in parts]
        return [tuple(flat.view(t.shape) for flat, t in zip(every[r].split(sizes), tensors)) for r in range(self.p)]


def block_matrix(blocks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], n_in: int,
                 n_out: int) -> torch.Tensor:
    """``W[j, j] = L^(j)``, ``W[j, i] = D^(i,j) C^(i)`` from every rank's ``(L, C, D)``
    (differentiable: the single-device reference of a phantom layer)."""
    p = len(blocks)
    rows = []
    for j, (local, _, decs) in enumerate(blocks):
        others = [i for i in range(p) if i != j]
        row = [local if i == j else decs[others.index(i)] @ blocks[i][1] for i in range(p)]
        rows.append(torch.cat(row, dim=1))
    weight = torch.cat(rows, dim=0)
    assert weight.shape == (n_out, n_in)
    return weight


class PhantomLinearTwin(nn.Module):
    """Single-device twin of a :class:`PhantomLinear`: every rank's blocks as stacked
    parameters (the same names and shapes as its full state), applied as one block
    matrix."""

    def __init__(self, n_in: int, n_out: int, k: int, p: int, bias: bool = True):
        super().__init__()
        self.n_in, self.n_out, self.p = n_in, n_out, p
        self.local = nn.Parameter(torch.empty(p, n_out // p, n_in // p))
        self.compressor = nn.Parameter(torch.empty(p, k, n_in // p))
        self.decompressors = nn.Parameter(torch.empty(p, p - 1, n_out // p, k))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        blocks = [(self.local[j], self.compressor[j], self.decompressors[j]) for j in range(self.p)]
        out = y @ block_matrix(blocks, self.n_in, self.n_out).t()
        return out if self.bias is None else out + self.bias


class PhantomFFN(nn.Module):
    """``depth`` phantom layers ``y_l = σ(b_l + z_l)``; widths ``widths[0] -> ... -> widths[-1]``
    (an int ``n`` means ``n`` everywhere) and ghost counts ``k`` per layer (or one for all)."""

    def __init__(self, n: int | Sequence[int], depth: int, k: int | Sequence[int], *, grid: Grid,
                 axis: str = "x", activation: Callable[[torch.Tensor], torch.Tensor] = F.relu,
                 final_activation: bool = True, seed: int = 0):
        super().__init__()
        widths = [n] * (depth + 1) if isinstance(n, int) else list(n)
        ks = [k] * depth if isinstance(k, int) else list(k)
        if len(widths) != depth + 1 or len(ks) != depth:
            raise ValueError(f"PhantomFFN: {depth} layers need {depth + 1} widths and {depth} k values, "
                             f"got {len(widths)} and {len(ks)}")
        self.activation, self.final_activation = activation, final_activation
        self.layers = nn.ModuleList(
            PhantomLinear(widths[i], widths[i + 1], ks[i], grid=grid, axis=axis, seed=seed * 1000 + i,
                          name=f"layers.{i}") for i in range(depth))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return feed_forward(self.layers, y, self.activation, self.final_activation)


def feed_forward(layers: Sequence[nn.Module], y: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                 final_activation: bool) -> torch.Tensor:
    """``y_l = σ(layer_l(y_{l-1}))``; the last σ only with ``final_activation``."""
    for i, layer in enumerate(layers):
        y = layer(y)
        if i < len(layers) - 1 or final_activation:
            y = activation(y)
    return y
