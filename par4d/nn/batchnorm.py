"""Batch norm over samples that are split over the grid axes z and data.

Each rank holds whole channels (dim 1) of its own samples (``layout.shard_batch``), so
statistics of one rank's samples are not the batch's. Forward all-reduces, per channel,
every rank's ``[count, mean, M2]`` (M2 = sum of squared deviations from its own mean),
each rank writing its own slot of a zeroed buffer (adding zeros is exact, so this is an
all-gather in one collective over both axes), and merges them exactly (Chan et al.'s
parallel variance, as :mod:`par4d.nn.norm`), which stays accurate when a channel's mean is
large, unlike ``E[x^2] - E[x]^2``. Backward all-reduces ``[sum g, sum g x̂]`` per channel
(g = dL/dy). The result, the running statistics included, is ``torch.nn.BatchNorm2d``'s on
the whole batch; the weight and bias stay whole (their gradients summed over z and data by
``sync_gradients``, as every replicated parameter's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d import comm
from par4d.grid import Grid
from par4d.layout import BATCH_AXES, Placement, place

WHOLE = Placement((), grad_sum=BATCH_AXES)   # par4d.adopt's REPLICATED (not imported: auto imports par4d.nn)


def _channel_view(stat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``x`` (N, C, ...)."""
    return stat.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    """Statistics all-reduced over z and data in forward, their gradients' sums in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor: float, eps: float, grid: Grid, name: str):
        dims = [0, *range(2, x.dim())]
        xf = x.to(torch.promote_types(x.dtype, torch.float32))        # half inputs: fp32 arithmetic
        count = x.numel() // x.shape[1]
        rough = xf.mean(dims) if count else xf.new_zeros(x.shape[1])
        centred = xf - _channel_view(rough, x)
        # The corrected two-pass algorithm: the fp32 mean is off by up to its rounding, which the merge
        # below would carry into the variance to first order; the centred sum gives the rest of it.
        shift = centred.sum(dims).double()
        local_mean = rough.double() + shift / max(count, 1)
        local_m2 = centred.square().sum(dims).double() - shift.square() / max(count, 1)
        # float64: counts stay exact and the merge adds no round-off of its own
        slots = torch.zeros(grid.size(*BATCH_AXES), 3, x.shape[1], dtype=torch.float64, device=x.device)
        mine = slots[grid.coord("data") * grid.size("z") + grid.coord("z")]
        mine[0], mine[1], mine[2] = count, local_mean, local_m2
        comm.all_reduce(grid, slots, *BATCH_AXES)
        counts, means, m2s = slots.unbind(1)                                    # (G, C) each
        total = int(counts[:, 0].sum().item())
        if total <= 1:
            raise ValueError(f"{name}: expected more than 1 value per channel when training, got {total} "
                             f"(input {tuple(x.shape)} on each of z*data={grid.size(*BATCH_AXES)} ranks)")
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
        rstd = torch.rsqrt(m2 / total + eps).to(xf.dtype)
        xhat = (xf - _channel_view(mean.to(xf.dtype), x)) * _channel_view(rstd, x)
        if running_mean is not None:        # torch's update: unbiased variance, factor = momentum or 1 / batches
            running_mean.copy_(factor * mean + (1 - factor) * running_mean)
            running_var.copy_(factor * m2 / (total - 1) + (1 - factor) * running_var)
        # never the saved x̂ itself (an in-place ReLU after the norm would change it before backward)
        out = xhat * _channel_view(weight.to(xf.dtype), x) if weight is not None else xhat.clone()
        if bias is not None:
            out = out + _channel_view(bias.to(xf.dtype), x)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.grid, ctx.total, ctx.dims = grid, total, dims
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, rstd, weight = ctx.saved_tensors
        g = grad_out.to(xhat.dtype)
        sums = torch.stack([g.sum(ctx.dims), (g * xhat).sum(ctx.dims)])         # (2, C): this rank's samples
        # the parameters' gradients are this rank's share (sync_gradients sums them over z and data);
        # autograd casts them to the parameters' dtype
        grad_weight = sums[1].clone() if ctx.needs_input_grad[1] else None
        grad_bias = sums[0].clone() if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            comm.all_reduce(ctx.grid, sums, *BATCH_AXES)
            scale = rstd if weight is None else rstd * weight.to(rstd.dtype)
            grad_x = _channel_view(scale, xhat) * (g - _channel_view(sums[0] / ctx.total, xhat)
                                                   - xhat * _channel_view(sums[1] / ctx.total, xhat))
            grad_x = grad_x.to(grad_out.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class BatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm1d/2d/3d`` (channels in dim 1) whose statistics are the whole batch's when
    its samples are split over z and data: same parameters, buffers and their names.

    Training (or ``track_running_stats=False``) normalises by the batch's statistics and
    updates ``running_mean`` / ``running_var`` / ``num_batches_tracked`` as torch does on the
    whole batch (``momentum=None``: the cumulative average); evaluation with running
    statistics needs no collective. With z*data = 1 it is torch's batch norm."""

    def __init__(self, num_features: int, *, grid: Grid, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, bias: bool = True, name: str = "BatchNorm"):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, grid.device, bias=bias)
        self.grid, self.name = grid, name
        for param in self.parameters(recurse=False):
            place(param, WHOLE)

    @classmethod
    def from_module(cls, module: nn.modules.batchnorm._BatchNorm, *, grid: Grid, name: str = "BatchNorm"
                    ) -> BatchNorm:
        """The synchronised twin of ``module``, holding the very same parameter and buffer tensors
        (state_dict keys and values unchanged; an optimizer over them still sees them)."""
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"{name} is a lazy batch norm whose num_features is not known yet: run one batch "
                             f"through the model before par4d takes it")
        layer = cls(module.num_features, grid=grid, eps=module.eps, momentum=module.momentum, affine=module.affine,
                    track_running_stats=module.track_running_stats, name=name)
        layer._parameters.update(module._parameters)
        layer._buffers.update(module._buffers)
        for param in layer.parameters(recurse=False):
            place(param, WHOLE)
        layer.train(module.training)
        return layer

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"{self.name}: expected input (N, {self.num_features}, ...) with channels in dim 1, "
                             f"got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid.size(*BATCH_AXES) == 1 or x.is_meta:    # every sample here, or a shapes-only pass
            return super().forward(x)                         # (par4d.parallelize's plan): torch's
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        if not self.training and self.running_mean is not None:     # running statistics: nothing to synchronise
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        update = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(x, self.weight, self.bias, self.running_mean if update else None,
                                    self.running_var if update else None, factor, self.eps, self.grid, self.name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, synchronised over z*data={self.grid.size(*BATCH_AXES)}"
