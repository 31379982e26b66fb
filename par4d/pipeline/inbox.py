"""A pipeline stage's inbox: the messages it expects in one step, and which kind it takes next.

The message-driven schedule (:mod:`par4d.pipeline.schedule`) runs whatever has arrived; this
module knows what has: receives posted ahead, watched on gloo by one thread per kind, polled
on NCCL, and the one order the ranks of a stage agree to take them in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from par4d import comm
from par4d.grid import Grid

FORWARD, BACKWARD = 2, 3      # message tags: activations go forward, their gradients back
SOURCE = {FORWARD: -1, BACKWARD: +1}   # activations come from the stage before, gradients from the one after
POLL_S = 1e-4                 # between looks at pending receives (NCCL, whose receives can be polled)
WAIT_S = 1.0                  # longest sleep of the leader between checks for a watcher's error

StreamShape = Callable[[int], tuple[tuple[int, ...], torch.dtype]]   # rows -> the message's shape and dtype



class Inbox:
    """The messages a stage expects in one step, per kind (``FORWARD`` activations from the
    stage before, ``BACKWARD`` gradients from the stage after), each kind in microbatch order.

    The ranks of one stage that share collectives during a step (``sharing``: its x, y, z and context group,
    attention's ring spanning context; with a
    mixture of experts every rank of the stage, data's too: the experts' exchanges and counts) must take
    the kinds in one order, or their layers' collectives would pair different microbatches. So one of
    them, the leader (coordinate 0 of those axes), looks at what has arrived and broadcasts the kind it
    takes; the others then wait for their own message of that kind.

    What has arrived, on the leader: NCCL's receives can be polled; a gloo receive completes
    only inside ``wait``, so on gloo one watcher thread per kind waits on that kind's receives
    in order (``Work.wait`` releases the GIL) and notes each arrival."""

    def __init__(self, grid: Grid, rows: list[int], stream: StreamShape, kinds: tuple[int, ...], window: int,
                 sharing: tuple[str, ...] = ("x", "y", "z")):
        self.grid, self.rows, self.stream, self.window, self.sharing = grid, rows, stream, window, sharing
        self.shared = grid.size(*sharing) > 1
        self.leader = all(grid.coord(a) == 0 for a in sharing)
        self.watched = self.leader and grid.device.type == "cpu"
        self.posted: dict[int, dict[int, tuple[comm.Handle, torch.Tensor]]] = {k: {} for k in kinds}
        self.next = {k: 0 for k in kinds}             # the next microbatch to take, per kind
        self.arrived = {k: 0 for k in kinds}          # microbatches arrived (watched), per kind
        self.failed: BaseException | None = None
        self.changed = threading.Condition()
        self.queues: dict[int, list] = {k: [] for k in kinds}
        for kind in kinds:
            for micro in range(min(window, len(rows))):
                self._post(kind, micro)
        self.watchers = [threading.Thread(target=self._watch, args=(k,), daemon=True, name=f"par4d-inbox-{k}")
                         for k in kinds] if self.watched else []
        for watcher in self.watchers:
            watcher.start()

    def _post(self, kind: int, micro: int) -> None:
        shape, dtype = self.stream(self.rows[micro])
        buffer = torch.empty(shape, dtype=dtype, device=self.grid.device)
        handle = comm.recv(self.grid, buffer, "pipe", SOURCE[kind], kind)
        self.posted[kind][micro] = handle, buffer
        if self.watched:
            with self.changed:
                self.queues[kind].append(handle)
                self.changed.notify_all()

    def _watch(self, kind: int) -> None:
        """A watcher thread: wait on this kind's receives in order, note each arrival."""
        try:
            for _ in range(len(self.rows)):
                with self.changed:
                    while not self.queues[kind]:
                        self.changed.wait()
                    handle = self.queues[kind].pop(0)
                handle.block()
                with self.changed:
                    self.arrived[kind] += 1
                    self.changed.notify_all()
        except BaseException as error:   # a failed receive: the leader raises it
            with self.changed:
                self.failed = error
                self.changed.notify_all()

    def _ready(self, kind: int) -> bool:
        micro = self.next[kind]
        if micro >= len(self.rows):
            return False
        if self.watched:
            return self.arrived[kind] > micro
        return self.posted[kind][micro][0].done()

    def _choose(self, forward: bool) -> int:
        """The leader's pick: a backward that has arrived, else a forward (if ``forward``: the
        stage may start one), else the first to arrive."""
        kinds = sorted(self.next, reverse=True)       # BACKWARD before FORWARD
        pending = [k for k in kinds if self.next[k] < len(self.rows) and (forward or k != FORWARD)]
        if not pending:
            raise RuntimeError("pipeline: a stage waits for a message when none is due")
        if len(pending) == 1 and not self.watched:
            return pending[0]                         # only one can come: its wait blocks in take
        while True:
            with self.changed:
                if self.failed is not None:
                    raise self.failed
                for kind in pending:
                    if self._ready(kind):
                        return kind
                if self.watched:
                    self.changed.wait(WAIT_S)
                    continue
            time.sleep(POLL_S)

    def take(self, forward: bool = True) -> tuple[int, int, torch.Tensor]:
        """(kind, microbatch, tensor) of the next message (waits for it); a backward only,
        unless ``forward``."""
        kind = self._choose(forward) if self.leader else 0
        if self.shared:
            agreed = torch.tensor([kind], dtype=torch.int64, device=self.grid.device)
            comm.broadcast(self.grid, agreed, *self.sharing)
            kind = int(agreed[0])
        micro = self.next[kind]
        handle, buffer = self.posted[kind].pop(micro)
        handle.wait()
        self.next[kind] += 1
        if micro + self.window < len(self.rows):
            self._post(kind, micro + self.window)
        return kind, micro, buffer

    def close(self) -> None:
        for watcher in self.watchers:
            watcher.join()
