"""The residual stream of a recognised causal language model, sharded over y between blocks.

par4d's GPT keeps its residual stream as the 4D paper lays it out: features over y, replicated over x
(docs/architecture.md, "Layouts"). ``par4d.parallelize`` does the same for the models whose every use
of the stream it knows (:data:`STREAM_TYPES`: Llama, Mistral, Qwen2, GPT-2), on a grid with y > 1:

* the embeddings write their features over y (par4d's Embedding, no all-gather), and a replicated one
  (a token embedding tied to the head, kept whole) keeps its block of them (:func:`split_output`);
* each block's first layers (q, k, v; gate and up; GPT-2's c_attn and c_fc), normal, take their input
  features over y as they are, and its last (o_proj, down_proj, c_proj), transposed, leave theirs over
  y: Algorithm 1's transposed alternation, with no all-gather at a block's edges;
* the residual additions are elementwise on those blocks;
* every norm over the stream is par4d's (:class:`par4d.nn.RMSNorm`, :class:`par4d.nn.LayerNorm`),
  its statistics summed over y, its weight split over y as the features are;
* the head takes its input features over y (a replicated head, tied to the embedding, gathers them:
  :func:`gather_input`).

Any other use of the stream (a layer outside these blocks, a block a forced treatment broke, attention
heads that x does not divide, a norm over another width) keeps the stream whole, and
:func:`stream_problem` says why.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from par4d.adopt.stages import PARTS
from par4d.grid import Grid
from par4d.nn.collectives import GatherFeatures, SplitFeatures
from par4d.nn.norm import LayerNorm, RMSNorm

STREAM_TYPES = tuple(PARTS)          # the model types whose every part par4d knows
AXIS = "y"


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def stream_problem(model: nn.Module, grid: Grid, layers: list[tuple[str, nn.Module]], in_blocks: set[str],
                   forced: bool) -> str | None:
    """Why the residual stream of ``model`` stays whole between blocks, or None (it is sharded over y).
    ``layers``: its Linear, Conv2d and Embedding layers; ``in_blocks``: those a recognised block keeps
    sharded inside it; ``forced``: a treatment was forced."""
    if grid.size(AXIS) == 1:
        return "y=1: every feature is on every rank anyway"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in STREAM_TYPES:
        return f"par4d shards the residual stream of {', '.join(STREAM_TYPES)} models only"
    if forced:
        return "a treatment was forced"
    hidden = config.hidden_size
    for name, module in model.named_modules():
        if is_norm(module) and (getattr(module, "weight", None) is None or tuple(module.weight.shape) != (hidden,)
                                or (isinstance(module, nn.LayerNorm) and module.bias is None)):
            return f"{name} is not a norm over the {hidden} hidden features with a weight (and a LayerNorm's bias)"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in layers:
        if not (isinstance(module, nn.Embedding) or module is head or name in in_blocks):
            return f"{name} is a lone layer inside a block (whole features in and out)"
    return None


def stream_norm(module: nn.Module, name: str, grid: Grid) -> nn.Module:
    """par4d's norm standing for ``module`` (an RMSNorm or LayerNorm over the stream's features) on
    features split over y, with its values (unless on the meta device: they are loaded next)."""
    dim = module.weight.shape[0]
    if isinstance(module, nn.LayerNorm):
        norm = LayerNorm(dim, grid=grid, axis=AXIS, eps=module.eps, name=name)
    else:   # Llama's, Mistral's and Qwen2's RMSNorm keep eps as variance_epsilon; torch's as eps (None: dtype's)
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        eps = torch.finfo(module.weight.dtype).eps if eps is None else eps
        norm = RMSNorm(dim, grid=grid, axis=AXIS, eps=eps, name=name)
    if not module.weight.is_meta:
        state = dict(module.named_parameters(recurse=False))
        norm.load_full_state({k: v.detach().to(norm.weight.device, norm.weight.dtype) for k, v in state.items()})
    return norm


def split_output(module: nn.Module, grid: Grid) -> None:
    """A replicated embedding (whole on every rank) writing to a sharded stream: it keeps its block of
    features over y (its gradient's blocks all-gathered in backward)."""
    module.register_forward_hook(lambda _module, _args, out: SplitFeatures.apply(out, grid, AXIS))


def gather_input(module: nn.Module, grid: Grid) -> None:
    """A replicated head reading a sharded stream: its input's features all-gathered over y first."""
    module.register_forward_pre_hook(lambda _module, args: (GatherFeatures.apply(args[0], grid, AXIS), *args[1:]))
