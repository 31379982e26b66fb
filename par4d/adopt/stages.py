"""A Hugging Face causal language model cut into pipeline stages (the pipe axis, docs/hf.md).

Stage s of ``pipe`` keeps a contiguous run of the decoder layers, chosen by training FLOPs
(:func:`par4d.models.config.balanced_stages`: the head's matmul counts on the last stage); the first
stage also keeps the input embeddings, the last the final norm and the head. What lives on other stages
is replaced, in place and under the same name, by a module without parameters, so every parameter keeps
its name on every grid (checkpoints, ``--init-from`` and export need nothing else) and the model's own
``forward`` still runs the stage:

* a decoder layer elsewhere passes the hidden states through (:class:`Elsewhere`);
* the input embeddings elsewhere are never called: a later stage gives the model ``inputs_embeds``, the
  residual stream it received (:class:`Absent` raises if one is called);
* GPT-2's position embeddings elsewhere add nothing (:class:`NoPositions`): GPT-2 adds them to
  ``inputs_embeds`` itself, and the first stage already did;
* the final norm on a stage before the last is the identity: the stage returns the stream as it leaves
  its last decoder layer.

A head tied to the input embeddings (GPT-2; a Llama with ``tie_word_embeddings``) is the one weight two
stages need: the first keeps the embedding module, the last the head, and each keeps the other module
too, so the weight is still tied under its first name on both. After ``par4d.parallelize`` (a tied
weight is kept whole), :func:`tie_across_stages` marks the two copies (``Placement.pipe_peer``): the
data-parallel sync adds their gradients, so both step alike, and only the first stage's copy is counted
by the gradient norm and written by checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from par4d.adopt.moe import MIXTURES
from par4d.grid import Grid
from par4d.layout import place, placement_of
from par4d.models.config import balanced_stages

# The base model's parts by model type: (its decoder layers, its input embeddings, position embeddings
# added to inputs_embeds by its forward, its final norm).
PARTS = {**{kind: ("layers", "embed_tokens", None, "norm") for kind in ("llama", "mistral", "qwen2", "mixtral",
                                                                       "qwen3_moe", "olmoe")},
         "gpt2": ("h", "wte", "wpe", "ln_f")}


class Elsewhere(nn.Module):
    """A decoder layer that lives on another pipeline stage: the hidden states pass through. It takes the
    arguments the model's forward gives its decoder layers, whatever they are (they vary by model)."""

    def __init__(self, stage: int):
        super().__init__()
        self.stage = stage

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:   # noqa: ARG002
        return hidden_states

    def extra_repr(self) -> str:
        return f"on pipeline stage {self.stage}"


class Absent(nn.Module):
    """A module of another pipeline stage that this stage must never call (the input embeddings after the
    first stage, the head before the last)."""

    def __init__(self, name: str, stage: int):
        super().__init__()
        self.name, self.stage = name, stage

    def forward(self, *args, **kwargs):   # noqa: ARG002
        raise RuntimeError(f"{self.name} lives on pipeline stage {self.stage}; this stage was called as if it "
                           f"held it")

    def extra_repr(self) -> str:
        return f"{self.name} on pipeline stage {self.stage}"


class NoPositions(nn.Module):
    """GPT-2's position embeddings after the first stage: a zero its forward adds to the stream it
    received (an integer zero: the sum keeps the stream's dtype and values)."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.uint8, device=position_ids.device)


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: its index of ``stages`` and the decoder layers it holds."""

    index: int
    stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def stage_layers(lm: nn.Module, stages: int, seq_len: int | None = None) -> list[range]:
    """The decoder layers of each of ``stages`` stages of ``lm`` (a Hugging Face causal LM, on any
    device), balanced by training FLOPs per token: each layer's matmul weights and attention's scores
    over ``seq_len`` tokens (default: the model's positions); the head's matmul on the last stage."""
    layers_at, _, _, _ = _parts(lm)
    layers = getattr(lm.base_model, layers_at)
    config = lm.config
    attention = 2 * 2 * (seq_len or config.max_position_embeddings) * config.hidden_size    # QK^T and AV
    costs = [3 * (2 * matmul_weights(layer) + attention) for layer in layers]
    head = lm.get_output_embeddings()
    return balanced_stages(costs, stages, last=3 * 2 * head.weight.numel())


def cut_stage(lm: nn.Module, grid: Grid, seq_len: int | None = None) -> Stage:
    """Make ``lm`` (a Hugging Face causal LM, before ``par4d.parallelize``; on the meta device will do)
    this rank's pipeline stage, in place (see the module's docstring), balanced for ``seq_len`` tokens
    (:func:`stage_layers`); returns which one. Whole on a grid with pipe = 1."""
    stages, index = grid.size("pipe"), grid.coord("pipe")
    if stages == 1:
        return Stage(0, 1, range(lm.config.num_hidden_layers))
    bounds = stage_layers(lm, stages, seq_len)
    stage = Stage(index, stages, bounds[index])
    layers_at, embeddings_at, positions_at, norm_at = _parts(lm)
    base = lm.base_model
    layers = getattr(base, layers_at)
    for i in range(len(layers)):
        if i not in stage.layers:
            layers[i] = Elsewhere(next(s for s, run in enumerate(bounds) if i in run))
    head_at = next(name for name, m in lm.named_modules() if m is lm.get_output_embeddings())
    tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    if not stage.first:
        if positions_at is not None:
            setattr(base, positions_at, NoPositions())
        if not (tied and stage.last):     # the last stage keeps a tied embedding: it is the head's weight
            setattr(base, embeddings_at, Absent(f"{lm.base_model_prefix}.{embeddings_at}", 0))
    if not stage.last:
        setattr(base, norm_at, nn.Identity())
        if not (tied and stage.first):    # the first stage keeps a tied head: it is the embedding's weight
            parent, _, child = head_at.rpartition(".")
            setattr(lm.get_submodule(parent) if parent else lm, child, Absent(head_at, stages - 1))
    return stage


def tie_across_stages(lm: nn.Module, stage: Stage) -> None:
    """After ``par4d.parallelize``: mark a head tied to the input embeddings, held by the first and the
    last stage, as one weight on two stages (``Placement.pipe_peer``)."""
    embeddings, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if stage.stages == 1 or isinstance(embeddings, Absent) or isinstance(head, Absent):
        return
    weight = embeddings.weight
    if head.weight is not weight:
        return
    peer = stage.stages - 1 if stage.first else 1 - stage.stages
    place(weight, replace(placement_of(weight), pipe_peer=peer))


def _parts(lm: nn.Module) -> tuple[str, str, str | None, str]:
    model_type = lm.config.model_type
    if model_type not in PARTS:
        raise ValueError(f"pipe > 1: par4d cuts {', '.join(PARTS)} models into pipeline stages, not "
                         f"{model_type!r} ({type(lm).__name__})")
    return PARTS[model_type]


def matmul_weights(module: nn.Module) -> int:
    """The weights a token meets in ``module``'s matmuls: its linear layers' (``nn.Linear`` and GPT-2's
    ``Conv1D``), and in a transformers mixture of experts (:data:`par4d.adopt.moe.MIXTURES`) the router's and
    its top-k experts' (one expert's times k)."""
    dense = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    experts = sum(m.gate.weight.numel() + m.gate.top_k * (m.experts.gate_up_proj[0].numel() +
                                                         m.experts.down_proj[0].numel())
                  for m in module.modules() if type(m).__name__ in MIXTURES)
    return dense + experts
