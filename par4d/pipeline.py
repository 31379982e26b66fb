"""The message-driven pipeline over the pipe axis (the async-pipeline paper's Algorithm 2).

Each pipeline stage is a group of ranks with the same ``pipe`` coordinate, holding a
contiguous run of the model's blocks (``GPTConfig.stage_blocks``) on its own x, y, z,
data sub-grid; a rank talks only to the ranks with its own coordinates in the stages
before and after it, and sends them its own shard of the residual stream (every block
takes and returns the same layout, so shards line up).

A step cuts this rank's batch shard into ``M`` microbatches. No schedule is fixed: a
stage runs whatever arrives first, an activation from the stage before (forward) or a
gradient from the stage after (backward); the last stage runs a microbatch's backward
right after its forward; the first stage starts a new microbatch whenever one finishes
its backward, keeping at most ``limit`` in flight (default ``pipe``: the paper's bound on
activation memory, Lemma 5.1). Sends never block. A message is a header (microbatch,
dtype, shape: shapes may change between batches) and then the tensor.

The loss is the whole shard's: microbatch m's mean loss is weighted by its share of the
rows before its backward, so gradients accumulate to those of one pass over the shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from par4d import comm
from par4d.grid import Grid

HEADER = 9                    # int64s: kind, microbatch, dtype index, ndim, up to 5 dims
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEADER_TAG, FORWARD, BACKWARD = 1, 2, 3   # message tags: every header, then a payload tagged with its kind
POLL_S = 1e-4                 # between looks at two pending receives (NCCL)


@dataclass
class PipelineStats:
    """What one step did on this rank: its order of work (``F3``: forward of microbatch 3,
    ``B3``: its backward) and the most microbatches it held in flight at once."""

    microbatches: int
    order: list[str] = field(default_factory=list)
    max_in_flight: int = 0


class _Inbox:
    """The messages a stage expects in one step: ``forward`` activations from the stage before,
    ``backward`` gradients from the stage after, taken in the order they arrive.

    The ranks of one stage that share collectives (its x, y, z group) must take them in one
    order, or their layers' all-reduces and gathers would pair different microbatches. So one
    of them, the leader (coordinate 0 of x, y, z), takes whichever message arrives first and
    broadcasts its kind; the others then receive a message of that kind from their own
    neighbour (each neighbour stage sends in its own agreed order, so it is the same one).

    Which came first, on the leader: on gloo one header receive from any source is kept
    posted (a gloo receive cannot be polled: it completes only inside ``wait``); NCCL has no
    receive from any source, but its receives can be polled, so one per neighbour is."""

    def __init__(self, grid: Grid, forward: int, backward: int):
        self.grid, self.due = grid, {FORWARD: forward, BACKWARD: backward}
        self.shared = grid.size("x", "y", "z") > 1
        self.leader = all(grid.coord(a) == 0 for a in ("x", "y", "z"))
        self.any_source = grid.device.type == "cpu"
        self.headers = {kind: torch.empty(HEADER, dtype=torch.int64, device=grid.device) for kind in self.due}
        self.pending: dict[int, comm.Handle] = {}
        if self.leader:
            for kind in ((HEADER_TAG,) if self.any_source else (FORWARD, BACKWARD)):
                self._post(kind)

    def _post(self, kind: int) -> None:
        if self.any_source:
            if sum(self.due.values()):
                self.pending[kind] = comm.recv(self.grid, self.headers[FORWARD], "pipe", None, HEADER_TAG)
        elif self.due[kind]:
            self.pending[kind] = comm.recv(self.grid, self.headers[kind], "pipe", _SOURCE[kind], HEADER_TAG)

    def _arrived(self) -> tuple[int, torch.Tensor]:
        """(the pending key, the header) of the message that arrived first."""
        if len(self.pending) == 1:
            key = next(iter(self.pending))
            self.pending.pop(key).wait()
            return key, self.headers[FORWARD if self.any_source else key]
        while True:
            for key, handle in self.pending.items():
                if handle.done():
                    self.pending.pop(key).wait()
                    return key, self.headers[key]
            time.sleep(POLL_S)

    def _kind(self) -> tuple[int, torch.Tensor | None]:
        """(the kind of the next message, its header if this rank took it already)."""
        key, header = self._arrived() if self.leader else (None, None)
        if not self.shared:
            return int(header[0]), header
        kind = torch.tensor([0 if header is None else int(header[0])], dtype=torch.int64, device=self.grid.device)
        comm.broadcast(self.grid, kind, "x", "y", "z")
        return int(kind[0]), header

    def take(self) -> tuple[int, int, torch.Tensor]:
        """(kind, microbatch, tensor) of the next message (waits for it)."""
        kind, header = self._kind()
        if header is None:      # not the leader: this rank's own message of that kind
            header = self.headers[kind]
            comm.recv(self.grid, header, "pipe", _SOURCE[kind], HEADER_TAG).wait()
        _, microbatch, dtype, ndim = header[:4].tolist()
        shape = header[4:4 + ndim].tolist()
        buffer = torch.empty(shape, dtype=DTYPES[dtype], device=self.grid.device)
        comm.recv(self.grid, buffer, "pipe", _SOURCE[kind], kind).wait()
        self.due[kind] -= 1
        if self.leader:
            self._post(HEADER_TAG if self.any_source else kind)
        return kind, microbatch, buffer


_SOURCE = {FORWARD: -1, BACKWARD: +1}   # activations come from the stage before, gradients from the one after


def _send(grid: Grid, tensor: torch.Tensor, kind: int, microbatch: int) -> list[comm.Handle]:
    if tensor.dim() > HEADER - 4:
        raise ValueError(f"pipeline messages have at most {HEADER - 4} dims, got shape {tuple(tensor.shape)}")
    header = torch.zeros(HEADER, dtype=torch.int64, device=grid.device)
    header[:4] = torch.tensor([kind, microbatch, DTYPES.index(tensor.dtype), tensor.dim()])
    header[4:4 + tensor.dim()] = torch.tensor(tensor.shape)
    to = -_SOURCE[kind]
    return [comm.send(grid, header, "pipe", to, HEADER_TAG), comm.send(grid, tensor, "pipe", to, kind)]


def run_pipeline(model: nn.Module, grid: Grid, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
                 limit: int | None = None, loss_scale: float = 1.0) -> tuple[torch.Tensor, PipelineStats]:
    """Forward and backward of this rank's batch shard through the pipeline; gradients
    accumulate in ``.grad`` (not yet summed over data and z). Returns the shard's mean loss
    (on every stage: the last stage's, shared over pipe) and what this rank did.

    ``model`` has ``stage_forward(inputs, targets=None)``, ``first`` and ``last``
    (par4d's GPT). ``inputs`` are used on the first stage, ``targets`` on the last; every
    stage must pass the same ``microbatches``. ``loss_scale`` multiplies what backward starts
    from (mixed precision's fp16 scale); the loss returned is not scaled."""
    stages = grid.size("pipe")
    limit = stages if limit is None else limit
    rows = inputs.shape[0]
    if not 1 <= microbatches <= rows:
        raise ValueError(f"--microbatches {microbatches}: give 1 to this rank's {rows} sequences "
                         f"(the batch over data x z)")
    if limit < 1:
        raise ValueError(f"pipeline limit {limit}: at least one microbatch must be in flight")
    chunks_in = torch.tensor_split(inputs, microbatches)
    chunks_out = torch.tensor_split(targets, microbatches)
    weights = [len(chunk) / rows for chunk in chunks_in]
    stats = PipelineStats(microbatches)
    inbox = _Inbox(grid, forward=0 if model.first else microbatches, backward=0 if model.last else microbatches)
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends: list[comm.Handle] = []
    loss_sum = torch.zeros(1, device=grid.device)
    started = finished = 0

    def forward(micro: int, received: torch.Tensor | None) -> None:
        nonlocal finished
        stats.order.append(f"F{micro}")
        stage_in = chunks_in[micro] if model.first else received.requires_grad_()
        if model.last:
            loss = model.stage_forward(stage_in, chunks_out[micro])
            loss_sum.add_(loss.detach() * weights[micro])
            stats.order.append(f"B{micro}")
            (loss * (weights[micro] * loss_scale)).backward()
            finished += 1
            sends.extend(_send(grid, stage_in.grad, BACKWARD, micro))
            return
        saved[micro] = (None if model.first else stage_in, model.stage_forward(stage_in))
        stats.max_in_flight = max(stats.max_in_flight, len(saved))
        sends.extend(_send(grid, saved[micro][1].detach(), FORWARD, micro))

    def start_next() -> None:
        nonlocal started
        if started < microbatches:
            started += 1
            forward(started - 1, None)

    def backward(micro: int, grad: torch.Tensor) -> None:
        nonlocal finished
        stats.order.append(f"B{micro}")
        stage_in, out = saved.pop(micro)
        out.backward(grad)
        finished += 1
        if model.first:
            start_next()
        else:
            sends.extend(_send(grid, stage_in.grad, BACKWARD, micro))

    if model.first:
        for _ in range(min(limit, microbatches)):
            start_next()
    while finished < microbatches:
        kind, micro, tensor = inbox.take()
        if kind == FORWARD:
            forward(micro, tensor)
        else:
            backward(micro, tensor)
        for handle in [s for s in sends if s.done()]:   # book the finished ones as it goes
            handle.wait()
            sends.remove(handle)
    for handle in sends:
        handle.wait()
    comm.all_reduce(grid, loss_sum, "pipe")          # only the last stage had a loss
    return loss_sum[0], stats


@torch.no_grad()
def evaluate_pipeline(model: nn.Module, grid: Grid, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean loss of this rank's shard, forward only, stage after stage (no microbatches:
    nothing is kept for a backward); on every stage."""
    if model.first:
        h = model.stage_forward(inputs)
    else:
        _, _, h = _Inbox(grid, forward=1, backward=0).take()
    loss = torch.zeros(1, device=grid.device)
    if model.last:
        loss += model.stage_forward(h, targets)
    else:
        for handle in _send(grid, h, FORWARD, 0):
            handle.wait()
    comm.all_reduce(grid, loss, "pipe")
    return loss[0]
