"""The special cases of docs/architecture.md (Notation) against PyTorch's own implementations of them.

z only = FSDP (``fully_shard``), z + data = HSDP (``fully_shard`` on a 2D mesh),
data only = ``DistributedDataParallel``: same twin, same global batch, same AdamW.
"""

import copy

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.optim.data_parallel import sync_gradients
from tests import cases

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=5)
BATCH, STEPS = 4, 3


def _full(module: torch.nn.Module) -> dict:
    out = {}
    for name, param in module.named_parameters():
        name = name.removeprefix("module.")
        out[name] = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
    return out


def _against_torch(sizes: dict, wrapper: str) -> int:
    """In float64 (``cases.float64``), as torch's wrappers run it too."""
    with cases.float64():
        return _compare(cases.grid(**sizes), wrapper)


def _compare(grid, wrapper: str) -> int:
    model = GPT(CONFIG, grid=grid)
    twin = ReferenceGPT(CONFIG)
    if wrapper == "ddp":
        torch_model = DistributedDataParallel(copy.deepcopy(twin), process_group=grid.group("data"))
    else:
        mesh = grid.mesh["z"] if wrapper == "fsdp" else grid.mesh["data", "z"]   # 2D mesh = HSDP
        torch_model = copy.deepcopy(twin)
        for block in torch_model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(torch_model, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (model, torch_model)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
        inputs, targets = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
        loss = model(inputs, targets)
        loss.backward()
        sync_gradients(model, grid)
        torch_loss = torch_model(inputs, targets)
        torch_loss.backward()
        torch.testing.assert_close(loss, torch_loss, msg=lambda m: f"{wrapper}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ours, theirs = model.reference_state(), _full(torch_model)
    assert set(ours) == set(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{wrapper} after {STEPS} steps, {n}: {m}")
    return len(theirs)


@pytest.mark.parametrize("sizes, wrapper", [
    (dict(z=4), "fsdp"),
    (dict(z=2, data=2), "hsdp"),
    (dict(data=4), "ddp"),
], ids=["z-only=FSDP", "z+data=HSDP", "data-only=DDP"])
def test_special_case_matches_pytorch(pool4, sizes, wrapper):
    compared = pool4.run(_against_torch, sizes, wrapper)
    assert compared == [len(list(ReferenceGPT(CONFIG, init=False).parameters()))] * 4
