"""Collectives over grid axes, sync or async, each recorded in the grid's ledger.

Message sizes follow the ring model (docs/architecture.md, "Collectives and the
ledger"): ``elements`` is the per-rank message ``m`` — the input shard for an
all-gather, the full input for a reduce-scatter, the buffer for an all-reduce or a
broadcast. A collective over an axis of size 1 is a no-op and is not recorded (its
(G - 1) factor is zero). Where the grid's group for the axes spans nodes, all-reduce,
all-gather and reduce-scatter go in stages (par4d.staged; ``Grid.stages`` says when): the
same result, one ledger entry per stage.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from par4d import staged
from par4d.eager import eager
from par4d.grid import coords_of, rank_of
from par4d.ledger import Entry, Ledger

if TYPE_CHECKING:
    from par4d.grid import Grid

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The ring collectives of the communication model (what calibration measures)."""



class Handle:
    """An in-flight collective; :meth:`wait` blocks and books the waited time.

    Its completion time is when it is first seen completed: by the ledger's probes (:meth:`Ledger.probe`),
    by :meth:`done`, or at the start of :meth:`wait`; else the end of the wait stands in for it.
    """

    def __init__(self, work: dist.Work | None, ledger: Ledger, entry: Entry | None, result: torch.Tensor):
        self._work, self._ledger, self._entry, self.result = work, ledger, entry, result
        self._done_at: float | None = None
        self._blocked = False
        if work is not None:
            ledger.watched.append(self)

    def seen_done(self, now: float) -> bool:
        if self._done_at is None and (self._work is None or self._work.is_completed()):
            self._done_at = now
        return self._done_at is not None

    @eager
    def done(self) -> bool:
        """Whether it completed (never blocks): for code that acts on whichever message comes first."""
        return self.seen_done(time.perf_counter())

    @eager
    def block(self) -> None:
        """Wait for completion without booking it (for a thread that watches arrivals; the
        owner still calls :meth:`wait`, which then returns at once: a gloo receive's ``wait``
        must run once, a second would wait for another message)."""
        if self._work is not None and not self._blocked:
            self._work.wait()
            self._blocked = True
            self.seen_done(time.perf_counter())     # (a probe may have seen it first)

    @eager
    def wait(self) -> torch.Tensor:
        if self._work is not None:
            start = time.perf_counter()
            if not self._blocked:
                self.seen_done(start)
                self._work.wait()
            end = time.perf_counter()
            done = self._done_at if self._done_at is not None else end
            self._ledger.waited(self._entry, end - start, max(0.0, min(done, end) - self._entry.issued_at))
            self._work = None
            if self in self._ledger.watched:    # (not probed since it completed): it holds its result
                self._ledger.watched.remove(self)
        return self.result


@eager      # a graph break in a compiled block (par4d.compiled): the collective runs eagerly
def _issue(grid: Grid, kind: str, axes: tuple[str, ...], message: torch.Tensor, run, async_op: bool, result,
           elements: int | None = None):
    """Record ``kind`` (its per-rank message: ``message``, or ``elements`` of its dtype), run it, and book the
    wait where it is waited for."""
    grid.ledger.probe()
    start = time.perf_counter()
    elements = message.numel() if elements is None else elements
    entry = Entry(kind, axes, elements, elements * message.element_size(), issued_at=start, overlapped=async_op)
    grid.ledger.record(entry)
    work = run(async_op)
    if async_op:
        return Handle(work, grid.ledger, entry, result)
    seconds = time.perf_counter() - start
    grid.ledger.waited(entry, seconds, seconds)
    return result


