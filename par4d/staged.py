"""Collectives in stages over a group that spans nodes (docs/architecture.md, "Staged collectives").

* all-reduce: reduce-scattered inside the node, each rank's ``1/L`` share all-reduced across
  the link with the ranks at its position on the other nodes, the shares all-gathered inside
  the node again; in chunks, so one chunk crosses the link while the next is summed inside;
* reduce-scatter: reduce-scattered inside the node, the rank's share reduce-scattered across;
* all-gather: gathered across the link, then inside the node.

Each node sends its ``(K - 1) / K`` part of the message across the link once per ring pass
(``K`` nodes, ``L`` of the group's ranks on each). Inside the node a reduce-scatter is an
all-to-all and a sum on the receiving rank (gloo's own reduce-scatter is an all-reduce and a
copy: measured 3.3 ms against 4.7 for 3.5 MB over two ranks).

Stages depend on each other and must not hold up the rank's compute, so three threads per
grid run them (:class:`Stager`), one per *lane*: the reductions inside the node, the link,
the gathers inside the node. Each lane has its own process group and runs its steps in the
order this rank issued the collectives, each step once the step before it in its chunk is
done. Every rank issues the same collectives in the same order, so every lane issues the
same collectives in the same order on every rank, whatever the timing; and the link is
kept busy while the node lanes work on other chunks and other collectives.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from par4d.eager import eager
from par4d.ledger import Entry, Ledger

if TYPE_CHECKING:
    from par4d.grid import Grid, Stages

# torch 2.13 renamed the single-tensor collectives; older releases (>= 2.4) have the old names (comm uses these too).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

REDUCE, LINK, GATHER = 0, 1, 2      # lanes: inside the node (reductions), across the link, inside (gathers)

CHUNK_BYTES = 512 * 1024
"""A staged all-reduce goes in chunks of about this size, so that one chunk's node stages run while
another's link stage does (the link is the slow stage; with one chunk the node stages add to it)."""
MAX_CHUNKS = 8


class _Job:
    """One staged collective: its chunks, each a run of (lane, step) in order; ``spans``: per lane,
    the first start and last end of its steps."""

    def __init__(self, chunks: list[list[tuple[int, Callable[[], None]]]]):
        self.chunks = chunks
        self.spans = {lane: [float("inf"), 0.0] for chunk in chunks for lane, _ in chunk}
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._left = len(chunks)
        self._lock = threading.Lock()

    def chunk_done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.finished.set()


class _Step:
    def __init__(self, job: _Job, lane: int, run: Callable[[], None]):
        self.job, self.lane, self.run = job, lane, run
        self.ready = threading.Event()
        self.next: _Step | None = None


