"""The phantom paper's synthetic regression data: ``y = σ(W σ(x))``.

``W`` is a fixed standard-Gaussian n x n matrix, σ = ReLU, x standard Gaussian;
everything is drawn from a seed, so every rank can generate the same global batch
and keep its shard.
"""

from __future__ import annotations

import torch


class SyntheticTeacher:
    def __init__(self, n: int, seed: int = 0):
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        self.n, self.seed = n, seed
        self.weight = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (x, y) of ``step``: a function of (seed, step) alone."""
        # A stream apart from the weight's (seed): a batch never repeats W's numbers.
        gen = torch.Generator().manual_seed((self.seed << 32) + (1 << 31) + step)
        x = torch.randn(batch_size, self.n, generator=gen)
        return x, torch.relu(torch.relu(x) @ self.weight.t())
