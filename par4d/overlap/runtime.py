"""The per-model runtime of the 4D paper's overlaps of Algorithm 1's z collectives
(Section IV; docs/architecture.md, "Overlap"): OAG with the cache, and ORS.

It serves any layer that runs :class:`par4d.nn.algorithm1.Algorithm1` (an
:class:`~par4d.nn.algorithm1.Algorithm1Layer`: par4d's Linear and Conv2d, and so every layer of
par4d's GPT and U-Net and every one ``par4d.parallelize`` makes), keyed by the layer, never by a
tensor (a weight stored (in, out) is gathered through a fresh transposed view each time).

:class:`WeightGathers` serves every z all-gather of a weight shard Ŵ:

* **OAG**: the first iteration records the order in which the layers gather (their
  real execution order, recomputation included, not registration order). Later
  iterations issue the next ``prefetch`` gathers of that order asynchronously while
  the current layer computes. A layer that asks out of order (a model that skips or
  repeats a layer) ends prefetching for the rest of that iteration: what was
  prefetched is waited for and dropped, every later gather is synchronous, and the
  new order is recorded for the next iteration (``order_changes`` counts this).
  A prefetched weight is only ever used by the layer it was gathered for, within the
  iteration it was gathered in (weights change only between iterations), so a
  change of order costs time, never correctness. Orders are kept per grad mode, so
  an evaluation pass does not disturb the training order. An iteration is one forward
  of the model and its backward: with gradient accumulation, one microbatch (each
  gathers in the same order, so every microbatch after the first prefetches).
* **Cache**: inside a recomputed segment's first forward, the gathered weights of up
  to ``cache_layers`` layers (the last ones: backward recomputes them first) are kept
  and the recomputed forward reuses them instead of gathering again.

:class:`DeferredGrads` is **ORS**: a weight-gradient reduce-scatter is issued
asynchronously and waited for in a callback that autograd runs when the whole
backward pass is done, which then accumulates the gradient into ``param.grad``
exactly as autograd would have (in the same order, so the same bits), adding to what
earlier backward passes of the step left there (gradient accumulation over microbatches).

Every rank must run the same layers in the same order (as the synchronous path
requires too): collectives over a group must be issued in the same order on all
its ranks.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.autograd import Variable

from par4d import comm
from par4d.eager import eager
from par4d.grid import Grid
from par4d.overlap.policy import Overlap

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from par4d.comm import Handle
    from par4d.nn.algorithm1 import Algorithm1Layer


class WeightGathers:
    """All-gathers over z of weight shards, prefetched in recorded order (OAG) and cached
    across recomputation; see the module docstring."""

    def __init__(self, grid: Grid, prefetch: int, cache_layers: int | None):
        """``prefetch``: how many gathers to keep in flight ahead (0: OAG off).
        ``cache_layers``: weights kept for recomputation (None: all, 0: none)."""
        self.grid, self.prefetch, self.cache_layers = grid, prefetch, cache_layers
        self.order_changes = 0
        self.prefetched = 0           # gathers served by a prefetch (counts for tests and reports)
        self.cache_hits = 0
        self.checkpointing = False    # inside a recomputed segment's first forward
        self.recomputing = False      # inside its recomputation (in backward)
        self._orders: dict[bool, list[Algorithm1Layer]] = {}   # grad mode -> layers in gather order
        self._mode: bool | None = None                       # this iteration's grad mode; None: no iteration
        self._seen: list[Algorithm1Layer] = []
        self._ahead: dict[int, Handle] = {}                  # position in the order -> prefetched gather
        self._diverged = False
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.peak_cache_bytes = 0      # the most the cache's gathered weights held at once

    def begin(self) -> None:
        """A new iteration (the model's forward starts): settle the last one's order."""
        self._drain()
        self._cache.clear()
        if self._mode is not None:
            recorded = self._orders.get(self._mode)
            changed = recorded is not None and (self._diverged or len(self._seen) != len(recorded))
            if recorded is None or changed:
                self._orders[self._mode] = self._seen
            if changed:
                self.order_changes += 1
                if self.order_changes == 1:
                    warnings.warn("par4d: the layers gathered their weights in a different order than on the "
                                  "recorded iteration; OAG prefetching was stopped for that iteration and the "
                                  "new order recorded (results are unaffected; a model whose order changes "
                                  "often gains less from OAG)", stacklevel=2)
        self._mode, self._seen, self._diverged = torch.is_grad_enabled(), [], False

    @eager      # bookkeeping around collectives: eager in a compiled block (par4d.compiled)
    def gather(self, layer: Algorithm1Layer) -> torch.Tensor:
        """The full W of ``layer``'s shard Ŵ (all-gathered over z), as rows (``weight_rows``)."""
        if self.grid.size("z") == 1:
            return layer.weight_rows()
        if self.recomputing:
            cached = self._cache.pop(id(layer), None)
            if cached is not None:
                self.cache_hits += 1
                return cached
        full = self._gather(layer)
        if self.checkpointing and not self.recomputing and self.cache_layers != 0:
            self._cache[id(layer)] = full
            while self.cache_layers is not None and len(self._cache) > self.cache_layers:
                self._cache.popitem(last=False)    # keep the last ones: backward recomputes them first
            self.peak_cache_bytes = max(self.peak_cache_bytes, sum(t.nbytes for t in self._cache.values()))
        return full

    def _gather(self, layer: Algorithm1Layer) -> torch.Tensor:
        if self._mode is None or not self.prefetch:   # no iteration begun, or OAG off: nothing to record
            return comm.all_gather(self.grid, layer.weight_rows(), "z")
        position = len(self._seen)
        self._seen.append(layer)
        order = self._orders.get(self._mode)
        if order is None or self._diverged:
            return comm.all_gather(self.grid, layer.weight_rows(), "z")
        if position >= len(order) or order[position] is not layer:
            self._diverged = True     # every rank diverges here alike: the prefetched gathers all complete
            self._drain()
            return comm.all_gather(self.grid, layer.weight_rows(), "z")
        handle = self._ahead.pop(position, None)
        if handle is None:
            handle = self._issue(layer)
        else:
            self.prefetched += 1
        for ahead in range(position + 1, min(position + 1 + self.prefetch, len(order))):
            if ahead not in self._ahead:
                self._ahead[ahead] = self._issue(order[ahead])
        return handle.wait()

    def _issue(self, layer: Algorithm1Layer) -> Handle:
        return comm.all_gather(self.grid, layer.weight_rows(), "z", async_op=True)

    def _drain(self) -> None:
        for handle in self._ahead.values():
            handle.wait()
        self._ahead.clear()

    @contextmanager
    def _flag(self, name: str) -> Iterator[None]:
        previous = getattr(self, name)
        setattr(self, name, True)
        try:
            yield
        finally:
            setattr(self, name, previous)

    def checkpoint_contexts(self):
        """``context_fn`` for ``torch.utils.checkpoint``: flags the first forward and the
        recomputation of a segment, so the cache knows which is which."""
        return self._flag("checkpointing"), self._flag("recomputing")


class DeferredGrads:
    """ORS: weight-gradient reduce-scatters waited for when the backward pass is done.

    Only inside the training step's backward passes (:meth:`collecting`, entered by the
    data-parallel sync around each, one per microbatch), so ``torch.autograd.grad``,
    ``backward(inputs=...)`` and other backward passes keep autograd's meaning. Autograd still runs the parameter's
    accumulation (with no gradient), so gradient hooks fire before the gradient exists:
    :meth:`owes` tells such a hook to wait, and ``listeners`` hear of the parameters once
    :meth:`finish` has written them. A backward that raised leaves handles behind: the next
    :meth:`collecting` waits for and drops them.
    """

    def __init__(self) -> None:
        self._collecting = False
        self._pending: list[tuple[torch.Tensor, Handle, bool]] = []
        # Whose gradient of this backward is still to come, by id: cleared, never replaced (the data-parallel
        # sync's hooks hold it).
        self.owed: set[int] = set()
        self._task: int | None = None     # the autograd graph task whose end runs finish()
        self.listeners: list[Callable[[list[torch.Tensor]], None]] = []
        self.deferred = 0                 # reduce-scatters deferred so far

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Around one of the training step's backward passes: its reduce-scatters are deferred."""
        for _, handle, _ in self._pending:    # left by a backward that raised
            handle.wait()
        self._pending, self._task = [], None
        self.owed.clear()
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    @eager      # (as gather)
    def reduce_scatter(self, grid: Grid, layer: Algorithm1Layer, grad_w: torch.Tensor,
                       transposed: bool) -> torch.Tensor | None:
        """The weight gradient's reduce-scatter over z for ``layer``'s backward: deferred (ORS,
        None returned: autograd gets no gradient, :meth:`finish` writes it) inside a step's
        backward on a grid with z > 1, else done now and returned (transposed back if stored (in, out))."""
        if self._collecting and grid.size("z") > 1:
            self._defer(layer.weight, comm.reduce_scatter(grid, grad_w, "z", async_op=True), transposed)
            return None
        shard = comm.reduce_scatter(grid, grad_w, "z")
        return shard.t() if transposed else shard

    def _defer(self, param: torch.Tensor, handle: Handle, transposed: bool = False) -> None:
        """``handle``'s result is ``param``'s gradient (its transpose if ``transposed``: a weight
        stored (in, out))."""
        task = torch._C._current_graph_task_id()
        if task != self._task:            # once per backward pass, at its end
            Variable._execution_engine.queue_callback(self.finish)
            self._task = task
        self._pending.append((param, handle, transposed))
        self.owed.add(id(param))
        self.deferred += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every deferred reduce-scatter and accumulate as autograd would: the
        contributions to one parameter summed in arrival order, then added to ``.grad``."""
        pending, self._pending, self._task = self._pending, [], None
        sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for param, handle, transposed in pending:
            grad = handle.wait()
            if transposed:
                grad = grad.t().contiguous()
            previous = sums.get(id(param))
            sums[id(param)] = (param, grad if previous is None else previous[1] + grad)
        for param, grad in sums.values():
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad
        self.owed.clear()
        for listener in self.listeners:
            listener([param for param, _ in sums.values()])


class LayerRuntime:
    """What one model's Algorithm 1 layers share: its overlap settings, gathers, deferred grads
    (:func:`par4d.overlap.apply.set_overlap` makes it and hands it to every layer)."""

    def __init__(self, grid: Grid, overlap: Overlap):
        self.overlap = overlap
        self.gathers = WeightGathers(grid, overlap.prefetch if overlap.all_gather else 0, overlap.cache_layers)
        self.deferred = DeferredGrads()
        self.hook: RemovableHandle | None = None   # the model's forward pre-hook that begins an iteration
