"""Checkpoint round trips on grids with replicated (data, x) and sharded (y, z) keys."""

import pytest
import torch

from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.train import checkpoint
from par4d.train.step import train_step
from tests import cases

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, seed=9)


def _step(model, grid, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=gen)
    x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
    train_step(model, opt, grid, model, x, y)


def _round_trip(sizes: dict, folder: str) -> int:
    from pathlib import Path

    grid = cases.grid(**sizes)
    model = GPT(CONFIG, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        _step(model, grid, opt, seed)
    run = Path(folder) / "x{x}y{y}z{z}d{data}".format(**sizes)
    checkpoint.save(run, 2, grid, model, opt, {"note": "test"})

    fresh = GPT(CONFIG.__class__(**{**CONFIG.__dict__, "seed": 1}), grid=grid)   # different weights
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert checkpoint.load(run, grid, fresh, fresh_opt)["step"] == 2
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][slot], fresh_opt.state[b][slot]), (name, slot)
    # Both continue identically.
    _step(model, grid, opt, 7)
    _step(fresh, grid, fresh_opt, 7)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    return len(list(model.parameters()))


@pytest.mark.parametrize("sizes", [dict(x=1, y=2, z=1, data=2), dict(x=1, y=1, z=2, data=2),
                                   dict(x=2, y=2, z=1, data=1)], ids=lambda s: "x{x}y{y}z{z}d{data}".format(**s))
def test_checkpoint_round_trip(pool4, tmp_path, sizes):
    counts = pool4.run(_round_trip, sizes, str(tmp_path))
    assert counts == [len(list(ReferenceGPT(CONFIG, init=False).parameters()))] * 4


def _wrong_grid(folder: str):
    from pathlib import Path

    grid = cases.grid(x=2, y=2)
    model = GPT(CONFIG, grid=grid)
    return checkpoint.load(Path(folder) / "x1y2z1d2", grid, model, torch.optim.AdamW(model.parameters()))


def test_checkpoint_refuses_another_grid(pool4, tmp_path):
    pool4.run(_round_trip, dict(x=1, y=2, z=1, data=2), str(tmp_path))
    for message in pool4.errors(_wrong_grid, str(tmp_path), timeout=30):
        assert "saved on grid x=1 y=2 z=1 data=2 pipe=1" in message and "x=2 y=2 z=1 data=1" in message


def _placements_recorded(sizes: dict, folder: str) -> int:
    """meta.json's placements cut the full model into exactly the shards this rank holds."""
    import json
    from pathlib import Path

    from par4d.layout import Placement, shard

    grid = cases.grid(**sizes)
    model = GPT(CONFIG, grid=grid)
    run = Path(folder) / "placements"
    checkpoint.save(run, 1, grid, model, torch.optim.AdamW(model.parameters()), {})
    recorded = json.loads((checkpoint.latest(run) / "meta.json").read_text())["placements"]
    full = model.reference_state()
    assert set(recorded) == set(full)
    for name, param in model.named_parameters():
        assert recorded[name]["shape"] == list(full[name].shape), name
        assert torch.equal(shard(grid, full[name], Placement.from_dict(recorded[name])), param.detach()), name
    return len(recorded)


def test_checkpoint_records_every_placement(pool8, tmp_path):
    """On x, y and z all 2: chunked (qkv), nested (x then z) and replicated pieces."""
    counts = pool8.run(_placements_recorded, dict(x=2, y=2, z=2, data=1), str(tmp_path))
    assert counts == [len(list(ReferenceGPT(CONFIG, init=False).parameters()))] * 8
