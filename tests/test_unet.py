"""par4d's U-Net (par4d.nn.Conv2d layers) against its single-device twin on real grids:
loss, every gradient, and parameters after 3 AdamW steps, in float64."""

import pytest
import torch

from par4d.layout import shard_activation
from par4d.models.unet import ReferenceUNet, UNet, UNetConfig
from par4d.nn import full_state_dict
from par4d.optim.data_parallel import global_mean, sync_gradients
from tests import cases

CONFIG = UNetConfig(channels=4, width=8, levels=2, seed=3)
STEPS = 3


def _shard(grid, tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """This rank's samples and channel block (dim 1) over ``axis``."""
    return shard_activation(grid, tensor.movedim(1, -1), axis).movedim(-1, 1).contiguous()


def _matches(sizes: dict) -> dict:
    """In float64 (``cases.float64``): 3 AdamW steps in fp32 would compare round-off amplified."""
    with cases.float64():
        return _compare(cases.grid(**sizes))


def _compare(grid) -> dict:
    model = UNet(CONFIG, grid=grid)
    twin = ReferenceUNet(CONFIG)
    twin.load_state_dict(full_state_dict(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-4)
    gen = torch.Generator().manual_seed(5)
    far, losses = [], []
    for step in range(STEPS):
        images = torch.randn(4, CONFIG.channels, 8, 8, generator=gen)
        targets = images.flip(-1)                                  # learn a mirror
        ref = twin.loss(images, targets)
        ref.backward()
        local = model.loss(_shard(grid, images, "y"), _shard(grid, targets, "y"))
        local.backward()
        sync_gradients(model, grid)
        losses.append((global_mean(local, grid).item(), ref.item()))
        grads = full_state_dict(model, grad=True)
        far += [f"step {step} grad {n}" for n, p in twin.named_parameters()
                if not torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6)]
        opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
    after = full_state_dict(model)
    far += [f"{n} after {STEPS} steps" for n, p in twin.named_parameters()
            if not torch.allclose(after[n], p, rtol=1e-5, atol=1e-5)]
    return {"far": far, "losses": losses, "names": sorted(after) == sorted(n for n, _ in twin.named_parameters())}


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(x=2, y=2), dict(y=2, data=2)], ids=["x2z2", "x2y2", "y2d2"])
def test_unet_4_ranks(pool4, sizes):
    for r in pool4.run(_matches, sizes):
        assert r["names"] and not r["far"], r
        assert all(abs(mine - ref) <= 1e-5 * ref for mine, ref in r["losses"]), r["losses"]


def test_unet_8_ranks(pool8):
    for r in pool8.run(_matches, dict(x=2, y=2, z=2)):
        assert r["names"] and not r["far"], r
        assert all(abs(mine - ref) <= 1e-5 * ref for mine, ref in r["losses"]), r["losses"]
