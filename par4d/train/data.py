"""Training text as bytes, generated images, and batches that are a function of (seed, step) alone.

Every rank draws the same global batch for a step and keeps its own part (``shard``), so a
run resumed at step s sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from par4d.layout import batch_slice, sequence_chunks, shard_batch
from par4d.models.unet import shard_images
from par4d.train.config import VOCAB_BYTES, TrainConfig  # noqa: F401  (VOCAB_BYTES re-exported)
from par4d.train.recipes import recipe
from par4d.train.recipes.unet import IMAGE_CHANNELS

BUNDLED = "pydoc_data.topics (Python's bundled documentation)"
IMAGES = "generated images (discs and squares on colour gradients, plus noise; par4d.train.data.Images)"
TRAIN_SHARE = 0.9


@dataclass(frozen=True)
class Corpus:
    """A checked corpus: its text as UTF-8 bytes, where it came from, and their SHA-256."""

    data: bytes
    source: str          # the absolute path, or BUNDLED
    sha256: str


def min_bytes(seq_len: int) -> int:
    """The shortest corpus whose train and validation splits each hold one window of ``seq_len + 1``."""
    return 10 * (seq_len + 2)


def read_corpus(path: str | None, seq_len: int, sha256: str | None = None, label: str | None = None) -> Corpus:
    """The corpus at ``path`` (or Python's bundled documentation, no download), checked:
    it must be UTF-8 text without NUL bytes, long enough for ``seq_len``, and, given
    ``sha256``, the very file a run started on. Raises ``ValueError`` naming the file
    (as ``label`` when given, e.g. a resumed run's own data; else ``--data PATH``)."""
    if path is None:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        data, source, name = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8"), BUNDLED, "the default data"
    else:
        file = Path(path).resolve()
        name = label or f"--data {path}"
        if not file.exists():
            raise ValueError(f"{name}: no such file")
        if not file.is_file():
            raise ValueError(f"{name} is not a file")
        data, source = file.read_bytes(), str(file)
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise ValueError(f"{name} ({source}) is not the text this run started on: its SHA-256 is {digest[:12]}..., "
                         f"the run recorded {sha256[:12]}... (restore that file, or start a new run)")
    if not data:
        raise ValueError(f"{name} is empty")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})") from None
    if b"\0" in data:
        raise ValueError(f"{name} holds NUL bytes (offset {data.index(0)}): not a text file")
    if len(data) < min_bytes(seq_len):
        raise ValueError(f"{name} has {len(data):,} bytes; --seq-len {seq_len} needs at least {min_bytes(seq_len):,} "
                         f"(a {seq_len + 1}-byte window in each of the 90% train and 10% validation splits)")
    return Corpus(data, source, digest)


def as_tokens(corpus: Corpus) -> torch.Tensor:
    """The corpus's bytes as a uint8 tensor (one byte per token; widened per batch, not whole)."""
    return torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)


def training_data(config: TrainConfig) -> tuple[Batches | Images, str]:
    """The run's batches and where they come from: a prepared dataset folder (memory-mapped,
    :mod:`par4d.data.dataset`), a text file's bytes or, with a tokenizer, its tokens, or IMAGES."""
    if recipe(config.model).data == "images":
        return Images(config.image_size, config.batch_size, config.seed), IMAGES
    if config.data is not None and Path(config.data).is_dir():
        from par4d.data.dataset import open_dataset

        dataset = open_dataset(config.data, config.seq_len, config.tokenizer_sha256)
        train, val = dataset.splits["train"], dataset.splits["val"]
        batches = Batches.from_splits(train, val, config.seq_len, config.batch_size, config.seed,
                                      documents=config.document_mask, restart=config.restart_positions)
        masked = ", attention inside its documents" if config.document_mask else ""
        return batches, (f"{dataset.path} (a prepared dataset: {len(train):,} train and {len(val):,} validation "
                         f"tokens{masked})")
    corpus = read_corpus(config.data, config.seq_len, config.data_sha256)
    if config.tokenizer is None:
        return Batches(as_tokens(corpus), config.seq_len, config.batch_size, config.seed), corpus.source
    from par4d.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer, config.tokenizer_sha256)
    ids = torch.tensor(tokenizer.encode([corpus.data.decode("utf-8")])[0], dtype=torch.int32)
    return Batches(ids, config.seq_len, config.batch_size, config.seed), f"{corpus.source} ({len(ids):,} tokens)"