def _present(grid: Grid, axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` without a context axis of one rank: a collective over the batch's axes (z, context, data) on
    a grid without one is the one it was before there was a context axis (its group, its ledger entry)."""
    return tuple(a for a in axes if a != "context" or grid.size(a) > 1)


def _nothing(grid: Grid, result: torch.Tensor, async_op: bool):
    return Handle(None, grid.ledger, None, result) if async_op else result


def all_reduce(grid: Grid, tensor: torch.Tensor, *axes: str, op=dist.ReduceOp.SUM, async_op: bool = False,
               within: str | None = None):
    """Sum (or ``op``) ``tensor`` in place over ``axes``; returns it (or a Handle). ``within`` a folded axis:
    over those ranks only that share this rank's coordinate on it (an expert's replicas), flat."""
    if grid.size(*axes, within=within) == 1:
        return _nothing(grid, tensor, async_op)
    axes = _present(grid, axes)
    if within is not None:
        group = grid.group(*axes, within=within)
        return _issue(grid, "all_reduce", tuple(axes), tensor,
                      lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op, tensor)
    staged_ok = tensor.is_contiguous() and op == dist.ReduceOp.SUM     # stages sum (a max runs flat)
    stages = grid.stages(axes, tensor.numel() * tensor.element_size()) if staged_ok else None
    if stages is not None:
        return staged.all_reduce(grid, stages, tensor, tuple(axes), async_op)
    group = grid.group(*axes)
    return _issue(grid, "all_reduce", tuple(axes), tensor,
                  lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op, tensor)


def all_gather(grid: Grid, shard: torch.Tensor, axis: str, async_op: bool = False):
    """Concatenate the shards of ``axis`` along dim 0, in coordinate order."""
    size = grid.size(axis)
    if size == 1:
        return _nothing(grid, shard, async_op)
    shard = shard.contiguous()
    stages = grid.stages((axis,), shard.numel() * shard.element_size())
    if stages is not None:
        return staged.all_gather(grid, stages, shard, axis, async_op)
    out = shard.new_empty((shard.shape[0] * size, *shard.shape[1:]))
    group = grid.group(axis)
    return _issue(grid, "all_gather", (axis,), shard,
                  lambda a: staged.all_gather_single(out, shard, group=group, async_op=a), async_op, out)


def reduce_scatter(grid: Grid, full: torch.Tensor, axis: str, async_op: bool = False):
    """Sum ``full`` over ``axis`` and keep this rank's dim-0 block."""
    size = grid.size(axis)
    if size == 1:
        return _nothing(grid, full, async_op)
    full = full.contiguous()
    stages = grid.stages((axis,), full.numel() * full.element_size())
    if stages is not None:
        return staged.reduce_scatter(grid, stages, full, axis, async_op)
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    group = grid.group(axis)
    return _issue(grid, "reduce_scatter", (axis,), full,
                  lambda a: staged.reduce_scatter_single(out, full, group=group, async_op=a), async_op, out)


def all_to_all(grid: Grid, rows: torch.Tensor, axis: str, send: list[int], receive: list[int],
               async_op: bool = False):
    """Exchange rows (dim 0) over ``axis``: ``send[i]`` consecutive rows of ``rows`` go to the axis's i-th
    rank, in coordinate order, and ``receive[i]`` come from it, concatenated in that order (uneven counts: a
    mixture of experts' dispatch). The ledger's message is what this rank sends to the others (its own
    rows stay), counted exactly."""
    if grid.size(axis) == 1:
        return _nothing(grid, rows, async_op)
    rows = rows.contiguous()
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    group, others = grid.group(axis), sum(send) - send[grid.coord(axis)]
    return _issue(grid, "all_to_all", (axis,), rows,
                  lambda a: dist.all_to_all_single(out, rows, receive, send, group=group, async_op=a), async_op, out,
                  elements=others * math.prod(rows.shape[1:]))


def broadcast(grid: Grid, tensor: torch.Tensor, *axes: str) -> torch.Tensor:
    """Overwrite ``tensor`` in place with that of coordinate 0 along ``axes``; returns it."""
    if grid.size(*axes) == 1:
        return tensor
    axes = _present(grid, axes)
    group, source = grid.group(*axes), grid.group_ranks(*axes)[0]
    return _issue(grid, "broadcast", tuple(axes), tensor,
                  lambda a: dist.broadcast(tensor, src=source, group=group, async_op=a), False, tensor)


def all_gather_dim(grid: Grid, shard: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Concatenate the shards of ``axis`` along ``dim``."""
    if grid.size(axis) == 1:
        return shard
    moved = shard.movedim(dim, 0)
    return all_gather(grid, moved, axis).movedim(0, dim)


def neighbour(grid: Grid, axis: str, offset: int, ring: bool = False) -> int:
    """Global rank of the rank ``offset`` steps along ``axis`` (same coordinates on the others); ``ring``: the
    axis closed into a ring (the last rank's next is the first)."""
    coords = coords_of(grid.rank, grid.sizes)
    coords[axis] += offset
    if ring:
        coords[axis] %= grid.size(axis)
    if not 0 <= coords[axis] < grid.size(axis):
        raise ValueError(f"rank {grid.rank} has no neighbour {offset:+d} along {axis} (size {grid.size(axis)})")
    return rank_of(coords, grid.sizes)


def send(grid: Grid, tensor: torch.Tensor, axis: str, offset: int, tag: int = 0, ring: bool = False) -> Handle:
    """Send ``tensor`` to the neighbour ``offset`` along ``axis`` (non-blocking; keep the
    handle, and the tensor, until it is waited; ``ring``: see :func:`neighbour`). Point-to-point entries
    (``send``, ``recv``) carry the message's bytes on each side."""
    tensor = tensor.contiguous()
    peer = neighbour(grid, axis, offset, ring)
    return _issue(grid, "send", (axis,), tensor, lambda a: dist.isend(tensor, dst=peer, tag=tag), True, tensor)


def recv(grid: Grid, buffer: torch.Tensor, axis: str, offset: int, tag: int = 0, ring: bool = False) -> Handle:
    """Receive into ``buffer`` from the neighbour ``offset`` along ``axis`` (non-blocking)."""
    peer = neighbour(grid, axis, offset, ring)
    return _issue(grid, "recv", (axis,), buffer, lambda a: dist.irecv(buffer, src=peer, tag=tag), True, buffer)
