"""One recipe per ``--model`` (docs/architecture.md, Recipes): how the model is checked, built on a grid and
parallelized, counted, fed, saved and exported. ``par4d train``'s rooms ask the recipe, never the model's name.

Adding a model is one module here with its :class:`Recipe`, and one line in :data:`RECIPES`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from par4d.train.recipes.base import Recipe, Settings
from par4d.train.recipes.gpt import GPTRecipe
from par4d.train.recipes.hf import (
    DeepseekV3Recipe,
    GPT2Recipe,
    LlamaRecipe,
    MixtralRecipe,
    OlmoeRecipe,
    Qwen3MoeRecipe,
)
from par4d.train.recipes.unet import UNetRecipe

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from par4d.checkpoint import Checkpoint
    from par4d.grid import Grid

MAX_SHARD_BYTES = 5 * 10**9   # per weights file, as transformers' save_pretrained once defaulted to ("5GB")
RECIPES: MappingProxyType[str, Recipe] = MappingProxyType({r.name: r for r in (
    GPTRecipe(),
    GPT2Recipe("hf-gpt2"),
    LlamaRecipe("hf-llama"),
    MixtralRecipe("hf-mixtral"),
    Qwen3MoeRecipe("hf-qwen3-moe"),
    OlmoeRecipe("hf-olmoe"),
    DeepseekV3Recipe("hf-deepseek-v3"),
    UNetRecipe(),
)})
MODELS = tuple(RECIPES)

__all__ = ["MAX_SHARD_BYTES", "MODELS", "RECIPES", "Recipe", "build_model", "export_hf", "hf_state", "recipe"]


def recipe(name: str) -> Recipe:
    """The recipe of ``--model name``."""
    if name not in RECIPES:
        raise ValueError(f"--model {name!r}: give one of {', '.join(MODELS)}")
    return RECIPES[name]


def build_model(config: Settings, grid: Grid) -> nn.Module:
    """The model a run trains on ``grid``, with the overlaps ``--overlap`` asks for; on a virtual grid
    (meta device) only the shapes: what the CLI checks before any rank starts.

    The order: the model's layers on the grid (recomputation inside the model's forward), then its overlaps,
    one runtime for all its Algorithm 1 layers (they must exist, and the recomputed segments are where the
    cache acts); the precision policy and the data-parallel sync wrap the finished model later (the loop),
    since the sync's buckets follow the overlap settings."""
    return recipe(config.model).build(config, grid)


def hf_state(source: Path, report: Callable[[str], None] | None = None
             ) -> tuple[Checkpoint, dict[str, torch.Tensor], str]:
    """(the checkpoint chosen, its model's state dict under ``transformers``' names, the ``config.json``
    text) of the run or checkpoint ``source``, as :func:`export_hf` writes them (and ``par4d generate``
    builds them): whole tensors, in one process."""
    from par4d.train.export import find_checkpoint

    source = Path(source)
    chosen = find_checkpoint(source, report)
    trained = chosen.meta.get("train_config", {}).get("model", "gpt")
    if not isinstance(trained, str) or trained not in RECIPES:
        raise ValueError(f"{chosen.path / 'meta.json'}: train_config's model is {str(trained)[:40]!r}, not one par4d "
                         f"trains ({', '.join(RECIPES)})")
    tensors, text = RECIPES[trained].export_hf(chosen, source)     # the model's own recipe says how
    return chosen, tensors, text


def export_hf(source: Path, out: Path, force: bool = False, report: Callable[[str], None] | None = None,
              shard_bytes: int = MAX_SHARD_BYTES) -> tuple[Path, dict]:
    """Write the model of a par4d checkpoint as a ``transformers`` model folder ``out``: ``config.json``
    and the weights as ``save_pretrained`` writes them (``model.safetensors``, or files of at most
    ``shard_bytes`` named by ``model.safetensors.index.json``); returns (the checkpoint exported, its meta).
    par4d's GPT becomes a GPT2LMHeadModel; a run of ``--model hf-llama`` / ``hf-gpt2`` its own model
    again, under its own names (a tied head is written once, as ``save_pretrained`` does).

    ``source``: a run folder (its newest intact checkpoint; each one skipped is ``report``-ed) or one of its
    ``checkpoints/step-N`` folders. One process, no ``torch.distributed``. Refused, before anything is
    written: ``out`` not empty without ``force`` (which replaces config.json and the weights files, those
    of an earlier export included, and leaves the others), a folder that is not a par4d run, a damaged
    checkpoint, a U-Net or phantom-MLP run."""
    from par4d.folder import is_count
    from par4d.train.export import check_out, write_weights

    source, out = Path(source), Path(out)
    if not is_count(shard_bytes, 1):
        raise ValueError(f"the largest weights file must be >= 1 byte, got {shard_bytes}")
    check_out(out, force)
    chosen, tensors, text = hf_state(source, report)
    tensors = RECIPES[chosen.meta.get("train_config", {}).get("model", "gpt")].stored(tensors)   # as folders keep them
    write_weights(out, tensors, text, {"format": "pt", "par4d_step": str(chosen.meta.get("step"))}, shard_bytes)
    return chosen.path, chosen.meta
