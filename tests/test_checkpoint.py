"""Checkpoint round trips on grids with replicated (data, x) and sharded (y, z) keys."""

import pytest
import torch

from par4d import checkpoint
from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.train.step import train_step
from tests import cases
from tests.helpers import grid_id, sizes_id

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, seed=9)


def _step(model, grid, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=gen)
    x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
    train_step(model, opt, grid, (x, y))


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
                                   dict(x=2, y=2, z=1, data=1)], ids=grid_id)
def test_checkpoint_round_trip(pool4, tmp_path, sizes):
    counts = pool4.run(_round_trip, sizes, str(tmp_path))
    assert counts == [len(list(ReferenceGPT(CONFIG, init=False).parameters()))] * 4


def _full_optimizer_state(grid, model, opt) -> dict:
    from par4d.layout import placement_of, unshard

    out = {}
    for name, param in model.named_parameters():
        for slot in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{slot}"] = unshard(grid, opt.state[param][slot], placement_of(param))
        out[f"{name}/step"] = opt.state[param]["step"].clone()
    return out


def _global_loss(model, grid, seed) -> float:
    from par4d.optim.data_parallel import global_mean

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=gen)
    x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
    with torch.no_grad():
        return global_mean(model(x, y), grid).item()


def _train_and_save(sizes: dict, folder: str) -> dict:
    """Grid A: 2 steps, save, then 2 more steps; the full state at the save and the
    continuation's losses (what grid B must reproduce)."""
    from pathlib import Path

    grid = cases.grid(**sizes)
    model = GPT(CONFIG, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        _step(model, grid, opt, seed)
    checkpoint.save(Path(folder), 2, grid, model, opt, {"note": "grid A"})
    saved = {"model": model.reference_state(), "optim": _full_optimizer_state(grid, model, opt)}
    losses = []
    for seed in (7, 8):
        _step(model, grid, opt, seed)
        losses.append(_global_loss(model, grid, 100 + seed))
    return {**saved, "losses": losses}


def _load_elsewhere(sizes: dict, folder: str, expected: dict) -> int:
    """Grid B: load A's checkpoint; the full model and optimizer state equal A's bit for bit
    and training goes on as A's did, to fp32 rounding."""
    from pathlib import Path

    grid = cases.grid(**sizes)
    model = GPT(CONFIG.__class__(**{**CONFIG.__dict__, "seed": 1}), grid=grid)   # other weights until loaded
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert checkpoint.load(Path(folder), grid, model, opt)["step"] == 2
    for name, tensor in model.reference_state().items():
        assert torch.equal(tensor, expected["model"][name]), f"{grid.describe()}: {name}"
    for key, tensor in _full_optimizer_state(grid, model, opt).items():
        assert torch.equal(tensor, expected["optim"][key]), f"{grid.describe()}: optimizer {key}"
    for seed, want in zip((7, 8), expected["losses"]):
        _step(model, grid, opt, seed)
        got = _global_loss(model, grid, 100 + seed)
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, f"{grid.describe()} after step {seed}: {got} vs {want}"
    return len(expected["model"])


@pytest.mark.parametrize("a, b", [
    (dict(x=2, z=2), dict(y=2, z=2)),
    (dict(z=4), dict(x=2, data=2)),
    (dict(data=4), dict(x=2, y=2)),
    (dict(y=2, data=2), dict(z=2, data=2)),
], ids=sizes_id)
def test_a_checkpoint_loads_at_another_grid(pool4, tmp_path, a, b):
    expected = pool4.run(_train_and_save, a, str(tmp_path))[0]
    counts = pool4.run(_load_elsewhere, b, str(tmp_path), expected)
    assert counts == [len(list(ReferenceGPT(CONFIG, init=False).parameters()))] * 4


def test_a_checkpoint_of_4_ranks_loads_on_8(pool4, pool8, tmp_path):
    """Saved by x=2,z=2 on 4 ranks, loaded by x=2,y=2,z=2 and x=2,z=2,data=2 on 8 (and back)."""
    expected = pool4.run(_train_and_save, dict(x=2, z=2), str(tmp_path / "four"))[0]
    pool8.run(_load_elsewhere, dict(x=2, y=2, z=2), str(tmp_path / "four"), expected)
    pool8.run(_load_elsewhere, dict(x=2, z=2, data=2), str(tmp_path / "four"), expected)
    expected = pool8.run(_train_and_save, dict(x=2, y=2, z=2), str(tmp_path / "eight"))[0]
    pool4.run(_load_elsewhere, dict(z=2, data=2), str(tmp_path / "eight"), expected)


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


def _save_two(sizes: dict, folder: str) -> None:
    from pathlib import Path

    grid = cases.grid(**sizes)
    model = GPT(CONFIG, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):
        _step(model, grid, opt, step)
        checkpoint.save(Path(folder), step, grid, model, opt, {"train_config": {}}, keep=2)


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: a crafted checkpoint trying to run code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _damages(path, marker):
    import pickle

    data = path.read_bytes()
    half = len(data) // 2
    flipped = bytearray(data)
    flipped[half] ^= 0x01
    return {"truncated": data[:half], "zeroed": bytes(len(data)), "overwritten": b"x" * len(data),
            "flipped": bytes(flipped), "pickle": pickle.dumps(_Payload(str(marker)))}


def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(pool4, tmp_path):
    """Every kind of file of the newest checkpoint, truncated, zeroed, overwritten, one bit
    flipped, or replaced by a pickle payload: the damage is reported naming the file, the
    previous checkpoint is chosen, and nothing in the files runs."""
    import shutil

    run = tmp_path / "run"
    pool4.run(_save_two, dict(x=2, z=2), str(run))
    newest, previous = checkpoint.latest(run), run / "checkpoints" / "step-00000001"
    assert newest.name == "step-00000002" and previous.is_dir()
    pristine = tmp_path / "pristine"
    shutil.copytree(newest, pristine)
    marker = tmp_path / "payload-ran"
    files = ["index.json", "meta.json", "manifest.json"] + sorted(p.name for p in newest.glob("*.safetensors"))
    for name in files:
        for damage, data in _damages(pristine / name, marker).items():
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            (newest / name).write_bytes(data)
            reports = []
            assert checkpoint.choose(run, reports.append) == previous, (name, damage)
            assert len(reports) == 1 and name in reports[0] and "step-00000002" in reports[0], (name, damage, reports)
            assert not marker.exists(), f"{name} ({damage}): the payload ran"
    # A garbled pointer and a missing manifest (an interrupted save) fall back too.
    shutil.rmtree(newest)
    shutil.copytree(pristine, newest)
    (run / "checkpoints" / "latest").write_bytes(b"\x80garbage")
    assert checkpoint.choose(run) == newest                 # the pointer is only a hint: newest intact
    (newest / "manifest.json").unlink()
    assert checkpoint.choose(run) == previous
    (previous / "index.json").write_bytes(b"{}")
    with pytest.raises(ValueError, match="no intact checkpoint"):
        checkpoint.choose(run)


def _retention(folder: str) -> list[str]:
    """keep=1 with a leftover folder of a later step (an interrupted save of another timeline),
    then the latest step saved again (a restart after the final save)."""
    from pathlib import Path

    import torch.distributed as dist

    grid = cases.grid(x=2)
    model = GPT(CONFIG, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, grid, opt, 0)
    run = Path(folder)
    checkpoint.save(run, 10, grid, model, opt, {}, keep=1)
    if grid.rank == 0:
        (run / "checkpoints" / "step-00000020").mkdir()
    dist.barrier()
    kept = checkpoint.save(run, 12, grid, model, opt, {}, keep=1)
    before = {f.name: f.stat().st_mtime_ns for f in kept.iterdir()}
    _step(model, grid, opt, 1)                   # other weights: a rewrite would change the files
    assert checkpoint.save(run, 12, grid, model, opt, {}, keep=1) == kept
    assert {f.name: f.stat().st_mtime_ns for f in kept.iterdir()} == before
    assert checkpoint.choose(run) == kept
    return sorted(f.name for f in (run / "checkpoints").iterdir())


def test_keep_never_deletes_the_new_checkpoint_nor_rewrites_the_latest(pool2, tmp_path):
    listing = pool2.run(_retention, str(tmp_path))[0]
    assert listing == ["abandoned-step-00000020", "latest", "step-00000012"]


def _full_disk(folder: str) -> list[str]:
    """Saves of step 12 on a disk that fills while rank 1 writes its shard, then while rank 0 writes the
    meta: every rank raises (none left waiting in a collective), naming the file; step 10 stays the newest
    intact checkpoint."""
    import errno
    import os
    from pathlib import Path
    from unittest import mock

    grid = cases.grid(x=2)
    model = GPT(CONFIG, grid=grid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = Path(folder)
    checkpoint.save(run, 10, grid, model, opt, {}, keep=2)
    messages, real = [], os.replace
    for full in ("rank-00001.safetensors", "meta.json"):
        def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None, name=full):
            if dst == name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        with mock.patch("par4d.folder.os.replace", replace), pytest.raises(Exception) as raised:
            checkpoint.save(run, 12, grid, model, opt, {}, keep=2)
        messages.append(f"{type(raised.value).__name__}: {raised.value}")
        assert checkpoint.choose(run).name == "step-00000010"
    return messages


def test_a_full_disk_during_a_save_names_the_file_and_loses_nothing(pool2, tmp_path):
    step = tmp_path / "checkpoints" / "step-00000012"
    for rank, (shard, meta) in enumerate(pool2.run(_full_disk, str(tmp_path))):
        assert shard == (f"OSError: cannot write checkpoint file {step / 'rank-00001.safetensors'} (No space left "
                         f"on device); the checkpoints before step 12 are intact: make room and --resume")
        said = (f"cannot write {step / 'meta.json'} (No space left on device); the checkpoints before step 12 are "
                f"intact: make room and --resume")
        assert meta == (f"OSError: {said}" if rank == 0 else f"Rank0Failed: rank 0 failed: OSError: {said}")


def test_a_restart_whose_first_save_was_cut_short_starts_over(tmp_path, capsys):
    from par4d.cli.train import _stopped
    from par4d.train.loop import _newest_intact

    (tmp_path / "checkpoints" / "step-00000005").mkdir(parents=True)   # killed while saving step 5
    assert checkpoint.has_checkpoint(tmp_path) and _newest_intact(tmp_path) is None
    said = capsys.readouterr().out
    assert "no intact checkpoint" in said and "starting over" in said
    assert _stopped(15, tmp_path) == 143
    assert "stopped by SIGTERM before a checkpoint was complete" in capsys.readouterr().out