class Stager:
    """Three daemon threads, one per lane, each running its steps in issue order."""

    def __init__(self) -> None:
        self._lanes: list[queue.SimpleQueue[_Step | None]] = [queue.SimpleQueue() for _ in range(3)]
        self._threads = [threading.Thread(target=self._serve, args=(lane,), name=f"par4d-stager-{index}", daemon=True)
                         for index, lane in enumerate(self._lanes)]
        # After a failed stage this rank is out of step with its peers on the stage groups: every later step
        # fails at once with the same error instead of issuing collectives its peers no longer match.
        self.broken: BaseException | None = None
        for thread in self._threads:
            thread.start()

    def _serve(self, lane: queue.SimpleQueue) -> None:
        while (step := lane.get()) is not None:
            step.ready.wait()
            job = step.job
            if job.error is None and self.broken is not None:
                job.error = self.broken
            if job.error is None:
                try:
                    start = time.perf_counter()
                    with torch.no_grad():    # grad mode is per thread: the caller's autograd Function ran without it
                        step.run()
                    span = job.spans[step.lane]
                    span[0], span[1] = min(span[0], start), max(span[1], time.perf_counter())
                except BaseException as error:    # handed to the waiting caller
                    job.error = self.broken = error
            if step.next is not None:
                step.next.ready.set()
            else:
                job.chunk_done()

    def submit(self, job: _Job) -> None:
        for chunk in job.chunks:
            steps = [_Step(job, lane, run) for lane, run in chunk]
            for before, after in zip(steps, steps[1:]):
                before.next = after
            steps[0].ready.set()
            for step in steps:
                self._lanes[step.lane].put(step)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the lanes once their queued steps are done; False if one is still running after ``timeout``
        seconds (stuck in a collective whose peers are gone: its groups must not be destroyed under it)."""
        for lane in self._lanes:
            lane.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


class StagedHandle:
    """A staged collective in flight: ``done``, ``block`` and ``wait`` as ``comm.Handle``'s. ``wait``
    books each stage's entry: in flight from its first start to its last end, and the part of this
    rank's wait it owns (stages overlap: each moment goes to the earliest stage not finished yet; the
    rest of the wait, before any stage began or between them, goes to the first); the parts add up to
    the wait."""

    def __init__(self, job: _Job, ledger: Ledger, entries: list[tuple[int, Entry]], result: torch.Tensor,
                 finish: Callable[[], torch.Tensor] | None = None):
        self._job, self._ledger, self._entries, self.result, self._finish = job, ledger, entries, result, finish
        self._waited = False

    def done(self) -> bool:
        return self._job.finished.is_set()

    def block(self) -> None:
        self._job.finished.wait()

    def wait(self) -> torch.Tensor:
        if self._waited:
            return self.result
        start = time.perf_counter()
        self._job.finished.wait()
        end = time.perf_counter()
        first = self._entries[0][1]
        if self._job.error is not None:      # raised on every wait: the result is not the sum
            raise RuntimeError(f"a staged {first.kind} over {first.axes} failed: {self._job.error}") \
                from self._job.error
        self._waited = True
        spans = [self._job.spans[lane] for lane, _ in self._entries]
        owned, since = [], float("-inf")
        for a, b in spans:
            owned.append((max(a, since), b))
            since = max(since, b)
        inside = [max(0.0, min(end, b) - max(start, a)) for a, b in owned]
        inside[0] += max(0.0, (end - start) - sum(inside))
        for (_, entry), (a, b), seconds in zip(self._entries, spans, inside):
            entry.issued_at = a          # a stage is in flight from its lane's first start (in_flight_seconds)
            self._ledger.waited(entry, seconds, b - a)
        if self._finish is not None:
            self.result = self._finish()
            self._finish = None
        return self.result


def _issue(grid: Grid, axes: tuple[str, ...], stages: list[tuple[int, str, int]], element_size: int,
           chunks: list[list[tuple[int, Callable[[], None]]]], result: torch.Tensor, async_op: bool,
           finish: Callable[[], torch.Tensor] | None = None):
    """Record one entry per stage ((lane, kind, per-rank message) each), hand the job to the grid's stager."""
    now = time.perf_counter()
    entries = []
    for lane, kind, m in stages:
        entry = Entry(kind, axes, m, m * element_size, issued_at=now, overlapped=async_op,
                      stage="link" if lane == LINK else "node")
        grid.ledger.record(entry)
        entries.append((lane, entry))
    job = _Job(chunks)
    if grid._stager is None:      # the grid closes it (Grid.close)
        grid._stager = Stager()
    grid._stager.submit(job)
    handle = StagedHandle(job, grid.ledger, entries, result, finish)
    return handle if async_op else handle.wait()


