"""The single-device twin of par4d.models.GPT: plain PyTorch, same parameter names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.models.config import GPTConfig, init_tensor
from par4d.nn.moe import ReferenceMoE, balance_loss

TwinMLPFactory = Callable[[GPTConfig], nn.Module]
"""``factory(config)``: the twin of a block's MLP (named and shaped as par4d's)."""


class _Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, dim = h.shape
        q, k, v = self.qkv(h).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_head, dim // self.n_head).transpose(1, 2) for t in (q, k, v))
        if documents is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:        # the block-diagonal causal mask, written out: a token sees its own document's earlier tokens
            mask = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
            for row in range(batch):
                for i in range(seq):
                    for j in range(i + 1):
                        mask[row, 0, i, j] = bool(documents[row, i] == documents[row, j])
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(att.transpose(1, 2).reshape(batch, seq, dim))


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(h)))


def _moe(config: GPTConfig) -> ReferenceMoE:
    return ReferenceMoE(config.n_embd, 4 * config.n_embd, config.experts, config.top_k, shared=config.shared_experts,
                        capacity_factor=config.capacity_factor or None, bias_rate=config.expert_bias_rate)


class _Block(nn.Module):
    compile_region = True        # the peers' compiled blocks (par4d.compiled), as par4d's

    def __init__(self, config: GPTConfig, mlp: TwinMLPFactory):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = _Attention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = mlp(config)

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.attn(self.ln1(h), documents)
        return h + self.mlp(self.ln2(h))


class ReferenceGPT(nn.Module):
    """Plain PyTorch GPT with exactly par4d GPT's parameters and initialization.

    ``mlp``: the twin of the par4d GPT's MLP factory (default: the dense MLP); a config
    with ``mlp="phantom"`` needs :class:`par4d.phantom.PhantomMLPTwin`.
    """

    def __init__(self, config: GPTConfig, init: bool = True, *, mlp: TwinMLPFactory | None = None):
        super().__init__()
        if mlp is None:
            if config.mlp == "phantom":
                raise ValueError(f"GPTConfig.mlp={config.mlp!r} needs its twin MLP factory: pass mlp=par4d.phantom."
                                 f"PhantomMLPTwin, or build with par4d.train.recipes.gpt.build_reference")
            mlp = _moe if config.mlp == "moe" else _MLP
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(_Block(config, mlp) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not init:
            return
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(init_tensor(config, name, tuple(param.shape)))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                places: torch.Tensor | None = None):
        """Logits (B, T, V); with ``targets``, the mean cross-entropy instead. ``documents`` (B, T): each token's
        document (a packed window's): attention stays inside documents. ``places`` (B, T): each token's position
        (default: its index)."""
        seq = idx.shape[1]
        h = self.wte(idx) + self.wpe(torch.arange(seq, device=idx.device) if places is None else places)
        for block in self.blocks:
            h = block(h, documents)
        logits = self.head(self.ln_f(h))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss + balance_loss(block.mlp for block in self.blocks)
