"""The CPU-offloaded optimizer (the async-pipeline paper's Section V-B).

With mixed precision a rank holding ``phi`` parameters needs ``20 phi`` bytes for them on
the device: fp32 weights and gradients (8), half weights and gradients (4), Adam's two
moments (8). Offloaded, only the half weights and gradients stay there (``4 phi``); the
fp32 master weights and the moments live in CPU memory (pinned where CUDA exists), and
the step streams them through the device ``bsize`` elements at a time, through four
device buffers reused for every bucket (master, gradient, two moments: ``16 bsize``
bytes). The fp32 gradient is never whole: each bucket's half gradient is upcast and
unscaled into the gradient buffer.

The arithmetic is torch's own AdamW (its functional form, on each bucket): elementwise,
so a bucketed step gives the same bits as one over the whole tensor (tested).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.adamw import adamw


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters kept in CPU memory, stepped bucket by bucket on ``device``.

    It is a ``torch.optim.AdamW`` (same hyper-parameters and ``state`` layout, so
    checkpoints hold it as any AdamW), whose :meth:`step_from` takes the gradients from the
    half-precision parameters instead of ``.grad``."""

    def __init__(self, masters, device: torch.device, bsize: int, *, lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if bsize < 1:
            raise ValueError(f"offload bucket size must be >= 1 element, got {bsize}")
        masters = list(masters)
        pin = device.type == "cuda"
        for master in masters:
            if master.device.type != "cpu":
                raise ValueError("offloaded masters live in CPU memory")
            if pin:
                master.data = master.data.pin_memory()
        super().__init__(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.device, self.bsize = device, bsize
        self.buffers = [torch.empty(bsize, dtype=torch.float32, device=device) for _ in range(4)]

    def buffer_bytes(self) -> int:
        """Device bytes of the streaming buffers: ``16 bsize``."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def _state(self, master: torch.Tensor) -> dict:
        state = self.state[master]
        if not state:
            pin = self.device.type == "cuda"
            zeros = (lambda: torch.zeros_like(master).pin_memory()) if pin else (lambda: torch.zeros_like(master))
            state.update(step=torch.tensor(0.0), exp_avg=zeros(), exp_avg_sq=zeros())
        return state

    @torch.no_grad()
    def step_from(self, pairs: list[tuple[nn.Parameter, torch.Tensor]], scale: float = 1.0,
                  clip: torch.Tensor | None = None) -> None:
        """One AdamW step of every (half parameter, master) pair whose parameter has a
        gradient: ``grad / scale`` (times ``clip``, a clipping factor), bucket by bucket; the
        stepped masters are written back, rounded, into the half parameters."""
        weight, grad, exp_avg, exp_avg_sq = self.buffers
        group = self.param_groups[0]
        for param, master in pairs:
            state = self._state(master)
            flat_param, flat_grad = param.view(-1), param.grad.view(-1)
            flat_master, flat_m, flat_v = master.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
            for start in range(0, flat_master.numel(), self.bsize):
                end = min(start + self.bsize, flat_master.numel())
                n = end - start
                w, g, m, v = weight[:n], grad[:n], exp_avg[:n], exp_avg_sq[:n]
                w.copy_(flat_master[start:end], non_blocking=True)
                m.copy_(flat_m[start:end], non_blocking=True)
                v.copy_(flat_v[start:end], non_blocking=True)
                g.copy_(flat_grad[start:end]).div_(scale)          # upcast and unscale this bucket only
                if clip is not None:
                    g.mul_(clip)
                step = state["step"].clone()                        # every bucket takes the same step
                adamw([w], [g], [m], [v], [], [step], foreach=False, amsgrad=False, beta1=group["betas"][0],
                      beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
                      eps=group["eps"], maximize=False)
                flat_master[start:end].copy_(w)
                flat_m[start:end].copy_(m)
                flat_v[start:end].copy_(v)
                flat_param[start:end].copy_(w)                      # rounded to the compute dtype
            state["step"] += 1
