"""The model a run trains: par4d's GPT with the MLP its config names, and its twin.

The one place that maps ``GPTConfig.mlp`` to an MLP factory: models cannot (phantom
layers are built on top of them), so the training floor, which knows both, does.
"""

from __future__ import annotations

from par4d.grid import Grid
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.phantom.mlp import PhantomMLP, PhantomMLPTwin


def build_gpt(config: GPTConfig, grid: Grid, recompute: int = 0) -> GPT:
    """par4d's GPT on ``grid``, its MLP the one ``config.mlp`` names (dense or phantom),
    recomputing activations every ``recompute`` blocks (0: never); overlap as the grid says."""
    return GPT(config, grid=grid, mlp=PhantomMLP if config.mlp == "phantom" else None, recompute=recompute)


def build_reference(config: GPTConfig, init: bool = True) -> ReferenceGPT:
    """The single-device twin of :func:`build_gpt`'s model."""
    return ReferenceGPT(config, init=init, mlp=PhantomMLPTwin if config.mlp == "phantom" else None)
