"""What a training step holds in memory on this rank, measured by what it is, not by the allocator: the
parameters, their gradients (one per trained parameter) and the optimizer's state (the tensors themselves), the
activations autograd saves for backward (every saved tensor's storage while it is alive, parameters aside, each
storage once; Algorithm 1's gathered weights are among them; a recomputed segment's too, par4d's GPT's), the
data-parallel sync's buckets in flight, and the gathered weights the overlap's cache keeps for recomputation.
The same on CPU and GPU, and independent of allocator caching and fragmentation (a GPU's own peak,
``torch.cuda.max_memory_allocated``, is reported beside it where there is one).

The planner's memory model (par4d/plan/workload.py) predicts these terms; ``plan validate`` sets one beside the
other for every grid it measures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from par4d.optim.precision import Precision, storage_bytes
from par4d.parallel import state


@dataclass(frozen=True)
class Footprint:
    """Bytes on this rank."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int        # the peak of what autograd kept for backward at once
    buffers: int            # the peak of the data-parallel buckets in flight
    cached: int = 0         # the peak of the gathered weights the overlap's cache kept for recomputation
    device_peak: int | None = None   # torch.cuda.max_memory_allocated over the step, where there is a GPU

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state, with the activations' and buckets' peaks (as if at once)."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers + self.cached

    def row(self) -> dict:
        return {**asdict(self), "total": self.total}


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedTensors:
    """A context in which every tensor autograd saves for backward is counted while it is alive: ``live`` bytes
    now and their ``peak``. A storage saved twice counts once; storages in ``exclude`` (the parameters) not at
    all. A saved tensor stops counting when autograd drops it (after its backward, or with its graph)."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.live = self.peak = 0
        self._held: dict[int, list[int]] = {}           # storage pointer -> [saved tensors alive, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor, packed: object | None = None) -> object:
        pointer, nbytes = _storage(tensor)
        if pointer in self.exclude or nbytes == 0:
            return tensor if packed is None else packed
        held = self._held.setdefault(pointer, [0, nbytes])
        held[0] += 1
        if held[0] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return _Saved(tensor if packed is None else packed, pointer, self)

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    @contextlib.contextmanager
    def recomputing(self):
        """Inside a recomputation (``torch.utils.checkpoint``'s hooks on top, which hide what it keeps from
        these): count each tensor it keeps, then hand it to torch's hooks. What a segment's recomputation
        keeps is held until backward has used it; counted here until its forward ends, the working set at its
        largest."""
        # torch has no public way to read the hooks in force; its own checkpoint reads them the same way.
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def counted(tensor: torch.Tensor) -> object:
            return self._pack(tensor, pack(tensor))

        def handed(saved: object) -> torch.Tensor:
            return unpack(saved.tensor if isinstance(saved, _Saved) else saved)

        with torch.autograd.graph.saved_tensors_hooks(counted, handed):
            yield

    def _release(self, pointer: int) -> None:
        held = self._held[pointer]
        held[0] -= 1
        if held[0] == 0:
            self.live -= held[1]
            del self._held[pointer]


class _Saved:
    """One saved tensor; it stops counting when autograd lets go of it."""

    __slots__ = ("tensor", "pointer", "owner")

    def __init__(self, tensor: torch.Tensor, pointer: int, owner: SavedTensors):
        self.tensor, self.pointer, self.owner = tensor, pointer, owner

    def __del__(self) -> None:
        if hasattr(self, "owner"):      # (a compiled block's tracing makes some without calling __init__)
            self.owner._release(self.pointer)


def measure_footprint(model: nn.Module, precision: Precision, step: Callable[[], object]) -> Footprint:
    """Run ``step()`` (one training step of ``model``) once and return what it held on this rank: the states
    after it, the peaks during it. The optimizer's part is what ``precision`` holds on the device (fp32: the
    optimizer's state; mixed: the fp32 masters and their state, or offloaded, its buffers)."""
    params = [p for p in model.parameters()]
    exclude = {_storage(p)[0] for p in params}
    cuda = any(p.is_cuda for p in params)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    parallel = state(model)
    if parallel.sync is not None:
        parallel.sync.peak_buffer_bytes = 0
    runtime = parallel.runtime
    if runtime is not None:
        runtime.gathers.peak_cache_bytes = 0
    with SavedTensors(exclude) as saved:
        parallel.observe_recompute = saved.recomputing     # par4d's GPT: its recomputed segments too
        try:
            step()
        finally:
            parallel.observe_recompute = None
    sync = parallel.sync                                    # built by the first step where there was none
    # A step ends with its gradients dropped (set to None): while it runs each trained parameter has one.
    return Footprint(parameters=storage_bytes(params), gradients=storage_bytes(p for p in params if p.requires_grad),
                     optimizer=precision.optimizer_device_bytes(), activations=saved.peak,
                     buffers=sync.peak_buffer_bytes if sync is not None else 0,
                     cached=runtime.gathers.peak_cache_bytes if runtime is not None else 0,
                     device_peak=torch.cuda.max_memory_allocated() if cuda else None)
