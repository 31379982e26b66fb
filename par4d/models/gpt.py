"""A GPT whose every layer runs on the 4D grid.

Residual stream: ``(B / (G_data G_z), T, D / G_y)`` — samples over data and z,
features over y, replicated over x. Each block alternates a normal Linear
(features y -> x) with a transposed one (x -> y), so activations are never
re-laid out or fully replicated between layers:

    ln1 (stats over y) -> qkv (normal, heads over x) -> attention -> proj (transposed)
    ln2 (stats over y) -> fc (normal, 4D over x) -> GELU -> proj (transposed)
    ln_f -> head (normal, vocabulary over x) -> vocab-parallel cross-entropy over x

The MLP comes from a factory (``mlp=``): the dense one above by default, a mixture of
experts (:class:`par4d.nn.MoE`, spread over the expert axis) for ``config.mlp == "moe"``, whose
balance losses join the loss; a layer above this one supplies another, as :mod:`par4d.phantom`
does for ``config.mlp == "phantom"`` (models never import the layers built on top of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.layout import gather_sequence, positions
from par4d.models.config import GPTConfig, init_tensor
from par4d.nn import CausalSelfAttention, Embedding, LayerNorm, Linear, MoE, vocab_parallel_cross_entropy
from par4d.nn.base import ShardedModule, full_state_dict, load_full_state_dict
from par4d.nn.moe import balance_loss
from par4d.nn.recompute import run_blocks
from par4d.overlap.apply import set_overlap
from par4d.overlap.policy import Overlap
from par4d.parallel import state

MLPFactory = Callable[[GPTConfig, Grid, str], nn.Module]
"""``factory(config, grid, name)``: a block's MLP, residual layout (features over y) in and out."""


class DenseMLP(nn.Module):
    """fc (normal) -> GELU -> proj (transposed): the 4D MLP of every block by default."""

    def __init__(self, config: GPTConfig, grid: Grid, name: str):
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd, grid=grid, name=f"{name}.fc", initialize=False)
        self.proj = Linear(4 * config.n_embd, config.n_embd, transposed=True, grid=grid, name=f"{name}.proj",
                           initialize=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(h)))


def moe_mlp(config: GPTConfig, grid: Grid, name: str) -> MoE:
    """The mixture a ``mlp="moe"`` block has: ``config.experts`` of the dense MLP's shape (no biases), the
    top ``config.top_k`` per token, spread over the grid's expert axis (par4d.nn.moe)."""
    return MoE(config.n_embd, 4 * config.n_embd, config.experts, config.top_k, grid, name,
               shared=config.shared_experts, capacity_factor=config.capacity_factor or None,
               bias_rate=config.expert_bias_rate)


