"""transformers' attention on sequences cut over the context axis (docs/architecture.md, "Long sequences").

transformers' decoder layers call their attention through its attention interface (the function the model's
``attn_implementation`` names). par4d registers its ring attention there (:data:`NAME`); a model made parallel
on a grid with context > 1 takes it, its attention modules knowing the grid. The queries, keys and values
arrive as transformers made them (rotary positions applied from the ``position_ids`` par4d gives: the tokens'
global indices), and the ring runs causal attention over the whole sequence, grouped-query attention's
key/value heads travelling as they are (a block's repeated to the query heads where it is computed).
transformers then builds no mask (an implementation without a mask function of its own): causality is the
ring's.

Refused, naming the numbers: a sliding window shorter than the sequence (the ring attends over all of it),
attention dropout (the ring has none), and attention the interface does not reach.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from par4d.grid import Grid
from par4d.nn.ring import ring_attention

NAME = "par4d_ring"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, par4d_documents: torch.Tensor | None = None,
               **_ignored) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, T, hd) queries, (B, H_kv, T, hd) keys and values, to
    the (B, T, H, hd) output. ``par4d_documents``: the whole sequences' documents (par4d.adopt.causal_lm
    passes them through the model's keyword arguments). ``_ignored``: what else transformers passes every
    implementation (cache positions and the like, unused in training)."""
    grid = module.par4d_grid
    length = query.shape[-2] * grid.size("context")
    if sliding_window is not None and length > sliding_window:
        raise ValueError(f"{type(module).__name__}: a sliding window of {sliding_window} tokens, shorter than the "
                         f"sequences of {length}: ring attention on a context axis attends over the whole sequence "
                         f"(give sequences of {sliding_window} tokens or less)")
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} on a context axis (ring attention "
                         f"has none): set the config's attention_dropout to 0")
    out = ring_attention(query, key, value, grid, scale=scaling, documents=par4d_documents,  # kv heads as they are
                         form=module.context_form, overlap=module.context_overlap)
    return out.transpose(1, 2).contiguous(), None


def cut_sequences(model: nn.Module, grid: Grid, attention: tuple[str, ...]) -> None:
    """Give ``model``'s attention modules (those of the classes named ``attention``) par4d's ring attention over
    ``grid``'s context axis."""
    from transformers import AttentionInterface

    modules = [m for m in model.modules() if type(m).__name__ in attention]
    if not modules:
        raise ValueError(f"{type(model).__name__}: no attention par4d knows to run on a context axis")
    AttentionInterface.register(NAME, _attention)      # the same function under the same name: idempotent
    model.set_attn_implementation(NAME)
    for module in modules:
        module.par4d_grid, module.context_form, module.context_overlap = grid, "ring", True
