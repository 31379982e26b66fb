"""Gradient synchronization over the batch shards (data x z).

Each rank back-propagates the mean loss of its own samples. The z reduce-scatter
of Algorithm 1 already summed Ŵ's gradient over z; every other gradient is still
partial over the axes in its :class:`~par4d.layout.Placement`'s ``grad_sum``. This
module sums the rest (bucketed: one all-reduce per group of axes and bucket, overlapped
with backward when the overlap settings say so) and divides by the number of batch
shards G_data * G_z, so every gradient equals the single-device gradient of the mean
loss over the global batch. A weight tied across pipeline stages (``Placement.pipe_peer``: a
language model's embedding on the first stage, its head on the last) then gets the other
stage's gradient added, as autograd adds the two uses of one tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch._utils import _unflatten_dense_tensors

from par4d import comm
from par4d.grid import FOLDED, TENSOR_AXES, Grid
from par4d.layout import BATCH_AXES, Placement, placement_of
from par4d.overlap.policy import BUCKET_MB, Overlap
from par4d.parallel import state

if TYPE_CHECKING:
    from par4d.overlap.runtime import DeferredGrads

BUCKET_BYTES = int(BUCKET_MB * 2**20)
TIED_TAG = 4                 # point-to-point tag of tied weights' gradients (the pipeline's are 2 and 3)
FIRST_BUCKET_BYTES = 2**20   # DDP's first bucket: the last layers' gradients start their sum early


def _buckets(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``params`` of at most ``limit`` bytes (or one parameter); the first
    at most FIRST_BUCKET_BYTES, so communication starts early in backward (as DDP's does)."""
    buckets, current, size = [], [], 0
    for p in params:
        cap = min(limit, FIRST_BUCKET_BYTES) if not buckets else limit
        if current and size + p.numel() * p.element_size() > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    return buckets + ([current] if current else [])


def _order(key: tuple[tuple[str, ...], str | None]) -> tuple:
    """Groups in one order on every rank: by their axes, an expert's after the others'."""
    return key[0], key[1] or ""


def _within(placement: Placement, grid: Grid) -> str | None:
    """The folded axis a parameter is cut over (an expert's weights: "expert"), where it has ranks."""
    return next((a for a in FOLDED if a in placement.sharded and grid.size(a) > 1), None)


def _placement(name: str, param: torch.Tensor) -> Placement:
    placement = placement_of(param)
    if placement is None:
        raise ValueError(f"parameter {name!r} is not a par4d parameter (no placement); "
                         f"build the model from par4d.nn layers")
    return placement


