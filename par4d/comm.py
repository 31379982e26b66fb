"""Collectives over grid axes, and the ledger that records every one of them.

Message sizes follow DESIGN §4: ``elements`` is the per-rank message ``m`` of the
ring model — the input shard for an all-gather, the full input for a
reduce-scatter, the buffer for an all-reduce. A collective over an axis of size 1
is a no-op and is not recorded (its (G - 1) factor is zero).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from par4d.grid import Grid

KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.4) have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Entry:
    """One collective: its kind, the axes it spans, its per-rank message, time waited."""

    kind: str
    axes: tuple[str, ...]
    elements: int
    bytes: int
    seconds: float = 0.0


@dataclass
class Total:
    count: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Ledger:
    """Running totals per (kind, axes), plus full entries while :meth:`capture` is on."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, tuple[str, ...]], Total] = defaultdict(Total)
        self._captures: list[list[Entry]] = []

    def record(self, entry: Entry) -> None:
        total = self.totals[(entry.kind, entry.axes)]
        total.count += 1
        total.elements += entry.elements
        total.bytes += entry.bytes
        total.seconds += entry.seconds
        for captured in self._captures:
            captured.append(entry)

    def _waited(self, entry: Entry, seconds: float) -> None:
        # Async handles report their wait after the entry was recorded.
        entry.seconds += seconds
        self.totals[(entry.kind, entry.axes)].seconds += seconds

    @contextmanager
    def capture(self) -> Iterator[list[Entry]]:
        """Collect every entry recorded inside the ``with`` block into a list."""
        entries: list[Entry] = []
        self._captures.append(entries)
        try:
            yield entries
        finally:
            self._captures.remove(entries)

    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.totals.values())

    def total_seconds(self) -> float:
        return sum(t.seconds for t in self.totals.values())


class Handle:
    """An in-flight collective; :meth:`wait` blocks and books the waited time."""

    def __init__(self, work: dist.Work | None, ledger: Ledger, entry: Entry | None, result: torch.Tensor):
        self._work, self._ledger, self._entry, self.result = work, ledger, entry, result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            self._ledger._waited(self._entry, time.perf_counter() - start)
            self._work = None
        return self.result


def _issue(grid: Grid, kind: str, axes: tuple[str, ...], message: torch.Tensor, run, async_op: bool, result):
    entry = Entry(kind, axes, message.numel(), message.numel() * message.element_size())
    grid.ledger.record(entry)
    start = time.perf_counter()
    work = run(async_op)
    if async_op:
        return Handle(work, grid.ledger, entry, result)
    grid.ledger._waited(entry, time.perf_counter() - start)
    return result


def all_reduce(grid: Grid, tensor: torch.Tensor, *axes: str, op=dist.ReduceOp.SUM, async_op: bool = False):
    """Sum (or ``op``) ``tensor`` in place over ``axes``; returns it (or a Handle)."""
    if grid.size(*axes) == 1:
        return Handle(None, grid.ledger, None, tensor) if async_op else tensor
    group = grid.group(*axes)
    return _issue(grid, "all_reduce", tuple(axes), tensor,
                  lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op, tensor)


def all_gather(grid: Grid, shard: torch.Tensor, axis: str, async_op: bool = False):
    """Concatenate the shards of ``axis`` along dim 0, in coordinate order."""
    size = grid.size(axis)
    if size == 1:
        return Handle(None, grid.ledger, None, shard) if async_op else shard
    shard = shard.contiguous()
    out = shard.new_empty((shard.shape[0] * size, *shard.shape[1:]))
    group = grid.group(axis)
    return _issue(grid, "all_gather", (axis,), shard,
                  lambda a: _all_gather_single(out, shard, group=group, async_op=a), async_op, out)


def reduce_scatter(grid: Grid, full: torch.Tensor, axis: str, async_op: bool = False):
    """Sum ``full`` over ``axis`` and keep this rank's dim-0 block."""
    size = grid.size(axis)
    if size == 1:
        return Handle(None, grid.ledger, None, full) if async_op else full
    full = full.contiguous()
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    group = grid.group(axis)
    return _issue(grid, "reduce_scatter", (axis,), full,
                  lambda a: _reduce_scatter_single(out, full, group=group, async_op=a), async_op, out)


def all_gather_dim(grid: Grid, shard: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Concatenate the shards of ``axis`` along ``dim`` (assembly for tests/export)."""
    if grid.size(axis) == 1:
        return shard
    moved = shard.movedim(dim, 0)
    return all_gather(grid, moved, axis).movedim(0, dim)
