"""Training text as bytes, and batches that are a function of (seed, step) alone.

Every rank draws the same global batch for a step and keeps its own samples, so a
run resumed at step s sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from pathlib import Path

import torch

from par4d.train.config import VOCAB_BYTES  # noqa: F401  (re-exported)


def load_corpus(path: str | None = None) -> tuple[torch.Tensor, str]:
    """UTF-8 bytes of ``path``, or of Python's bundled documentation (no download)."""
    if path is None:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        text = "\n\n".join(topics[key] for key in sorted(topics))
        source = "pydoc_data.topics (Python's bundled documentation)"
    else:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--data {path}: no such file")
        text = file.read_text(encoding="utf-8", errors="replace")
        source = str(file)
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    return data, source


class Batches:
    """Random windows of ``seq_len + 1`` bytes; a 90/10 train/validation split."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if len(data) < 10 * (seq_len + 1):
            raise ValueError(f"the corpus has {len(data)} tokens, too few for sequences of {seq_len}")
        split = int(0.9 * len(data))
        self.train, self.val = data[:split], data[split:]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def _draw(self, source: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(key)
        starts = torch.randint(0, len(source) - self.seq_len - 1, (self.batch_size,), generator=generator)
        windows = torch.stack([source[s:s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (inputs, targets) of step ``step``, each (batch_size, seq_len)."""
        return self._draw(self.train, self.seed * 1_000_003 + step)

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(self.val, -(self.seed * 1_000_003 + index + 1))
