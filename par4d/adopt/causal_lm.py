"""A Hugging Face causal language model as par4d's training loop and pipeline call a model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.adopt.moe import SparseMoE, router_aux_loss
from par4d.adopt.stages import Stage
from par4d.grid import Grid
from par4d.layout import gather_sequence, positions
from par4d.nn.attention import document_mask
from par4d.parallel import state


class CausalLM(nn.Module):
    """A Hugging Face causal language model as the training loop calls a model:
    ``forward(idx, targets)`` is the mean cross-entropy over this rank's tokens (``targets``
    are already the next tokens), plus a mixture's auxiliary loss where its config asks for it
    (``output_router_logits``: ``router_aux_loss_coef`` times :func:`par4d.adopt.moe.router_aux_loss`);
    without targets the logits. ``flops_per_token`` and
    ``num_params`` are the whole model's (counted before it was parallelized).

    ``grid``: the grid ``lm`` was made parallel on, where it has a context axis (each sequence's two chunks
    here, given their global positions). On a grid with pipe > 1, ``lm`` is this rank's stage
    (:mod:`par4d.adopt.stages`) and the pipeline runs it (``stage_forward``, ``stream_shape``, ``first``,
    ``last``: as par4d's GPT)."""

    def __init__(self, lm: nn.Module, flops_per_token: float, num_params: int, stage: Stage | None = None,
                 grid: Grid | None = None):
        super().__init__()
        self.lm, self.flops_per_token, self.num_params = lm, flops_per_token, num_params
        self.grid = grid     # with a context axis: each sequence's chunks here, positioned by their global index
        self.stage = stage or Stage(0, 1, range(lm.config.num_hidden_layers))
        self.first, self.last = self.stage.first, self.stage.last
        # A mixture of experts trained with transformers' load-balancing loss (output_router_logits): par4d's
        # where par4d holds the mixtures (the whole batch's), else the model's own (unparallelized)
        self.balanced = bool(getattr(lm.config, "output_router_logits", False))
        mixtures = any(isinstance(m, SparseMoE) for m in lm.modules())
        self.ours = self.balanced and mixtures
        if self.ours and self.stage.stages > 1:
            raise ValueError("a mixture's load-balancing loss (output_router_logits) pools every layer's counts, which "
                             "no pipeline stage holds: cut it into stages without it, or on pipe=1")
        # The axes whose ranks join the same collectives inside a pipeline stage: a mixture's exchanges and
        # counts span data too (par4d.pipeline)
        self.stage_axes = ("x", "y", "z", "context", "data") if mixtures else ("x", "y", "z", "context")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                places: torch.Tensor | None = None) -> torch.Tensor:
        if not (self.first and self.last):
            raise ValueError(f"this model is pipeline stage {self.stage.index} of {self.stage.stages}: train it "
                             f"with par4d.train_step (the pipeline runs its stages)")
        return self.stage_forward(idx, targets, documents, places)

    def stage_forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                      documents: torch.Tensor | None = None, places: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's part of the forward: token ids in on the first stage, else the residual stream from
        the stage before (:meth:`stream_shape`); the stream out, or on the last stage the logits or, with
        ``targets``, the mean cross-entropy over its tokens. ``documents``: this rank's tokens' documents (a
        packed window's): attention stays inside them (on a context axis the ring's mask; else transformers'
        attention given the block-diagonal causal mask, a 4-D mask it takes as it is). ``places``: this rank's
        tokens' positions (``position_ids``; default their index in the whole sequence)."""
        given = {"input_ids": inputs} if self.first else {"inputs_embeds": inputs}
        cut = self.grid is not None and self.grid.size("context") > 1
        if places is not None:
            given["position_ids"] = places
        elif cut:
            given["position_ids"] = positions(self.grid, inputs.shape[1], inputs.device).expand(inputs.shape[0], -1)
        if documents is not None and cut:      # every chunk's, for the ring (par4d.adopt.context)
            given["par4d_documents"] = gather_sequence(self.grid, documents)
        elif documents is not None:
            given["attention_mask"] = document_mask(documents)
        if not self.last:                   # its final norm is the identity (par4d.adopt.stages)
            return self.lm.base_model(**given, use_cache=False).last_hidden_state
        if self.balanced:
            given["output_router_logits"] = not self.ours
        out = self.lm(**given, use_cache=False)       # training: no key/value cache
        if targets is None:
            return out.logits
        loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        if not self.balanced:
            return loss
        aux = router_aux_loss(self.lm) if self.ours else out.aux_loss
        return loss + self.lm.config.router_aux_loss_coef * aux

    def stream_shape(self, rows: int, seq: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The residual stream between stages for ``rows`` sequences of ``seq`` tokens: features over y where
        ``parallelize`` sharded it (:mod:`par4d.adopt.stream`), else whole, in the parameters' dtype."""
        hidden = self.lm.config.hidden_size // state(self.lm).stream
        return (rows, seq, hidden), next(self.parameters()).dtype
