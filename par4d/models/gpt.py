"""A GPT whose every layer runs on the 4D grid.

Residual stream: ``(B / (G_data G_z), T, D / G_y)`` — samples over data and z,
features over y, replicated over x. Each block alternates a normal Linear
(features y -> x) with a transposed one (x -> y), so activations are never
re-laid out or fully replicated between layers:

    ln1 (stats over y) -> qkv (normal, heads over x) -> attention -> proj (transposed)
    ln2 (stats over y) -> fc (normal, 4D over x) -> GELU -> proj (transposed)
        (or, with ``config.mlp == "phantom"``, phantom layers over x: DESIGN §5)
    ln_f -> head (normal, vocabulary over x) -> vocab-parallel cross-entropy over x
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.models.config import GPTConfig, init_tensor
from par4d.nn import CausalSelfAttention, Embedding, LayerNorm, Linear, vocab_parallel_cross_entropy
from par4d.nn.base import full_state_dict, load_full_state_dict
from par4d.nn.collectives import GatherFeatures, SplitFeatures


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig, grid: Grid, name: str):
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd, grid=grid, name=f"{name}.fc", initialize=False)
        self.proj = Linear(4 * config.n_embd, config.n_embd, transposed=True, grid=grid, name=f"{name}.proj",
                           initialize=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(h)))


class _PhantomMLP(nn.Module):
    """Phantom layers over x in place of the dense MLP (needs y = z = 1): the residual
    stream (replicated over x) is split into x blocks, runs fc -> GELU -> proj as
    phantom layers, and is gathered back."""

    def __init__(self, config: GPTConfig, grid: Grid, name: str):
        super().__init__()
        from par4d.phantom.layers import PhantomLinear

        d, k = config.n_embd, config.phantom_k
        self.grid = grid
        self.fc = PhantomLinear(d, 4 * d, k, grid=grid, axis="x", name=f"{name}.fc", initialize=False)
        self.proj = PhantomLinear(4 * d, d, k, grid=grid, axis="x", name=f"{name}.proj", initialize=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = SplitFeatures.apply(h, self.grid, "x")                        # (B, T, D/G_x)
        return GatherFeatures.apply(self.proj(F.gelu(self.fc(local))), self.grid, "x")


class _Block(nn.Module):
    def __init__(self, config: GPTConfig, grid: Grid, name: str):
        super().__init__()
        self.ln1 = LayerNorm(config.n_embd, grid=grid, name=f"{name}.ln1")
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, grid=grid, name=f"{name}.attn",
                                        initialize=False)
        self.ln2 = LayerNorm(config.n_embd, grid=grid, name=f"{name}.ln2")
        self.mlp = (_MLP if config.mlp == "dense" else _PhantomMLP)(config, grid, f"{name}.mlp")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """par4d's GPT; parameters named and initialized exactly as :class:`ReferenceGPT`'s.

    ``forward(idx, targets=None)`` takes this rank's samples ``idx`` (B_local, T) of
    global token ids and returns its logits shard (B_local, T, V / G_x), or with
    ``targets`` the mean cross-entropy over this rank's tokens.
    """

    def __init__(self, config: GPTConfig, *, grid: Grid):
        super().__init__()
        if grid.size("pipe") > 1:
            raise ValueError(f"GPT runs on the data x 3D tensor grid; pipe={grid.size('pipe')} is not supported yet")
        if config.mlp == "phantom":
            if config.phantom_p != grid.size("x"):
                raise ValueError(f"GPTConfig.phantom_p={config.phantom_p} must equal the grid's x={grid.size('x')}")
            if grid.size("y") > 1 or grid.size("z") > 1:
                raise ValueError(f"a phantom MLP runs on x and data only; y={grid.size('y')} and "
                                 f"z={grid.size('z')} must be 1")
        self.config, self.grid = config, grid
        # Layers skip their own initialization: the GPT loads init_tensor values below.
        self.wte = Embedding(config.vocab_size, config.n_embd, grid=grid, name="wte", initialize=False)
        self.wpe = Embedding(config.block_size, config.n_embd, grid=grid, name="wpe", initialize=False)
        self.blocks = nn.ModuleList(_Block(config, grid, f"blocks.{i}") for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, grid=grid, name="ln_f")
        self.head = Linear(config.n_embd, config.vocab_size, bias=False, grid=grid, name="head", initialize=False)
        if grid.device.type != "meta":
            self.load_reference_state({name: init_tensor(config, name, shape) for name, shape in self.full_shapes()})

    def full_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, full shape) of every parameter, as in the single-device twin."""
        from par4d.models.reference import ReferenceGPT

        with torch.device("meta"):
            twin = ReferenceGPT(self.config, init=False)
        return [(name, tuple(p.shape)) for name, p in twin.named_parameters()]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size={self.config.block_size}")
        h = self.wte(idx) + self.wpe(torch.arange(seq, device=idx.device))   # (B, T, D/G_y)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))                                      # (B, T, V/G_x)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, grid=self.grid, axis="x")

    def load_reference_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors, e.g. ``ReferenceGPT(config).state_dict()``."""
        load_full_state_dict(self, state)

    def reference_state(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """Full parameters (or gradients) named as the twin's ``state_dict`` (collective)."""
        return full_state_dict(self, grad)

