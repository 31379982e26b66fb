"""``--model gpt``: par4d's GPT, its MLP dense or phantom (the one place that maps ``GPTConfig.mlp`` to an
MLP factory: models cannot, since phantom layers are built on top of them); GPT-2 weights in and out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from par4d.models.config import GPTConfig
from par4d.overlap.policy import Overlap
from par4d.train.recipes.base import Recipe, Settings

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from par4d.checkpoint import Checkpoint
    from par4d.grid import Grid
    from par4d.models import GPT, ReferenceGPT


def build_gpt(config: GPTConfig, grid: Grid, recompute: int = 0, overlap: Overlap | None = None) -> GPT:
    """par4d's GPT on ``grid``, its MLP the one ``config.mlp`` names (dense or phantom),
    recomputing activations every ``recompute`` blocks (0: never), overlapping as ``overlap``
    says (None: every overlap on)."""
    from par4d.models import GPT
    from par4d.phantom.mlp import PhantomMLP

    return GPT(config, grid=grid, mlp=PhantomMLP if config.mlp == "phantom" else None, recompute=recompute,
               overlap=overlap)


def build_reference(config: GPTConfig, init: bool = True) -> ReferenceGPT:
    """The single-device twin of :func:`build_gpt`'s model."""
    from par4d.models import ReferenceGPT
    from par4d.phantom.mlp import PhantomMLPTwin

    return ReferenceGPT(config, init=init, mlp=PhantomMLPTwin if config.mlp == "phantom" else None)


class GPTRecipe(Recipe):
    name = "gpt"
    describe = "par4d's GPT"
    plannable = True
    context = True
    documents = True

    def pretrained_settings(self, folder: str, chosen: dict) -> tuple[dict, dict | None]:
        from par4d.adopt.gpt2 import gpt_dims

        return dict(gpt_dims(folder), **chosen), None     # the saved model's shape unless a flag says otherwise

    def check_pretrained(self, config: Settings) -> None:
        from par4d.adopt.gpt2 import check_hf

        check_hf(Path(config.init_from), config.model_config())    # names the file and every number that differs

    def build(self, config: Settings, grid: Grid) -> nn.Module:
        from par4d.nn.ring import set_context_form

        return set_context_form(build_gpt(config.model_config(), grid, config.recompute_every(),
                                          config.overlap_settings()), config.context_form)

    def load_pretrained(self, config: Settings, grid: Grid, model: nn.Module) -> None:
        from par4d.adopt.gpt2 import load_hf

        load_hf(Path(config.init_from), grid, model)      # GPT-2's weights; each rank reads its shards

    def export_hf(self, chosen: Checkpoint, source: Path) -> tuple[dict[str, torch.Tensor], str]:
        from par4d.train.export import gpt2_state

        tensors, config = gpt2_state(chosen, source)
        return tensors, json.dumps(config, indent=2) + "\n"