def _node_reduce_scatter(stages: Stages, full: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the sum over the node group of everyone's block ``position`` of ``full`` (dim 0 in
    ``per_node`` blocks): an all-to-all, then the blocks received added in node order."""
    received = torch.empty_like(full)
    dist.all_to_all_single(received, full, group=stages.node)
    blocks = received.view(stages.split.per_node, -1)
    out.view(-1).copy_(blocks[0])
    for block in blocks[1:]:
        out.view(-1).add_(block)


@eager      # as comm's collectives: eager in a compiled block
def all_reduce(grid: Grid, stages: Stages, tensor: torch.Tensor, axes: tuple[str, ...], async_op: bool):
    """Sum ``tensor`` (contiguous) in place over ``axes`` in three stages, chunk by chunk."""
    per_node, n = stages.split.per_node, tensor.numel()
    chunks = max(1, min(MAX_CHUNKS, n * tensor.element_size() // CHUNK_BYTES))
    share = -(-n // (per_node * chunks))          # elements of one rank's share of one chunk
    width = share * per_node
    exact = width * chunks == n
    padded = tensor.view(-1) if exact else torch.zeros(width * chunks, dtype=tensor.dtype, device=tensor.device)
    parts = padded.view(chunks, width)
    mine = torch.empty(chunks, share, dtype=tensor.dtype, device=tensor.device)

    def ends(c: int) -> tuple[int, int]:
        return min(n, c * width), min(n, (c + 1) * width)

    def reduce(c: int) -> Callable[[], None]:
        def run() -> None:
            if not exact:
                a, b = ends(c)
                padded[a:b].copy_(tensor.view(-1)[a:b])
            _node_reduce_scatter(stages, parts[c], mine[c])
        return run

    def gather(c: int) -> Callable[[], None]:
        def run() -> None:
            all_gather_single(parts[c], mine[c], group=stages.node_out)
            if not exact:
                a, b = ends(c)
                tensor.view(-1)[a:b].copy_(padded[a:b])
        return run

    steps = [[(REDUCE, reduce(c)), (LINK, lambda c=c: dist.all_reduce(mine[c], group=stages.link)),
              (GATHER, gather(c))] for c in range(chunks)]
    return _issue(grid, axes, [(REDUCE, "reduce_scatter", width * chunks), (LINK, "all_reduce", share * chunks),
                               (GATHER, "all_gather", share * chunks)],
                  tensor.element_size(), steps, tensor, async_op)


def _blocks(full: torch.Tensor, order: tuple[int, ...] | None, inverse: bool = False) -> torch.Tensor:
    """``full``'s dim-0 blocks (one per group member) in staging order (``inverse``: back to group order)."""
    if order is None:
        return full
    blocks = full.view(len(order), -1, *full.shape[1:])
    if inverse:
        out = torch.empty_like(blocks)
        out[list(order)] = blocks
        return out.view(full.shape)
    return blocks[list(order)].reshape(full.shape)


@eager      # as comm's collectives: eager in a compiled block
def reduce_scatter(grid: Grid, stages: Stages, full: torch.Tensor, axis: str, async_op: bool):
    """Sum ``full`` over ``axis`` and keep this rank's dim-0 block, in two stages."""
    split = stages.split
    rows = full.shape[0] // (split.nodes * split.per_node)
    out = full.new_empty((rows, *full.shape[1:]))
    mine = full.new_empty((rows * split.nodes, *full.shape[1:]))     # this rank's share of its node's sum

    def reduce() -> None:
        _node_reduce_scatter(stages, _blocks(full, split.order).contiguous(), mine)

    return _issue(grid, (axis,), [(REDUCE, "reduce_scatter", full.numel()), (LINK, "reduce_scatter", mine.numel())],
                  full.element_size(),
                  [[(REDUCE, reduce), (LINK, lambda: reduce_scatter_single(out, mine, group=stages.link))]],
                  out, async_op)


@eager      # as comm's collectives: eager in a compiled block
def all_gather(grid: Grid, stages: Stages, shard: torch.Tensor, axis: str, async_op: bool):
    """Concatenate the shards of ``axis`` along dim 0, in coordinate order, in two stages."""
    split = stages.split
    across = shard.new_empty((shard.shape[0] * split.nodes, *shard.shape[1:]))
    gathered = shard.new_empty((across.shape[0] * split.per_node, *shard.shape[1:]))
    steps = [[(LINK, lambda: all_gather_single(across, shard, group=stages.link)),
              (GATHER, lambda: all_gather_single(gathered, across, group=stages.node_out))]]
    return _issue(grid, (axis,), [(LINK, "all_gather", shard.numel()), (GATHER, "all_gather", across.numel())],
                  shard.element_size(), steps, gathered, async_op,
                  finish=None if split.order is None else lambda: _blocks(gathered, split.order, inverse=True))
