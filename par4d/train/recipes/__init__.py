"""One recipe per ``--model`` (docs/architecture.md, Recipes): how the model is checked, built on a grid and
parallelized, counted, fed, saved and exported. ``par4d train``'s rooms ask the recipe, never the model's name.

Adding a model is one module here with its :class:`Recipe`, and one line in :data:`RECIPES`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from par4d.train.recipes.base import Recipe
from par4d.train.recipes.gpt import GPTRecipe
from par4d.train.recipes.hf import GPT2Recipe, LlamaRecipe
from par4d.train.recipes.unet import UNetRecipe

if TYPE_CHECKING:
    import torch.nn as nn

    from par4d.grid import Grid
    from par4d.train.config import TrainConfig

RECIPES: MappingProxyType[str, Recipe] = MappingProxyType({r.name: r for r in (
    GPTRecipe(),
    GPT2Recipe("hf-gpt2"),
    LlamaRecipe("hf-llama"),
    UNetRecipe(),
)})
MODELS = tuple(RECIPES)

__all__ = ["MODELS", "RECIPES", "Recipe", "build_model", "recipe"]


def recipe(name: str) -> Recipe:
    """The recipe of ``--model name``."""
    if name not in RECIPES:
        raise ValueError(f"--model {name!r}: give one of {', '.join(MODELS)}")
    return RECIPES[name]


def build_model(config: TrainConfig, grid: Grid) -> nn.Module:
    """The model a run trains on ``grid``, with the overlaps ``--overlap`` asks for; on a virtual grid
    (meta device) only the shapes: what the CLI checks before any rank starts.

    The order: the model's layers on the grid (recomputation inside the model's forward), then its overlaps,
    one runtime for all its Algorithm 1 layers (they must exist, and the recomputed segments are where the
    cache acts); the precision policy and the data-parallel sync wrap the finished model later (the loop),
    since the sync's buckets follow the overlap settings."""
    return recipe(config.model).build(config, grid)
