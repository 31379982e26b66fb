"""GPT configuration and the initialization both twins share."""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder: learned positions, pre-LN blocks, GELU MLP, untied head, no dropout."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    seed: int = 0
    mlp: str = "dense"       # "phantom": phantom layers over x (phantom parallelism) in every MLP
    phantom_k: int = 16      # ghost neurons per phantom layer
    phantom_p: int = 1       # ranks of the phantom axis (x); a phantom model's shape depends on it

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name not in ("seed", "mlp") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.mlp not in ("dense", "phantom"):
            raise ValueError(f"GPTConfig.mlp={self.mlp!r}; valid: 'dense', 'phantom'")
        if self.mlp == "phantom" and (self.n_embd % self.phantom_p or (4 * self.n_embd) % self.phantom_p):
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by phantom_p={self.phantom_p}")

    def _mlp_params(self) -> int:
        d = self.n_embd
        if self.mlp == "dense":
            return (4 * d * d + 4 * d) + (4 * d * d + d)
        p, k = self.phantom_p, self.phantom_k
        # Per phantom layer: local blocks, compressors, decompressors, bias (DESIGN §5).
        return sum(n_in * n_out // p + k * n_in + (p - 1) * k * n_out + n_out
                   for n_in, n_out in ((d, 4 * d), (4 * d, d)))

    def num_params(self) -> int:
        """Parameters of the model (embeddings included), from the shapes alone."""
        d, v, t, layers = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + self._mlp_params()
        return v * d + t * d + layers * per_block + 2 * d + d * v

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward = 3x forward): 2 per matmul
        multiply-add of every Linear, plus causal attention's QK^T and AV counted in full."""
        d, layers = self.n_embd, self.n_layer
        mlp = self._mlp_params() - (5 * d)     # multiply-adds per token = weights (biases excluded)
        linear = layers * (3 * d * d + d * d + mlp) + d * self.vocab_size
        attention = layers * 2 * self.block_size * d
        return 3 * 2 * (linear + attention)


def init_tensor(config: GPTConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of parameter ``name``: a function of (seed, name) alone.

    GPT-2's scheme: N(0, 0.02) weights and embeddings, residual projections scaled
    by 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains.
    """
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if ".ln" in f".{name}" and leaf == "weight":
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = 0.02
    if name.endswith("proj.weight"):
        std /= math.sqrt(2 * config.n_layer)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std
