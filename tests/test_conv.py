"""par4d.nn.Conv2d (Algorithm 1 with in-channels as k, out-channels as n) against
torch.nn.Conv2d on real grids: a normal layer then a transposed one (the first's output
layout is the second's input), with stride, padding and bias: outputs, the input gradient
and every parameter's gradient."""

import pytest
import torch

import par4d
from par4d.layout import shard_activation
from par4d.optim.data_parallel import sync_gradients
from tests import cases

BATCH, C_IN, C_MID, C_OUT, SIDE = 4, 4, 8, 4, 6


def _shard(grid, tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """This rank's samples and channel block (dim 1) over ``axis``."""
    return shard_activation(grid, tensor.movedim(1, -1), axis).movedim(-1, 1).contiguous()


def _compare_conv(sizes: dict) -> dict:
    grid = cases.grid(**sizes)
    first = par4d.nn.Conv2d(C_IN, C_MID, 3, stride=1, padding=1, grid=grid, seed=3)
    second = par4d.nn.Conv2d(C_MID, C_OUT, 3, stride=2, padding=1, bias=False, transposed=True, grid=grid, seed=4)
    model = torch.nn.Sequential(first, second)
    ref = torch.nn.Sequential(torch.nn.Conv2d(C_IN, C_MID, 3, 1, 1), torch.nn.Conv2d(C_MID, C_OUT, 3, 2, 1, bias=False))
    with torch.no_grad():
        ref[0].weight.copy_(first.full_tensor(first.weight))
        ref[0].bias.copy_(first.full_tensor(first.bias))
        ref[1].weight.copy_(second.full_tensor(second.weight))
    gen = torch.Generator().manual_seed(11)
    inp = torch.randn(BATCH, C_IN, SIDE, SIDE, generator=gen)
    target = torch.randn(BATCH, C_OUT, SIDE // 2, SIDE // 2, generator=gen)
    ref_in = inp.clone().requires_grad_()
    ref_out = ref(ref_in)
    (ref_out * target).sum().div(BATCH).backward()

    local_in = _shard(grid, inp, first.in_axis).requires_grad_()
    out = model(local_in)
    (out * _shard(grid, target, second.out_axis)).sum().div(local_in.shape[0]).backward()
    sync_gradients(model, grid)
    shards = grid.size("data", "z")       # the local loss is the mean over this rank's samples
    return {
        "out": (out - _shard(grid, ref_out.detach(), second.out_axis)).abs().max().item(),
        "grad_in": (local_in.grad / shards - _shard(grid, ref_in.grad, first.in_axis)).abs().max().item(),
        "grads": [(mine - theirs.grad).abs().max().item() / theirs.grad.abs().max().item() for mine, theirs in (
            (first.full_tensor(first.weight, grad=True), ref[0].weight),
            (first.full_tensor(first.bias, grad=True), ref[0].bias),
            (second.full_tensor(second.weight, grad=True), ref[1].weight))],
        "shapes": [tuple(first.weight.shape), tuple(second.weight.shape), tuple(out.shape)],
    }


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(x=2, y=2), dict(y=2, data=2)], ids=["x2z2", "x2y2", "y2d2"])
def test_conv_matches_torch_4_ranks(pool4, sizes):
    for r in pool4.run(_compare_conv, sizes):
        assert r["out"] < 1e-5 and r["grad_in"] < 1e-6 and max(r["grads"]) < 1e-5, r


def test_conv_matches_torch_8_ranks(pool8):
    for r in pool8.run(_compare_conv, dict(x=2, y=2, z=2)):
        assert r["out"] < 1e-5 and r["grad_in"] < 1e-6 and max(r["grads"]) < 1e-5, r
        # The shards Algorithm 1 stores: out-channels over x then z, in-channels over y (normal);
        # x and y swapped (transposed); the output's channels over y, samples over z.
        assert r["shapes"] == [(8 // 4, 4 // 2, 3, 3), (4 // 4, 8 // 2, 3, 3), (4 // 2, 4 // 2, 3, 3)]


def test_indivisible_channels_are_named():
    grid = par4d.grid.Grid.virtual({"x": 2, "y": 1, "z": 2})
    with pytest.raises(ValueError, match=r"out_channels=6 is not divisible by x \* z = 2 \* 2 = 4"):
        par4d.nn.Conv2d(4, 6, 3, grid=grid)
    with pytest.raises(ValueError, match=r"in_channels=3 is not divisible by x=2"):
        par4d.nn.Conv2d(3, 4, 3, transposed=True, grid=grid)