class Batches:
    """Random windows of ``seq_len + 1`` tokens drawn by (seed, step) alone, over a train and a validation
    split: a text's bytes or token ids (a 90/10 split of them), or a prepared dataset's memory-mapped
    splits. :meth:`local_batch` reads only this rank's rows; :meth:`train_batch` the whole batch."""

    shard = staticmethod(shard_batch)      # a rank's samples (over data x z), its chunks of each (context)

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if len(data) < min_bytes(seq_len):
            raise ValueError(f"the corpus has {len(data)} tokens, too few for sequences of {seq_len} "
                             f"(at least {min_bytes(seq_len)})")
        split = int(TRAIN_SHARE * len(data))
        self._set(data[:split], data[split:], seq_len, batch_size, seed)

    @classmethod
    def from_splits(cls, train, val, seq_len: int, batch_size: int, seed: int, documents: bool = False,
                    restart: bool = False) -> Batches:
        """Over given splits: anything with ``len`` and slices of token ids (:class:`par4d.data.dataset.Tokens`).
        ``documents``: each batch also gives every input token's document (the splits' ``documents``), a
        third tensor; ``restart``: and a fourth, every input token's position from its document's start (or
        the window's, where the document started before it)."""
        batches = cls.__new__(cls)
        batches._set(train, val, seq_len, batch_size, seed)
        batches.documents, batches.restart = documents, restart
        return batches

    def _set(self, train, val, seq_len: int, batch_size: int, seed: int) -> None:
        self.train, self.val = train, val
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.tokens_per_step = batch_size * seq_len
        self.documents = self.restart = False

    def _source(self, split: str, index: int):
        if split == "train":
            return self.train, self.seed * 1_000_003 + index
        return self.val, -(self.seed * 1_000_003 + index + 1)

    def _draw(self, source, key: int, rows: slice = slice(None), spans: tuple[slice, ...] | None = None
              ) -> tuple[torch.Tensor, ...]:
        """(inputs, targets) of the windows ``rows`` of a batch, and with :attr:`documents` every input's
        document; ``spans``: only these positions of each window (a context rank's two chunks, concatenated),
        each read with the one token after it (its last target)."""
        generator = torch.Generator().manual_seed(key)
        starts = torch.randint(0, len(source) - self.seq_len - 1, (self.batch_size,), generator=generator)
        spans = spans or (slice(0, self.seq_len),)
        pieces = [[torch.as_tensor(source[s + span.start:s + span.stop + 1]).long() for span in spans]
                  for s in starts[rows].tolist()]
        inputs = torch.stack([torch.cat([piece[:-1] for piece in window]) for window in pieces])
        targets = torch.stack([torch.cat([piece[1:] for piece in window]) for window in pieces])
        if not self.documents:
            return inputs, targets
        documents = torch.stack([torch.cat([torch.as_tensor(source.documents(slice(s + span.start, s + span.stop)))
                                            for span in spans]) for s in starts[rows].tolist()])
        if not self.restart:
            return inputs, targets, documents
        positions = torch.stack([torch.cat([
            s + torch.arange(span.start, span.stop)
            - torch.as_tensor(source.document_starts(slice(s + span.start, s + span.stop))).clamp(min=s)
            for span in spans]) for s in starts[rows].tolist()])
        return inputs, targets, documents, positions

    def train_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Global (inputs, targets) of step ``step``, each (batch_size, seq_len) (and documents: see _draw)."""
        return self._draw(*self._source("train", step))

    def val_batch(self, index: int) -> tuple[torch.Tensor, ...]:
        return self._draw(*self._source("val", index))

    def local_batch(self, grid, split: str, index: int) -> tuple[torch.Tensor, ...]:
        """This rank's rows (over data x z) of the global batch ``index`` of ``split`` (train or val), and of each
        its two chunks over context: the same starts are drawn on every rank, and each reads only its own
        windows' own chunks."""
        spans = sequence_chunks(grid, self.seq_len) if grid.size("context") > 1 else None
        return self._draw(*self._source(split, index), batch_slice(grid, self.batch_size), spans)


class Images:
    """A denoising task: each image (IMAGE_CHANNELS x size x size, values in [0, 1]) is a linear
    colour gradient in a random direction with SHAPES discs or squares of random colour, place and
    size drawn over it; the input is the image plus Gaussian noise of standard deviation NOISE, the
    target the clean image. Returning the input scores NOISE ** 2 = 0.04; a model that does better
    has learnt what images look like. Validation images come from other keys (negative ones)."""

    SHAPES = 3
    NOISE = 0.2
    shard = staticmethod(shard_images)     # its samples over data x z, its channels over y: as UNet takes them

    def __init__(self, size: int, batch_size: int, seed: int):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.tokens_per_step = batch_size * size * size     # a pixel is the U-Net's token

    def _draw(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(key)
        b, c, s = self.batch_size, IMAGE_CHANNELS, self.size
        centres = (torch.arange(s) + 0.5) / s                  # pixel centres in (0, 1)
        yy, xx = centres.view(1, s, 1), centres.view(1, 1, s)
        angle = 2 * math.pi * torch.rand(b, 1, 1, generator=g)
        ramp = xx * angle.cos() + yy * angle.sin()
        low, high = ramp.amin((1, 2), keepdim=True), ramp.amax((1, 2), keepdim=True)
        ramp = ((ramp - low) / (high - low).clamp_min(1e-6)).unsqueeze(1)   # 0 -> 1 across the image
        start, end = torch.rand(b, c, 1, 1, generator=g), torch.rand(b, c, 1, 1, generator=g)
        image = start + (end - start) * ramp
        for _ in range(self.SHAPES):
            cx, cy, radius, kind = torch.rand(4, b, 1, 1, generator=g)
            dx, dy, radius = xx - cx, yy - cy, 0.08 + 0.2 * radius
            inside = torch.where(kind < 0.5, dx.square() + dy.square() <= radius.square(),    # a disc
                                 torch.maximum(dx.abs(), dy.abs()) <= radius)                 # a square
            image = torch.where(inside.unsqueeze(1), torch.rand(b, c, 1, 1, generator=g), image)
        return image + self.NOISE * torch.randn(image.shape, generator=g), image

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (noisy, clean) images of step ``step``, each (batch_size, IMAGE_CHANNELS, size, size)."""
        return self._draw(self.seed * 1_000_003 + step)

    def val_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(-(self.seed * 1_000_003 + index + 1))

    def local_batch(self, grid, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the global batch ``index`` of ``split`` (train or val)."""
        batch = self.train_batch(index) if split == "train" else self.val_batch(index)
        return tuple(self.shard(grid, t) for t in batch)
