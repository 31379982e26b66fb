"""``--model unet``: par4d's U-Net (every convolution par4d's Conv2d), denoising images generated from the seed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from par4d.train.recipes.base import Recipe, Settings

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from par4d.checkpoint import Checkpoint
    from par4d.grid import Grid
    from par4d.models.unet import UNetConfig

IMAGE_CHANNELS = 4   # channels of the generated images (the U-Net's input and output)


class UNetRecipe(Recipe):
    name = "unet"
    describe = "unet: par4d's U-Net (par4d.nn.Conv2d), denoising generated images"
    data = "images"
    samples = "images"
    loss_unit = "mean squared error"
    unused = ("seq_len", "n_head", "mlp", "phantom_k", "experts", "top_k", "shared_experts", "capacity_factor",
              "expert_bias_rate")
    unused_why = "the U-Net's sizes are --n-embd, --n-layer and --image-size"

    def check(self, config: Settings) -> None:
        given = [flag for flag, on in ((f"--grid pipe={config.grid.get('pipe', 1)}", config.grid.get("pipe", 1) > 1),
                                       (f"--mlp {config.mlp}", config.mlp != "dense"),
                                       (f"--recompute {config.recompute}", config.recompute != "none"),
                                       (f"--init-from hf {config.init_from}", config.init_from is not None),
                                       (f"--float8 {config.float8}", config.float8 != "none")) if on]
        if given:
            raise ValueError(f"--model unet: {given[0]} is for par4d's GPT (--model gpt); the U-Net trains without "
                             f"a pipeline, phantom MLPs, recomputation, --init-from or float8 (it has no Linear)")
        if config.data is not None:
            raise ValueError(f"--model unet: --data {config.data} is text for the language models; the U-Net trains "
                             f"on images generated from --seed")
        for flag, value in (("--n-layer", config.n_layer), ("--n-embd", config.n_embd),
                            ("--image-size", config.image_size)):
            if value < 1:
                raise ValueError(f"--model unet: {flag} must be >= 1, got {value}")
        if config.image_size % 2 ** (config.n_layer - 1):
            raise ValueError(f"--model unet: --image-size {config.image_size} is not divisible by 2 ** (--n-layer - 1) "
                             f"= {2 ** (config.n_layer - 1)} (the U-Net's {config.n_layer} levels halve it "
                             f"{config.n_layer - 1} times)")

    def model_config(self, config: Settings) -> UNetConfig:
        """``--n-embd`` is the U-Net's width, ``--n-layer`` its levels."""
        from par4d.models.unet import UNetConfig  # imports torch: only a U-Net run needs it

        return UNetConfig(channels=IMAGE_CHANNELS, width=config.n_embd, levels=config.n_layer, seed=config.seed)

    def sizes(self, config: Settings) -> str:
        return f"n_layer={config.n_layer}, n_embd={config.n_embd}"

    def build(self, config: Settings, grid: Grid) -> nn.Module:
        from par4d.models import UNet

        return UNet(config.model_config(), grid=grid, overlap=config.overlap_settings())

    def export_hf(self, chosen: Checkpoint, source: Path) -> tuple[dict[str, torch.Tensor], str]:
        raise ValueError(f"run {source} trained --model unet, par4d's U-Net, not a language model: export is for "
                         f"par4d's GPT and the Hugging Face models (--model gpt and hf-*)")
