"""A U-Net of residual convolution blocks on the 3D grid, and its single-device twin.

Levels of residual blocks with down-sampling (2x2 average pooling) on the way down,
up-sampling (nearest) on the way up and a skip connection from each level's way down to
its way up. Every convolution is :class:`par4d.nn.Conv2d` (Algorithm 1, in-channels as k,
out-channels as n). Channels are split between convolutions: a normal layer's output
(over x) is a transposed layer's input, so each residual block is a transposed then a
normal convolution and its sum stays on the stem's layout (channels over x). Pooling,
up-sampling, GELU and the additive skips act per channel, so they need no collective;
the skips add (rather than concatenate) so that both sides share that layout. The width
is the same at every level, and there is no normalisation layer (a batch norm over
samples split over z and data would need its own collectives).

Images are ``(B, channels, H, W)`` with H and W divisible by ``2 ** (levels - 1)``;
samples split over data and z, the input's channels over y (the stem is a normal layer);
the output's channels come out over y (the head is a transposed layer):
:func:`shard_images` cuts a global batch so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d import comm
from par4d.grid import Grid
from par4d.layout import shard_activation
from par4d.nn.conv import Conv2d
from par4d.overlap.apply import set_overlap
from par4d.overlap.policy import Overlap


@dataclass(frozen=True)
class UNetConfig:
    channels: int = 4        # of the images, in and out
    width: int = 8           # channels inside
    levels: int = 2          # resolutions: each one below halves H and W
    seed: int = 0

    def num_params(self) -> int:
        return sum(c_in * c_out * k * k + c_out for _, c_in, c_out, k, _ in _sized(self))

    def flops_per_token(self) -> float:
        """Training FLOPs (forward and backward: 6 per weight and output pixel) per pixel of the input,
        the U-Net's token; a level's convolutions see ``4 ** -level`` of the pixels."""
        return sum(6 * c_in * c_out * k * k / 4 ** _level(name) for name, c_in, c_out, k, _ in _sized(self))


def _level(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith(("down.", "up.")) else 0


def _sized(config: UNetConfig) -> list[tuple[str, int, int, int, bool]]:
    """(name, in, out, kernel, transposed) of every convolution, in order."""
    w = config.width
    layers = [("stem", config.channels, w, 3, False)]
    for way in ("down", "up"):
        for level in range(config.levels):
            layers += [(f"{way}.{level}.conv1", w, w, 3, True), (f"{way}.{level}.conv2", w, w, 3, False)]
    return layers + [("head", w, config.channels, 1, True)]


class UNet(nn.Module):
    """par4d's U-Net on ``grid`` (see the module docstring); :meth:`loss` is the mean squared
    error over this rank's samples, its value that of all their channels. ``overlap``: the
    overlaps of its convolutions' collectives (None: every one, ``Overlap()``; ``Overlap.none()``:
    synchronous)."""

    def __init__(self, config: UNetConfig, *, grid: Grid, overlap: Overlap | None = None):
        super().__init__()
        self.config, self.grid = config, grid
        _assemble(self, {name: Conv2d(c_in, c_out, k, padding=k // 2, transposed=t, grid=grid, seed=config.seed + i,
                                      name=f"UNet.{name}")
                         for i, (name, c_in, c_out, k, t) in enumerate(_sized(config))})
        set_overlap(self, overlap if overlap is not None else Overlap())

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The output, or given ``targets`` the loss (as par4d's GPT: what ``train_step`` calls)."""
        return _unet(self, images) if targets is None else self.loss(images, targets)

    def loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = _unet(self, images)
        # This rank's share of the squared error over the whole image (its channel block of
        # G_y); the value is summed over y, the gradient is this block's.
        share = (out - targets).square().sum() / (targets.numel() * self.grid.size("y"))
        whole = share.detach().clone().reshape(1)
        comm.all_reduce(self.grid, whole, "y")
        return share + (whole[0] - share).detach()


def shard_images(grid: Grid, images: torch.Tensor) -> torch.Tensor:
    """This rank's part of a global batch ``(B, C, H, W)`` as :class:`UNet` takes its input and target:
    its samples (over data and z) and its channel block over y."""
    return shard_activation(grid, images.movedim(1, -1), "y").movedim(-1, 1).contiguous()


class _Block(nn.Module):
    compile_region = True        # what --compile compiles (par4d.compiled)

    def __init__(self, convs: dict, name: str):
        super().__init__()
        self.conv1, self.conv2 = convs[f"{name}.conv1"], convs[f"{name}.conv2"]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.conv2(F.gelu(self.conv1(F.gelu(h))))


def _assemble(model: nn.Module, convs: dict[str, nn.Module]) -> None:
    """Give ``model`` its convolutions (named as :func:`_sized` names them) as stem, blocks and head."""
    model.stem, model.head = convs["stem"], convs["head"]
    levels = model.config.levels
    model.down = nn.ModuleList(_Block(convs, f"down.{i}") for i in range(levels))
    model.up = nn.ModuleList(_Block(convs, f"up.{i}") for i in range(levels))


def _unet(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The U-Net's forward, the same for par4d's and the twin's modules."""
    h = model.stem(images)
    skips = []
    for level, block in enumerate(model.down):
        if level:
            h = F.avg_pool2d(h, 2)
        h = block(h)
        skips.append(h)
    for level, block in reversed(list(enumerate(model.up))):
        h = block(h + skips[level])
        if level:
            h = F.interpolate(h, scale_factor=2, mode="nearest")
    return model.head(F.gelu(h))


class ReferenceUNet(nn.Module):
    """The single-device twin: ``nn.Conv2d`` layers under the same names; load par4d's full
    state (``par4d.nn.full_state_dict``) to compare."""

    def __init__(self, config: UNetConfig):
        super().__init__()
        self.config = config
        _assemble(self, {name: nn.Conv2d(c_in, c_out, k, padding=k // 2) for name, c_in, c_out, k, _ in _sized(config)})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return _unet(self, images)

    def loss(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(images), targets)
