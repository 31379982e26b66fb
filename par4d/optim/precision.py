"""Precision policies: what a training step does once backward is done. Finishing the
data-parallel sync, clipping, stepping (offloaded or not), zeroing the gradients and the loss
scale are one method, :meth:`Precision.step`, of the run's policy; fp32 is a policy like the others.

:class:`FullPrecision` (fp32): the model's own parameters are stepped by the user's optimizer.

:class:`MixedPrecision` (the async-pipeline paper's Section V-B): the model's parameters and
gradients in a compute dtype (bf16 or fp16), fp32 master weights and their optimizer state
beside them, and for fp16 a dynamic loss scale.

A step: the loss is multiplied by the scale before backward, so small fp16 gradients do
not flush to zero; the gradients are summed over data x z (in fp32 or in the compute
dtype: ``reduce_dtype``); then :meth:`MixedPrecision.step` unscales them into the fp32
masters, and, if any is inf or NaN on any rank, skips the step and halves the scale
(fp16); else it clips and steps the masters and writes them back, rounded, into the
model. After ``growth_interval`` good steps in a row the scale doubles. bf16 has fp32's
range: its scale stays 1 and a non-finite gradient is an error, as in fp32.

Checkpoints hold a policy's ``masters`` (the model itself in fp32; mixed precision's fp32 copy,
which looks like a model to :mod:`par4d.checkpoint`: the same names and placements), so a
run saved in one precision resumes in any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from par4d.grid import Grid
from par4d.layout import place, placement_of
from par4d.optim.data_parallel import GradientSync, clip_factor, clip_grad_norm_, grad_norm
from par4d.optim.offload import OffloadedAdamW
from par4d.parallel import state

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INITIAL_SCALE = 2.0 ** 16     # fp16's scale at the start (halved on every overflow)
GROWTH_INTERVAL = 2000        # good steps in a row before the scale doubles


def fused_adamw(device: torch.device, offloaded: bool = False) -> bool | None:
    """``fused=`` for torch's AdamW over parameters on ``device``: on a GPU its fused kernel, one pass over
    the states instead of foreach's several (the same update, in another rounding); None (torch's choice)
    elsewhere, and for the offloaded optimizer, which steps its own buckets."""
    return True if device.type == "cuda" and not offloaded else None


def parse_precision(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--precision {name!r}: give one of {', '.join(DTYPES)}")
    return DTYPES[name]


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (other values skipped), each storage counted once."""
    seen, total = set(), 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class Masters:
    """The fp32 master copy of a model's parameters, named and placed as the model's
    (``named_parameters`` is all that checkpoints and clipping ask of a model)."""

    def __init__(self, model: nn.Module, device: torch.device | None = None):
        self._named: list[tuple[str, nn.Parameter]] = []
        for name, param in model.named_parameters():
            master = nn.Parameter(param.detach().to(device or param.device, torch.float32, copy=True),
                                  requires_grad=param.requires_grad)
            self._named.append((name, place(master, placement_of(param))))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self._named)


class Precision:
    """What every policy gives the step and the run: ``dtype`` (the model computes in it), ``scale``
    (the loss is multiplied by it before backward), ``masters`` (what checkpoints save and load),
    ``optimizer`` (what steps them), ``grad_norm`` (the last step's global norm, where clipping
    computed it), and :meth:`step`."""

    dtype: torch.dtype
    scale: float
    masters: nn.Module | Masters
    optimizer: torch.optim.Optimizer
    grad_norm: torch.Tensor | None

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's groups (the run sets each step's learning rate there)."""
        return self.optimizer.param_groups

    def step(self, sync: GradientSync, grad_clip: float = 0.0) -> bool:
        """Finish the gradient ``sync``, clip to ``grad_clip`` (0: no clipping), step, zero the
        gradients; False for a step skipped (fp16 overflow)."""
        raise NotImplementedError

    def describe(self, grad_clip: float, overlap: bool = True) -> str:
        """The optimizer in a line, for the run's summary (``overlap``: the sync's ``dp`` switch)."""
        raise NotImplementedError

    def metrics(self) -> dict:
        """What a run records of the policy per step."""
        return {}

    def optimizer_device_bytes(self) -> int:
        """Bytes the optimizer side holds on the device."""
        raise NotImplementedError

    def load_masters(self) -> None:
        """The model's parameters from the masters (after a checkpoint filled them)."""


