"""Causal self-attention with heads split over x.

The fused QKV projection is a normal Linear with ``out_chunks=3``: its out-features
are split over x chunk by chunk, so rank i holds q, k and v of the same heads
``[i H/G_x, (i+1) H/G_x)`` and attention is local. The output projection is a
transposed Linear (in-features over x), returning to the residual layout
(features over y). On a grid with a context axis each rank holds two chunks of every sequence and
attention runs around the context group's ring (:mod:`par4d.nn.ring`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.nn.linear import Linear
from par4d.nn.ring import ring_attention


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T): which keys each query attends to, causally and within its document (``documents`` (B, T):
    each token's)."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return ((documents.unsqueeze(-1) == documents.unsqueeze(-2)) & causal).unsqueeze(1)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, dim: int, n_head: int, *, grid: Grid, name: str = "attn", seed: int = 0,
                 initialize: bool = True):
        super().__init__()
        if dim % n_head:
            raise ValueError(f"{name}: n_embd={dim} is not divisible by n_head={n_head}")
        if n_head % grid.size("x"):
            raise ValueError(f"{name}: n_head={n_head} is not divisible by x={grid.size('x')} "
                             f"(heads are split over x)")
        self.grid = grid
        self.context_form = "ring"     # on a context axis: ring or gather (par4d.nn.ring.set_context_form)
        self.context_overlap = True    # the ring's transfers behind attention (--overlap cp, par4d.set_overlap)
        self.n_head_local = n_head // grid.size("x")
        self.head_dim = dim // n_head
        # Own seeds: with one seed, proj's weight would repeat the q rows of qkv's.
        self.qkv = Linear(dim, 3 * dim, grid=grid, out_chunks=3, seed=seed, name=f"{name}.qkv",
                          initialize=initialize)
        self.proj = Linear(dim, dim, transposed=True, grid=grid, seed=seed + 1, name=f"{name}.proj",
                           initialize=initialize)

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents`` (B, whole sequence): every token's document, in order (a packed window's): attention
        stays inside documents."""
        batch, seq, _ = h.shape                                       # h: (B, T, D/G_y)
        q, k, v = self.qkv(h).chunk(3, dim=-1)                        # each (B, T, D/G_x)
        q, k, v = (t.view(batch, seq, self.n_head_local, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.grid.size("context") > 1:                             # T: this rank's two chunks
            att = ring_attention(q, k, v, self.grid, documents=documents, form=self.context_form,
                                 overlap=self.context_overlap)
        elif documents is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/G_x, T, hd)
        else:
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents))
        return self.proj(att.transpose(1, 2).reshape(batch, seq, -1))  # (B, T, D/G_y)

