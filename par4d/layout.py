"""Layouts as data, and the only code that cuts full tensors into shards and back.

**Parameters.** A :class:`Placement` says how a parameter lies on the grid: a sequence
of :class:`Split` steps, each cutting one tensor dim over one grid axis, applied in
order (an earlier split is the outer one: Algorithm 1's weight is cut into out-feature
blocks over x, and each block into z shards), and the axes over which the gradient left
by backward is still a partial sum (``grad_sum``), and, for a weight tied across pipeline
stages (a language model's embedding on the first stage, its head on the last), the stage
that holds the other copy (``pipe_peer``). :func:`shard` and :func:`unshard`
follow a placement both ways; layers, checkpoints and the single-device twins use
nothing else (docs/architecture.md, "Layouts").

**Activations.** Rows (whole samples) are split over ``data`` (outer) then ``z``;
features over ``x`` or ``y`` and replicated over the other.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from par4d import comm
from par4d.grid import TENSOR_AXES, Grid, check_axes

BATCH_AXES = ("z", "context", "data")
"""The axes a batch's tokens are split over: its samples over data and z, each sequence over context; every
rank of other tokens (what a gradient of weights replicated over them is summed over, and a batch
statistic's mean)."""

REPLICAS = ("context", "data")
"""The axes whose ranks hold the same shards of the weights and other tokens: what the gradient of a weight
sharded over z is still a partial sum over."""


@dataclass(frozen=True)
class Split:
    """Cut tensor dim ``dim`` over grid ``axis``.

    The dim is first cut into ``chunks`` equal chunks (q, k, v of a fused projection),
    each chunk into ``G_axis`` blocks; a rank keeps its block of every chunk,
    concatenated in chunk order. ``stacked``: the dim has one entry per coordinate
    (size ``G_axis``) and a rank's shard drops it (every rank's own blocks, stacked).
    ``dim`` counts the dims of the tensor as it is when this split applies.
    """

    dim: int
    axis: str
    chunks: int = 1
    stacked: bool = False

    def __post_init__(self) -> None:
        check_axes((self.axis,))
        assert self.chunks >= 1 and not (self.stacked and self.chunks > 1), self


@dataclass(frozen=True)
class Placement:
    """Where a parameter's pieces live (see the module docstring)."""

    splits: tuple[Split, ...]
    grad_sum: tuple[str, ...]
    # A copy on two pipeline stages (a tied weight): the other stage is this many stages along pipe. Their
    # gradients are summed (par4d.optim.data_parallel); the earlier stage's copy (pipe_peer > 0) is the one
    # norms count and checkpoints write. 0: on one stage only.
    pipe_peer: int = 0

    def __post_init__(self) -> None:
        check_axes(self.grad_sum)

    @property
    def sharded(self) -> tuple[str, ...]:
        """The axes over which ranks hold different pieces, in AXES order."""
        return check_axes({s.axis for s in self.splits})

    def full_shape(self, local_shape: tuple[int, ...], grid: Grid) -> tuple[int, ...]:
        """The full tensor's shape, from a shard's on ``grid``."""
        shape = list(local_shape)
        for s in reversed(self.splits):
            if s.stacked:
                shape.insert(s.dim, grid.size(s.axis))
            else:
                shape[s.dim] *= grid.size(s.axis)
        return tuple(shape)

    def coords(self, grid: Grid) -> dict[str, int]:
        """This rank's coordinate on every tensor axis that really shards the parameter
        (size > 1), in AXES order: what tells its shard from the others'."""
        return {a: grid.coord(a) for a in self.sharded if a in TENSOR_AXES and grid.size(a) > 1}

    def as_dict(self) -> dict:
        """A JSON-able record (checkpoints keep it: what resharding needs)."""
        return {"splits": [[s.dim, s.axis, s.chunks, s.stacked] for s in self.splits],
                "grad_sum": list(self.grad_sum), **({"pipe_peer": self.pipe_peer} if self.pipe_peer else {})}

    @classmethod
    def from_dict(cls, record: dict) -> Placement:
        """Inverse of :meth:`as_dict`."""
        return cls(tuple(Split(*split) for split in record["splits"]), tuple(record["grad_sum"]),
                   record.get("pipe_peer", 0))


def place(param: nn.Parameter, placement: Placement) -> nn.Parameter:
    """Attach ``placement`` to ``param``; returns it."""
    param._par4d_placement = placement  # type: ignore[attr-defined]
    return param


def placement_of(param: torch.Tensor) -> Placement | None:
    return getattr(param, "_par4d_placement", None)


def block(length: int, parts: int, index: int) -> slice:
    """The ``index``-th of ``parts`` equal contiguous blocks of ``length``."""
    size = length // parts
    return slice(index * size, (index + 1) * size)


def local_range(grid: Grid, length: int, axis: str) -> slice:
    """This rank's block of a dim of ``length`` split over ``axis``."""
    return block(length, grid.size(axis), grid.coord(axis))


def shard(grid: Grid, full: torch.Tensor, placement: Placement) -> torch.Tensor:
    """This rank's piece of ``full`` (a view where possible)."""
    t = full
    for s in placement.splits:
        if s.stacked:
            t = t.select(s.dim, grid.coord(s.axis))
            continue
        chunks = t.unflatten(s.dim, (s.chunks, t.shape[s.dim] // s.chunks))   # (..., c, L/c, ...)
        mine = local_range(grid, chunks.shape[s.dim + 1], s.axis)
        t = chunks.narrow(s.dim + 1, mine.start, mine.stop - mine.start).flatten(s.dim, s.dim + 1)
    return t


@torch.no_grad()
def unshard(grid: Grid, local: torch.Tensor, placement: Placement) -> torch.Tensor:
    """The full tensor on every rank (collective: one all-gather per split whose axis > 1);
    always a new tensor, never a view of ``local`` (which an optimizer step would change)."""
    t = local
    for s in reversed(placement.splits):
        if s.stacked:
            t = comm.all_gather_dim(grid, t.unsqueeze(s.dim), s.axis, s.dim)
            continue
        per_chunk = t.unflatten(s.dim, (s.chunks, t.shape[s.dim] // s.chunks))
        t = comm.all_gather_dim(grid, per_chunk, s.axis, s.dim + 1).flatten(s.dim, s.dim + 1)
    shares = t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()   # no gather ran
    return t.clone() if shares else t


@dataclass(frozen=True)
class Box:
    """A rectangle of a shard and where it lies in the full tensor: per full dim ``(start,
    length)`` in ``full``, and in ``local`` the shard's start per dim it keeps (a stacked dim
    has length 1 in the full tensor and no dim in the shard)."""

    full: tuple[tuple[int, int], ...]
    local: tuple[int | None, ...]     # per full dim: the shard's start, None for a dim the shard drops

    def as_list(self) -> list:
        return [[list(f) for f in self.full], list(self.local)]

    @classmethod
    def from_list(cls, record: list) -> Box:
        return cls(tuple(tuple(f) for f in record[0]), tuple(record[1]))


def boxes(placement: Placement, full_shape: tuple[int, ...], coords: dict[str, int],
          sizes: dict[str, int]) -> list[Box]:
    """The rectangles a shard is made of, for the rank at ``coords`` of a grid of ``sizes``:
    one unless a split has chunks (a fused qkv's shard is three). Follows :func:`shard` on
    one index vector per dim, never on the tensor, so it costs the dims' lengths only."""
    dims = [(d, torch.arange(n)) for d, n in enumerate(full_shape)]   # the tensor's dims as the splits see them
    fixed: dict[int, int] = {}
    for s in placement.splits:
        full_dim, index = dims[s.dim]
        if s.stacked:
            fixed[full_dim] = coords[s.axis]
            del dims[s.dim]
            continue
        chunks = index.view(s.chunks, -1)
        mine = block(chunks.shape[1], sizes.get(s.axis, 1), coords.get(s.axis, 0))   # (a folded axis may be absent)
        dims[s.dim] = (full_dim, chunks[:, mine].reshape(-1))
    runs: dict[int, list[tuple[int, int, int]]] = {}   # full dim -> (local start, full start, length)
    for full_dim, index in dims:   # runs of consecutive indices: where the next is not the last + 1
        starts = [0] + ((index[1:] != index[:-1] + 1).nonzero().flatten() + 1).tolist()
        ends = starts[1:] + [len(index)]
        runs[full_dim] = [(a, int(index[a]), b - a) for a, b in zip(starts, ends)]
    out = []
    ordered = sorted(runs)
    for combo in itertools.product(*(runs[d] for d in ordered)):
        chosen = dict(zip(ordered, combo))
        full = tuple((fixed[d], 1) if d in fixed else (chosen[d][1], chosen[d][2]) for d in range(len(full_shape)))
        local = tuple(None if d in fixed else chosen[d][0] for d in range(len(full_shape)))
        out.append(Box(full, local))
    return out


def overlap(saved: Box, wanted: Box) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(slices of the saved piece, slices of the wanted shard) where the two boxes meet."""
    src, dst = [], []
    for (s_start, s_len), s_local, (w_start, w_len), w_local in zip(saved.full, saved.local, wanted.full, wanted.local):
        lo, hi = max(s_start, w_start), min(s_start + s_len, w_start + w_len)
        if lo >= hi:
            return None
        if s_local is not None:
            src.append(slice(s_local + lo - s_start, s_local + hi - s_start))
        if w_local is not None:
            dst.append(slice(w_local + lo - w_start, w_local + hi - w_start))
    return tuple(src), tuple(dst)


Reader = Callable[[tuple[slice, ...]], torch.Tensor]
"""``read(slices)``: part of a source piece, cut by one slice per dim of the piece (none for a scalar)."""


def slice_reader(reader, key: str) -> Reader:
    """A :data:`Reader` of tensor ``key`` of an open ``safe_open`` file that reads only the slices asked for."""
    return lambda src: reader.get_slice(key)[src] if src else reader.get_tensor(key)


def fill(local: torch.Tensor, wanted: Box, source: Box, read: Reader) -> None:
    """Copy into ``local`` the part of its box ``wanted`` that the source piece's box ``source``
    covers, if the two meet; ``read`` gives that part of the piece. ``local`` is a rank's shard (its
    boxes from :func:`par4d.layout.boxes`) or a whole tensor; the source is a saved piece or a whole
    tensor of another file (``par4d.adopt.gpt2``): the one place that moves values between boxes."""
    where = overlap(source, wanted)
    if where is not None:
        src, dst = where
        local[dst] = read(src).to(local.device, local.dtype).reshape(local[dst].shape)


def shard_name(grid: Grid, name: str, placement: Placement) -> str:
    """``name@x1.z0``: a name that tells this rank's shard from the others' and is the
    same on ranks that hold the same piece (replicas), e.g. as a checkpoint key."""
    coords = placement.coords(grid)
    return name + ("@" + ".".join(f"{a}{c}" for a, c in coords.items()) if coords else "")


# -- activations -------------------------------------------------------------------

def batch_slice(grid: Grid, batch: int) -> slice:
    """Rows of a global batch held by this rank: blocks over data, then z inside."""
    if batch % grid.size("data", "z"):
        raise ValueError(f"global batch of {batch} samples is not divisible by data * z = "
                         f"{grid.size('data')} * {grid.size('z')} = {grid.size('data', 'z')}")
    return block(batch, grid.size("data", "z"), grid.coord("data") * grid.size("z") + grid.coord("z"))


def shard_batch(grid: Grid, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's samples (dim 0) of a global batch and, on a grid with a context axis, of each sample's
    sequence (dim 1) its two chunks (:func:`sequence_chunks`)."""
    return shard_sequence(grid, tensor[batch_slice(grid, tensor.shape[0])])


def sequence_chunks(grid: Grid, length: int) -> tuple[slice, slice]:
    """This rank's two chunks of a sequence of ``length`` tokens cut over ``context``: the sequence in 2C equal
    chunks, rank i holding chunks i and 2C-1-i, so that every rank has as much causal attention to compute
    (docs/architecture.md, "Long sequences")."""
    parts = 2 * grid.size("context")
    if length % parts:
        raise ValueError(f"a sequence of {length} tokens does not cut into 2 * context = {parts} equal chunks")
    i = grid.coord("context")
    return block(length, parts, i), block(length, parts, parts - 1 - i)


def shard_sequence(grid: Grid, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks (:func:`sequence_chunks`) of every sequence along ``dim``, in that order."""
    if grid.size("context") == 1:
        return tensor
    first, second = sequence_chunks(grid, tensor.shape[dim])
    return torch.cat([tensor.narrow(dim, c.start, c.stop - c.start) for c in (first, second)], dim)


def gather_sequence(grid: Grid, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Every rank's chunks of ``local`` (this rank's two, :func:`shard_sequence`) along ``dim``, in the sequence's
    order (collective over context: an all-gather; not differentiable)."""
    ranks = grid.size("context")
    if ranks == 1:
        return local
    pieces = comm.all_gather_dim(grid, local.contiguous(), "context", dim).chunk(2 * ranks, dim)
    # rank r's two chunks are pieces 2r (chunk r) and 2r+1 (chunk 2C-1-r)
    order = [2 * c if c < ranks else 2 * (2 * ranks - 1 - c) + 1 for c in range(2 * ranks)]
    return torch.cat([pieces[i] for i in order], dim)


def positions(grid: Grid, local: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of this rank's ``local`` tokens of a sequence (its two chunks over context)."""
    if grid.size("context") == 1:
        return torch.arange(local, device=device)
    first, second = sequence_chunks(grid, local * grid.size("context"))
    return torch.cat([torch.arange(c.start, c.stop, device=device) for c in (first, second)])


def shard_features(grid: Grid, tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """This rank's block of the last dim, split over ``axis``."""
    return tensor[..., local_range(grid, tensor.shape[-1], axis)]


def gather_features(grid: Grid, block_: torch.Tensor, axis: str) -> torch.Tensor:
    """Inverse of :func:`shard_features` (collective: an all-gather over ``axis``)."""
    return comm.all_gather_dim(grid, block_, axis, dim=block_.dim() - 1)


def shard_activation(grid: Grid, tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """A global activation (batch, ..., features) in par4d's layout."""
    return shard_features(grid, shard_batch(grid, tensor), axis)


__all__ = ["BATCH_AXES", "Box", "Placement", "REPLICAS", "Reader", "Split", "batch_slice", "boxes", "block", "fill",
           "gather_features", "gather_sequence", "local_range", "overlap", "place", "placement_of", "positions",
           "sequence_chunks", "shard", "shard_activation", "shard_batch", "shard_features", "shard_name",
           "shard_sequence", "slice_reader", "unshard"]