class FullPrecision(Precision):
    """fp32: ``optimizer`` steps ``model``'s own parameters, which are also what checkpoints save."""

    def __init__(self, model: nn.Module, grid: Grid, optimizer: torch.optim.Optimizer):
        self.model, self.grid, self.optimizer = model, grid, optimizer
        self.dtype, self.scale, self.masters, self.grad_norm = torch.float32, 1.0, model, None

    @torch.no_grad()
    def step(self, sync: GradientSync, grad_clip: float = 0.0) -> bool:
        sync.finish()                       # after backward: sums what is still partial over data (and z)
        self.grad_norm = None
        if grad_clip > 0:                   # after the sync: the norm is that of the global batch's gradient
            self.grad_norm = clip_grad_norm_(self.model, grad_clip, self.grid)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def describe(self, grad_clip: float, overlap: bool = True) -> str:
        return f"{type(self.optimizer).__name__} (fp32)"

    def optimizer_device_bytes(self) -> int:
        return storage_bytes(t for s in self.optimizer.state.values() for t in s.values())


class MixedPrecision(Precision):
    """Master weights, optimizer and loss scale of ``model``: the masters are copied from it as
    it is (fp32), then the model is cast to the compute ``dtype`` in place.

    ``make_optimizer(params)`` builds the optimizer over the fp32 masters (AdamW here)."""

    def __init__(self, model: nn.Module, grid: Grid, dtype: torch.dtype,
                 make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
                 reduce_in_fp32: bool = True, offload_bsize: int | None = None):
        """``reduce_in_fp32``: sum gradients over data x z in fp32 (else in the compute dtype:
        half the bytes, and fp16's sum may overflow: the loss scale then drops).
        ``offload_bsize``: keep the masters and the optimizer's state in CPU memory and step
        them through the device that many elements at a time (:mod:`par4d.optim.offload`)."""
        if dtype not in DTYPES.values():
            raise ValueError(f"mixed precision computes in {', '.join(DTYPES)}, not {dtype}")
        self.model, self.grid, self.dtype = model, grid, dtype
        state(model).reduce_dtype = torch.float32 if reduce_in_fp32 and dtype != torch.float32 else None
        self.masters = Masters(model, torch.device("cpu") if offload_bsize else None)
        model.to(dtype)               # in place: the same parameter objects
        self._master_of = {id(p): m for p, m in zip(model.parameters(), self.masters.parameters())}
        self.optimizer = make_optimizer(self.masters.parameters())
        self.offloaded = offload_bsize is not None
        if self.offloaded:   # the same hyper-parameters, stepped in buckets from CPU memory
            group = self.optimizer.param_groups[0]
            self.optimizer = OffloadedAdamW(self.masters.parameters(), grid.device, offload_bsize,
                                            **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
        self.scale = INITIAL_SCALE if dtype == torch.float16 else 1.0
        self.good_steps = 0
        self.skipped = 0              # steps skipped for an inf or NaN gradient (fp16)
        self.grad_norm: torch.Tensor | None = None   # the last step's global gradient norm, where clipping computed it

    def overlaps_all_reduce(self, grad_clip: float, overlap: bool = True) -> bool:
        """Whether :meth:`step` steps each all-reduce bucket while later ones are in flight
        (Section V-C): offloaded, the data-parallel overlap on (``overlap``: the sync's ``dp``
        switch), and no quantity of the whole gradient to wait for first. The clipping norm
        (``grad_clip > 0``) and fp16's decision to skip a step (any inf or NaN, on any rank)
        need every bucket before the first is stepped."""
        return self.offloaded and overlap and grad_clip == 0 and self.dtype != torch.float16

    def describe(self, grad_clip: float, overlap: bool = True) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if not self.offloaded:
            return f"AdamW on fp32 masters beside the {name} model"
        why = ("gradient clipping needs the global norm" if grad_clip > 0 else
               "fp16 skips a step on any inf/NaN" if self.dtype == torch.float16 else
               "the data-parallel overlap is off")
        when = ("each all-reduce bucket as it returns, the rest in flight (Section V-C)"
                if self.overlaps_all_reduce(grad_clip, overlap) else f"after the whole all-reduce ({why})")
        return f"AdamW offloaded to CPU memory in buckets of {self.optimizer.bsize:,} elements, stepping {when}"

    @torch.no_grad()
    def step(self, sync: GradientSync, grad_clip: float = 0.0) -> bool:
        """Finish the gradient ``sync``, unscale into the masters, step them, write them back
        rounded into the model; returns False for a step skipped (fp16 overflow).

        Where :meth:`overlaps_all_reduce`, each bucket is stepped as its all-reduce returns
        (elementwise AdamW: the same bits as after the whole sync); a bf16 inf/NaN is then
        found after the step, and raises as before (nothing is saved after an error)."""
        self.grad_norm = None
        if self.overlaps_all_reduce(grad_clip, sync.overlap):
            found = torch.zeros(1, device=self.grid.device)
            for params in sync.completed():
                pairs = self._pairs(params)
                for param, _ in pairs:
                    found += (~torch.isfinite(param.grad)).any()
                self.optimizer.step_from(pairs, self.scale)
            self._check(found)
            self._good_step()
            self._clear(self._pairs(self.model.parameters()))
            return True
        sync.finish()
        pairs = self._pairs(self.model.parameters())
        found = torch.zeros(1, device=self.grid.device)
        for param, master in pairs:
            if not self.offloaded:          # offloaded, the fp32 gradient exists a bucket at a time
                master.grad = param.grad.float().div_(self.scale)
            found += (~torch.isfinite(param.grad)).any()
        if self._check(found):
            self.skipped += 1
            self.scale /= 2
            self.good_steps = 0
        elif self.offloaded:
            clip = None
            if grad_clip > 0:
                norm = grad_norm(self.model, self.grid) / self.scale
                self.grad_norm, clip = norm, clip_factor(norm, grad_clip)
            self.optimizer.step_from(pairs, self.scale, clip)
            self._good_step()
        else:
            if grad_clip > 0:
                self.grad_norm = clip_grad_norm_(self.masters, grad_clip, self.grid)
            self.optimizer.step()
            for param, master in pairs:
                param.copy_(master)
            self._good_step()
        self._clear(pairs)
        return not found.item()

    def metrics(self) -> dict:
        """fp16's loss scale, and the steps it skipped for inf/NaN gradients."""
        return {"loss_scale": self.scale, "skipped_steps": self.skipped}

    def _pairs(self, params) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(parameter, its master) for each of ``params`` with a gradient."""
        return [(p, self._master_of[id(p)]) for p in params if p.grad is not None]

    def _check(self, found: torch.Tensor) -> bool:
        """Whether any rank found an inf or NaN gradient (fp16: skip the step; else an error)."""
        dist.all_reduce(found, op=dist.ReduceOp.MAX)      # every rank skips alike
        if found.item() and self.dtype != torch.float16:
            raise FloatingPointError("a gradient is inf or NaN (no loss scale to lower in "
                                     f"{str(self.dtype).removeprefix('torch.')})")
        return bool(found.item())

    def _clear(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for param, _ in pairs:
            param.grad = None

    def _good_step(self) -> None:
        self.good_steps += 1
        if self.dtype == torch.float16 and self.good_steps % GROWTH_INTERVAL == 0:
            self.scale *= 2

    def device_bytes(self) -> int:
        """Bytes the parameters and optimizer hold on the device: the model's parameters and
        gradients, and :meth:`optimizer_device_bytes`."""
        held = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        return sum(t.numel() * t.element_size() for t in held) + self.optimizer_device_bytes()

    def optimizer_device_bytes(self) -> int:
        """Bytes the optimizer side holds on the device: offloaded, the streaming buffers (the async-pipeline
        paper's ``16 bsize``); else the fp32 masters, their gradients and their state."""
        if self.offloaded:
            return self.optimizer.buffer_bytes()
        state = [t for s in self.optimizer.state.values() for t in s.values() if t.dim()]
        masters = list(self.masters.parameters()) + [m.grad for m in self.masters.parameters() if m.grad is not None]
        return sum(t.numel() * t.element_size() for t in masters + state)

    @torch.no_grad()
    def load_masters(self) -> None:
        for param, master in zip(self.model.parameters(), self.masters.parameters()):
            param.copy_(master)