class _Block(nn.Module):
    compile_region = True        # what --compile compiles (par4d.compiled)

    def __init__(self, config: GPTConfig, grid: Grid, name: str, mlp: MLPFactory):
        super().__init__()
        self.ln1 = LayerNorm(config.n_embd, grid=grid, name=f"{name}.ln1")
        self.attn = CausalSelfAttention(config.n_embd, config.n_head, grid=grid, name=f"{name}.attn",
                                        initialize=False)
        self.ln2 = LayerNorm(config.n_embd, grid=grid, name=f"{name}.ln2")
        self.mlp = mlp(config, grid, f"{name}.mlp")

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.attn(self.ln1(h), documents)
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """par4d's GPT; parameters named and initialized exactly as :class:`ReferenceGPT`'s.

    ``forward(idx, targets=None)`` takes this rank's samples ``idx`` (B_local, T) of
    global token ids and returns its logits shard (B_local, T, V / G_x), or with
    ``targets`` the mean cross-entropy over this rank's tokens.

    ``mlp``: the factory of each block's MLP (default :class:`DenseMLP`); a config with
    ``mlp="phantom"`` needs :class:`par4d.phantom.PhantomMLP` (or build the model with
    :func:`par4d.train.recipes.gpt.build_gpt`, which picks the factory the config names).

    ``overlap``: the overlaps of its collectives (None: every one, ``Overlap()``;
    ``Overlap.none()``: synchronous); ``par4d.overlap.set_overlap`` changes them later.
    ``recompute``: recompute activations in segments of this many blocks (0: none; see
    :func:`par4d.models.config.recompute_spacing` for the paper's choice).
    """

    def __init__(self, config: GPTConfig, *, grid: Grid, mlp: MLPFactory | None = None,
                 overlap: Overlap | None = None, recompute: int = 0):
        super().__init__()
        if mlp is None:
            if config.mlp == "phantom":
                raise ValueError(f"GPTConfig.mlp={config.mlp!r} needs its MLP factory: pass "
                                 f"mlp=par4d.phantom.PhantomMLP, or build with par4d.train.recipes.gpt.build_gpt")
            mlp = moe_mlp if config.mlp == "moe" else DenseMLP
        stages = config.stage_blocks(grid.size("pipe"))
        for blocks in stages:
            if recompute < 0 or (recompute and len(blocks) % recompute):
                counts = ", ".join(str(len(b)) for b in stages)
                raise ValueError(f"recompute={recompute}: give 0 (none) or a divisor of every pipeline stage's block "
                                 f"count ({counts} of n_layer={config.n_layer})")
        self.config, self.grid, self.recompute = config, grid, recompute
        # The axes whose ranks join the same collectives inside a pipeline stage during a step (attention's ring
        # spans context; a mixture's exchanges and counts span data too), so every rank of a stage that shares
        # them takes the pipeline's messages in one order
        self.stage_axes = ("x", "y", "z", "context", "data") if config.mlp == "moe" else ("x", "y", "z", "context")
        # This rank's pipeline stage: its blocks, the embeddings on the first, ln_f and the head on the last.
        stage = grid.coord("pipe")
        self.block_range = stages[stage]
        self.first, self.last = stage == 0, stage == len(stages) - 1
        # Layers skip their own initialization: the GPT loads init_tensor values below.
        if self.first:
            self.wte = Embedding(config.vocab_size, config.n_embd, grid=grid, name="wte", initialize=False)
            self.wpe = Embedding(config.block_size, config.n_embd, grid=grid, name="wpe", initialize=False)
        # Keyed by the global block index, so parameter names are the twin's on every stage.
        self.blocks = nn.ModuleDict({str(i): _Block(config, grid, f"blocks.{i}", mlp) for i in self.block_range})
        if self.last:
            self.ln_f = LayerNorm(config.n_embd, grid=grid, name="ln_f")
            self.head = Linear(config.n_embd, config.vocab_size, bias=False, grid=grid, name="head",
                               initialize=False)
        set_overlap(self, overlap if overlap is not None else Overlap())
        if grid.device.type != "meta":
            self.load_reference_state({name: init_tensor(config, name, shape) for name, shape in self.full_shapes()})

    def full_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, full shape) of every parameter, as in the single-device twin."""
        shapes = []
        for prefix, module in self.named_modules():
            if isinstance(module, ShardedModule):
                shapes += [(f"{prefix}.{name}" if prefix else name, shape)
                           for name, shape in module.full_shapes().items()]
        return shapes

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, places: torch.Tensor | None = None) -> torch.Tensor:
        if not (self.first and self.last):
            raise ValueError(f"this GPT is pipeline stage {self.grid.coord('pipe')} of {self.grid.size('pipe')}: "
                             f"train it with par4d.train.step.train_step (the pipeline runs its stages)")
        return self.stage_forward(idx, targets, documents, places)

    def stage_forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                      documents: torch.Tensor | None = None, places: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's part of the forward: token ids in on the first stage, else the residual
        stream from the stage before; the residual stream out, or on the last stage the logits
        shard (B, T, V / G_x) or, with ``targets``, the mean cross-entropy over its tokens.
        ``documents``: this rank's tokens' documents (as ``inputs``, a packed window's): attention stays
        inside documents. ``places``: this rank's tokens' positions (as ``inputs``; default: their index in the
        sequence), e.g. counted from each document's start."""
        h = inputs
        if self.first:
            seq = inputs.shape[1]          # this rank's tokens of each sequence (its two chunks over context)
            if seq * self.grid.size("context") > self.config.block_size:
                raise ValueError(f"sequence length {seq * self.grid.size('context')} exceeds "
                                 f"block_size={self.config.block_size}")
            where = positions(self.grid, seq, inputs.device) if places is None else places
            h = self.wte(inputs) + self.wpe(where)                                      # (B, T, D/G_y)
        parallel = state(self)
        extra = () if documents is None else (gather_sequence(self.grid, documents),)     # every chunk's
        h = run_blocks(list(self.blocks.values()), h, self.recompute, parallel.runtime, parallel.observe_recompute,
                       extra)
        if not self.last:
            return h
        logits = self.head(self.ln_f(h))                                              # (B, T, V/G_x)
        if targets is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, targets, grid=self.grid, axis="x")
        return loss + self.stage_loss()

    def stage_loss(self) -> torch.Tensor | float:
        """The balance losses of this stage's mixtures at their last forward (0 without any): part of the loss,
        on whichever stage they run (par4d.pipeline)."""
        return balance_loss(block.mlp for block in self.blocks.values())

    def stream_shape(self, rows: int, seq: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The residual stream between pipeline stages for ``rows`` sequences of ``seq``
        tokens: its shape (rows, seq, D / G_y: the embeddings' layout, which every block
        keeps) and dtype (the parameters')."""
        return (rows, seq, self.config.n_embd // self.grid.size("y")), next(self.parameters()).dtype

    def load_reference_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors, e.g. ``ReferenceGPT(config).state_dict()``."""
        load_full_state_dict(self, state)

    def reference_state(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """Full parameters (or gradients) named as the twin's ``state_dict`` (collective)."""
        return full_state_dict(self, grad)