class _Bucket:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.held: list[torch.Tensor] = []     # the parameters with a gradient this step, in bucket order
        self.handle: comm.Handle | None = None
        self.buffer: torch.Tensor | None = None  # where the gradients are summed, kept from step to step (as DDP's)
        self.layout: tuple | None = None       # the gradients' dtype, device, shapes and dtypes the pieces are cut for
        self.pieces: list[torch.Tensor] = []   # views of the buffer, one a gradient, shaped as it (the sync's own)
        self.span: torch.Tensor | None = None  # the part of the buffer the pieces cover
        self.own = 0                           # references to the buffer's storage: the sync's own (buffer, pieces)
        self.lends = False                     # the summed pieces become the gradients (same dtypes): no copy out
        self.index = {id(p): i for i, p in enumerate(params)}   # each parameter's piece, when cut for them all
        self.early = False                     # this step's gradients go into the buffer as they arrive (:meth:`take`)
        self.taken = 0                         # how many did

    def clear(self) -> None:
        self.ready.clear()
        self.flat, self.held, self.handle = None, [], None
        self.early, self.taken = False, 0

    def take(self, param: torch.Tensor) -> None:
        """``param``'s gradient, just accumulated, copied into its piece of the buffer while it is still in cache,
        and the gradient made a view of that piece (DDP's gradient_as_bucket_view): the copy autograd made is
        freed at once, for the rest of backward to reuse, and the buffer holds the bucket once its last gradient
        arrives (no pass over the bucket at its launch). Only where the pieces are cut for every parameter of the
        bucket, the sum keeps their dtype, and the buffer is the sync's own (decided at the bucket's first
        gradient of the step: called before the parameter is marked :attr:`ready`; last step's views dropped); a
        gradient that does not fit its piece is left for :meth:`flatten` (the bucket then sums in a new buffer: the
        views already made hold this one)."""
        if not self.ready:
            self.early = self.lends and len(self.pieces) == len(self.params) and _uses(self.buffer) == self.own
        if self.early:
            piece, grad = self.pieces[self.index[id(param)]], param.grad
            if grad.shape == piece.shape and grad.dtype == piece.dtype and grad.device == piece.device:
                piece.copy_(grad)
                param.grad = piece.detach()
                self.taken += 1

    def flatten(self, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``grads`` end to end in ``dtype``, in the bucket's buffer (through :attr:`pieces`, cut again only when
        the gradients' dtypes, device or shapes change). Kept, as DDP keeps its buckets: a buffer allocated every
        step (and the gradients it replaced, freed mid-step) went back to the system and came back as fresh pages,
        hundreds of page faults a step on a CPU (docs/benchmarks.md). Last step's gradients are views of it (see
        :meth:`take` and :meth:`GradientSync._launch`): where any is still held (a caller kept one, or the gradients
        were not zeroed), the buffer is theirs and this step sums in a new one, unless the gradients are those very
        views, accumulated in place (then they are in the buffer already)."""
        layout = (dtype, grads[0].device, [(g.shape, g.dtype) for g in grads])
        lent = self.buffer is not None and _uses(self.buffer) > self.own
        if lent and layout == self.layout and all(g.data_ptr() == p.data_ptr() for g, p in zip(grads, self.pieces)):
            return self.span
        if layout != self.layout or lent:
            if lent or self.layout is None or self.layout[:2] != layout[:2]:   # sized for every parameter
                self.buffer = grads[0].new_empty(sum(p.numel() for p in self.params), dtype=dtype)
            self.layout, self.span = layout, self.buffer[:sum(g.numel() for g in grads)]
            self.pieces = list(_unflatten_dense_tensors(self.span, grads))
            self.own = _uses(self.buffer)
            self.lends = all(g.dtype == dtype for g in grads)
        torch._foreach_copy_(self.pieces, grads)
        return self.span


def _uses(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``tensor``'s storage: torch has no public count (its CUDA graph
    trees read the same one)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _trained(modules: list[nn.Module]) -> list:
    """What a sync's buckets hold: every parameter of ``modules`` and whether it trains, and every module's
    children. A walk over a list kept from the build (``model.parameters()`` recurses through generators: 45 us a
    step for the demo's GPT, this 8; a list, not a generator: fewer frames): unfreezing a parameter, replacing or
    adding one, or replacing or adding a module in a module the model had, changes it."""
    return [(id(p), p.requires_grad) for module in modules for p in module._parameters.values() if p is not None] \
        + [id(child) for module in modules for child in module._modules.values()]


class GradientSync:
    """The data-parallel sync of one model: gradients summed over their partial axes in
    fixed buckets, then divided by G_data * G_z * G_context.

    Buckets are fixed when the sync is built: per group of partial axes, parameters in
    reverse registration order (roughly the order backward produces their gradients),
    cut at ``bucket_bytes`` (the first at 1 MB, as DDP's). The synchronous path and the overlapped one use the same
    buckets, so they add the same numbers in the same order (the same bits).

    Overlapped (``overlap=True``, inside :meth:`backward` around the step's last backward pass): a
    gradient hook marks each parameter ready as autograd accumulates its gradient (the earlier
    microbatches' included), and where z = 1 copies it into its bucket's buffer (:meth:`_Bucket.take`);
    a bucket whose parameters are all ready is all-reduced asynchronously while backward goes on.
    Buckets of one group are launched strictly in order (every rank of the group issues
    the same collectives in the same order). Gradients that arrive outside autograd's
    accumulation (ORS's deferred reduce-scatters) are picked up by :meth:`finish`.
    """

    def __init__(self, model: nn.Module, grid: Grid, bucket_bytes: int = BUCKET_BYTES, overlap: bool = False,
                 deferred: DeferredGrads | None = None):
        """``deferred``: the model's ORS runtime, whose gradients arrive after backward."""
        self.grid, self.bucket_bytes, self.overlap, self.deferred = grid, bucket_bytes, overlap, deferred
        grouped: dict[tuple[tuple[str, ...], str | None], list[torch.Tensor]] = defaultdict(list)
        for name, param in reversed(list(model.named_parameters())):
            placement = _placement(name, param)
            if param.requires_grad:
                # Axes of one rank add nothing: ("z", "data") at z=1 is the data group, so biases
                # share buckets (and all-reduces) with the weights there, as in DDP. An expert's
                # gradient is summed over the ranks that hold that expert only (within "expert").
                within = _within(placement, grid)
                axes = tuple(a for a in placement.grad_sum if grid.size(a, within=within) > 1)
                grouped[(axes, within if FOLDED.get(within) in axes else None)].append(param)
        self.scale = 1.0 / grid.size(*BATCH_AXES)      # each rank's loss a mean over as many tokens
        # Weights tied across pipeline stages: yielded last, once the other stage's gradient is added.
        self.tied = [p for p in model.parameters() if p.requires_grad and placement_of(p).pipe_peer]
        self.scaled_only = grouped.pop(((), None), [])
        self.groups = {key: [_Bucket(b) for b in _buckets(grouped[key], bucket_bytes)]
                       for key in sorted(grouped, key=_order)}
        self._armed = False                  # inside the step's last backward pass (:meth:`backward`)
        self.modules = list(model.modules())
        self.trained = _trained(self.modules)   # what the buckets hold
        self.reduce_dtype: torch.dtype | None = state(model).reduce_dtype
        self.early_launches = 0              # buckets launched from hooks, during backward
        self.peak_buffer_bytes = 0           # the most the buckets in flight held at once (in buffers kept)
        self._hooks: list = []
        self._where: dict[int, tuple[tuple[str, ...], int]] = {}
        for axes, buckets in self.groups.items():
            for index, bucket in enumerate(buckets):
                on_grad = self._on_grad(axes, bucket)
                for param in bucket.params:
                    self._where[id(param)] = (axes, index)
                    if overlap:
                        self._hooks.append(param.register_post_accumulate_grad_hook(on_grad))
        if overlap and deferred is not None:
            deferred.listeners.append(self._on_deferred)

    def close(self) -> None:
        """Remove the gradient hooks (a new sync replaces this one)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.deferred is not None and self._on_deferred in self.deferred.listeners:
            self.deferred.listeners.remove(self._on_deferred)

    @contextmanager
    def backward(self, last: bool = True) -> Iterator[None]:
        """Around one of the training step's backward passes: its reduce-scatters are deferred (ORS)
        and, if it is the ``last`` (or only) one of the step, buckets launch as they fill. Earlier ones
        (gradient accumulation over microbatches) only add to ``.grad``: the sum over data (and z) runs
        once, over the accumulated gradients. State a raised backward left behind is dropped first."""
        for buckets in self.groups.values():
            for bucket in buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
                bucket.clear()
        self._armed = self.overlap and last
        try:
            with self.deferred.collecting() if self.deferred is not None else nullcontext():
                yield
        finally:
            self._armed = False

    def _on_grad(self, key: tuple[tuple[str, ...], str | None], bucket: _Bucket) -> Callable[[torch.Tensor], None]:
        """The gradient hook of ``bucket``'s parameters (one closure a bucket: no lookups per gradient)."""
        ready, size = bucket.ready, len(bucket.params)
        owed = self.deferred.owed if self.deferred is not None else frozenset()
        # Into the buffer as they arrive, except where z > 1: there ORS writes weight gradients after backward, and
        # a bucket holding one would find its buffer lent to the views its hooks made (a new buffer every step).
        early = self.grid.size("z") == 1

        def on_grad(param: torch.Tensor) -> None:
            if not self._armed or id(param) in owed:
                return                       # not this step's, or its gradient is a deferred reduce-scatter
            ledger = self.grid.ledger
            if ledger.watched:               # buckets in flight: whether they completed (their time in flight)
                ledger.probe()
            if early:
                bucket.take(param)
            ready.add(id(param))
            if len(ready) == size:           # only a full bucket can start a launch (in order)
                self.early_launches += self._launch_ready(key)

        return on_grad

    def _on_deferred(self, params: list[torch.Tensor]) -> None:
        if self._armed:
            self._ready(params)

    def _ready(self, params: list[torch.Tensor]) -> None:
        touched = set()
        for param in params:
            if id(param) in self._where:
                axes, index = self._where[id(param)]
                self.groups[axes][index].ready.add(id(param))
                touched.add(axes)
        for key in sorted(touched, key=_order):
            self.early_launches += self._launch_ready(key)

    def _launch_ready(self, axes: tuple[tuple[str, ...], str | None]) -> int:
        launched = 0
        for bucket in self.groups[axes]:
            if bucket.handle is not None or bucket.flat is not None:
                continue
            if len(bucket.ready) < len(bucket.params):
                break                        # in order: a later bucket waits for this one
            self._launch(axes, bucket)
            launched += 1
        return launched

    def _launch(self, key: tuple[tuple[str, ...], str | None], bucket: _Bucket) -> None:
        bucket.held = [p for p in bucket.params if p.grad is not None]
        if not bucket.held:
            bucket.flat = torch.empty(0)     # nothing to sum (no gradients at all): done
            return
        if bucket.taken == len(bucket.params):
            bucket.flat = bucket.span        # every gradient in the buffer already, a view of it (_Bucket.take)
        else:
            grads = [p.grad for p in bucket.held]
            # Mixed precision may sum half gradients in fp32 (par4d.optim.precision): cast as they are laid out.
            bucket.flat = bucket.flatten(grads, self.reduce_dtype or grads[0].dtype)
            if bucket.lends:
                # The gradients become views of the sum (DDP's gradient_as_bucket_view): no pass copying it out
                # (1.2% of a comm-bound step on 4 CPU ranks, docs/benchmarks.md), and made so now, while the sum
                # is in flight: the copies they were are freed at once, and no Python is left after the wait.
                # New views, not the sync's own pieces: a caller who keeps one makes the next step sum in a new
                # buffer (:meth:`_Bucket.flatten`).
                for param, grad in zip(bucket.held, _unflatten_dense_tensors(bucket.span, bucket.pieces)):
                    param.grad = grad
        in_flight = sum(b.flat.nbytes for buckets in self.groups.values() for b in buckets if b.flat is not None)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, in_flight)
        axes, within = key
        bucket.handle = comm.all_reduce(self.grid, bucket.flat, *axes, async_op=True, within=within)

    @torch.no_grad()
    def finish(self) -> None:
        """Launch what is left (in order), wait for every bucket, write the mean gradients."""
        self._launch_rest()
        for buckets in self.groups.values():
            for bucket in buckets:
                self._written(bucket)
        if self.tied:
            self._add_across_stages()

    @torch.no_grad()
    def completed(self) -> Iterator[list[nn.Parameter]]:
        """:meth:`finish` a bucket at a time: launch what is left (in order), then yield each
        bucket's parameters (those with a gradient) once their mean gradients are written,
        first those with nothing to sum. Later buckets stay in flight while the caller works
        on a yielded one (the offloaded optimizer steps it: the async-pipeline paper's Section
        V-C). Every bucket is waited in the same order as in :meth:`finish`: the same bits."""
        self._launch_rest()
        tied = {id(p) for p in self.tied}
        done = [p for p in self.scaled_only if p.grad is not None and id(p) not in tied]
        if done:
            yield done
        for buckets in self.groups.values():
            for bucket in buckets:
                self._written(bucket)
                done = [p for p in bucket.params if p.grad is not None and id(p) not in tied]
                if done:
                    yield done
        if self.tied:
            yield self._add_across_stages()

    def _launch_rest(self) -> None:
        """Every bucket not launched yet, launched (in order); the gradients with nothing to sum, scaled."""
        self._armed = False
        for axes, buckets in self.groups.items():
            for bucket in buckets:
                if bucket.handle is None and bucket.flat is None:
                    self._launch(axes, bucket)
        if self.scale != 1.0:                # nothing to sum: no flatten and copy back, only the scale
            for param in self.scaled_only:
                if param.grad is not None:
                    param.grad.mul_(self.scale)

    def _written(self, bucket: _Bucket) -> None:
        """``bucket``'s sum waited for, scaled to the mean and written to its parameters' gradients."""
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.flat.mul_(self.scale)     # the gradients are views of it where it lends (:meth:`_launch`)
            if not bucket.lends:   # mixed precision's half gradients summed in fp32: copied (rounded) into their own
                torch._foreach_copy_([p.grad for p in bucket.held], bucket.pieces)
        bucket.clear()

    def _add_across_stages(self) -> list[nn.Parameter]:
        """Each weight tied across pipeline stages, its gradient plus the other stage's copy's: a + b on
        one stage, b + a on the other, the same bits (both copies then step alike)."""
        for param in self.tied:
            if param.grad is None:          # unused on this stage this step: its share is zero
                param.grad = torch.zeros_like(param)
        received = [torch.empty_like(p.grad) for p in self.tied]
        sends = [lambda p=p: comm.send(self.grid, p.grad, "pipe", placement_of(p).pipe_peer, TIED_TAG)
                 for p in self.tied]
        recvs = [lambda p=p, r=r: comm.recv(self.grid, r, "pipe", placement_of(p).pipe_peer, TIED_TAG)
                 for p, r in zip(self.tied, received)]
        # The earlier stage sends first, the later one receives first: NCCL runs one peer's sends and
        # receives in the order they are posted (and ignores tags), so both sides post them paired.
        earlier = placement_of(self.tied[0]).pipe_peer > 0
        handles = [post() for post in (sends + recvs if earlier else recvs + sends)]
        for handle in handles:
            handle.wait()
        for param, other in zip(self.tied, received):
            param.grad.add_(other)
        return self.tied


def gradient_sync(model: nn.Module, grid: Grid) -> GradientSync:
    """The model's :class:`GradientSync` (its :class:`~par4d.parallel.ParallelState`'s), built on first
    use with the model's overlap settings (``par4d.set_overlap``), or DDP's default for a model that
    has none (its buckets all-reduced during backward, ``Overlap()``)."""
    parallel = state(model)
    settings = parallel.overlap if parallel.overlap is not None else Overlap()
    deferred = parallel.runtime.deferred if parallel.runtime is not None else None
    wanted = (grid, settings.bucket_bytes, settings.data_parallel, deferred, parallel.reduce_dtype)
    sync = parallel.sync
    # Which parameters train is part of the buckets: unfreezing one, or replacing one, rebuilds them.
    if sync is None or (sync.grid, sync.bucket_bytes, sync.overlap, sync.deferred, sync.reduce_dtype) != wanted \
            or _trained(sync.modules) != sync.trained:
        if sync is not None:       # the settings changed (set_overlap): rebuild the buckets and hooks
            sync.close()
        sync = GradientSync(model, grid, settings.bucket_bytes, settings.data_parallel, deferred)
        parallel.sync = sync
    return sync


@torch.no_grad()
def sync_gradients(model: nn.Module, grid: Grid) -> None:
    """Sum every parameter's gradient over its partial axes; divide by G_data * G_z.

    Call after ``backward()`` and before the optimizer step, on every rank.
    """
    gradient_sync(model, grid).finish()


@torch.no_grad()
def global_mean(value: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Mean of a per-rank batch statistic over the batch's shards (data x z x context)."""
    out = value.detach().clone().reshape(1)
    comm.all_reduce(grid, out, *BATCH_AXES)
    return out[0] / grid.size(*BATCH_AXES)


@torch.no_grad()
def grad_norm(model: nn.Module, grid: Grid) -> torch.Tensor:
    """The global 2-norm of the model's gradients (float64, shape (1,)), each shard counted
    once: a gradient replicated over tensor axes (x, y, z) it is not sharded on is divided by
    that replication, the sum of squares all-reduced over (x, y, z), then over the pipeline's
    stages (a weight tied across stages counted on the earlier one); data replicas are identical, but
    an expert group's ranks hold different experts: theirs are summed over it first.
    Half gradients are summed in fp32 (no overflow)."""
    total = torch.zeros(1, dtype=torch.float64, device=grid.device)
    experts = torch.zeros(1, dtype=torch.float64, device=grid.device)
    for name, param in model.named_parameters():
        placement = _placement(name, param)
        if param.grad is None or placement.pipe_peer < 0:
            continue
        copies = grid.size(*[a for a in TENSOR_AXES if a not in placement.sharded])
        # The shard's norm without a float64 copy of the gradient, summed in float64.
        wide = torch.promote_types(param.grad.dtype, torch.float32)    # half in fp32; float64 kept
        square = torch.linalg.vector_norm(param.grad, dtype=wide).double().square() / copies
        (experts if _within(placement, grid) else total).add_(square)
    if grid.size("expert") > 1:
        total += comm.all_reduce(grid, experts, "expert")
    comm.all_reduce(grid, total, "x", "y", "z")
    comm.all_reduce(grid, total, "pipe")        # each stage holds its own layers
    return total.sqrt()


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to multiply every gradient by so the norm is at most ``max_norm`` (a tensor: no
    host sync to decide whether to clip)."""
    return (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, grid: Grid) -> torch.Tensor:
    """Scale all gradients so their global 2-norm (:func:`grad_norm`) is at most ``max_norm``;
    returns the norm before clipping (as ``torch.nn.utils.clip_grad_norm_`` on the
    single-device model). Call after :func:`sync_gradients`."""
    norm = grad_norm(model, grid)
    clip = clip_factor(norm, max_norm)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(clip)
    return norm.float()[0]
