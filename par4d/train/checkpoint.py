"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Each rank saves its own shards under keys that name the shard's coordinates
(``blocks.0.mlp.fc.weight@x1.y0.z1``, :func:`par4d.layout.shard_name`); copies that are
replicated over an axis share one key, and DCP writes such a key once. ``meta.json``
records every parameter's full shape and placement (what resharding needs). A checkpoint is a folder
``checkpoints/step-<N>/`` (DCP files + ``meta.json``); the text file
``checkpoints/latest`` names the newest complete one and is replaced atomically, so
an interrupted save never loses the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from par4d.grid import Grid, describe
from par4d.layout import placement_of, shard_name
from par4d.train.rank0 import on_rank0

FOLDER = "checkpoints"
ADAMW_SLOTS = ("step", "exp_avg", "exp_avg_sq")


def _placement(name: str, param: torch.Tensor):
    placement = placement_of(param)
    if placement is None:  # a key without coordinates would be deduplicated across ranks
        raise ValueError(f"parameter {name!r} has no placement: par4d cannot tell how it is sharded")
    return placement


def _shard_key(grid: Grid, name: str, param: torch.Tensor) -> str:
    return shard_name(grid, name, _placement(name, param))


def placements(grid: Grid, model: nn.Module) -> dict[str, dict]:
    """Every parameter's full shape and placement, as ``meta.json`` records them."""
    out = {}
    for name, param in model.named_parameters():
        placement = _placement(name, param)
        out[name] = {"shape": list(placement.full_shape(tuple(param.shape), grid)), **placement.as_dict()}
    return out


def _state(grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        key = _shard_key(grid, name, param)
        state[f"model/{key}"] = param.data
        for slot, value in optimizer.state.get(param, {}).items():
            state[f"optim/{key}/{slot}"] = value
    return state


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) is not torch.optim.AdamW or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError(f"checkpoints hold AdamW state (without amsgrad); got {type(optimizer).__name__}")


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save(run_dir: Path, step: int, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict) -> Path:
    """Collective: save model and optimizer shards of ``step``; returns its folder."""
    _check_optimizer(optimizer)
    folder = run_dir / FOLDER
    target = folder / f"step-{step:08d}"

    def prepare():
        folder.mkdir(parents=True, exist_ok=True)
        if target.exists():  # an incomplete earlier attempt at this step: never the latest
            shutil.rmtree(target)

    on_rank0(prepare)
    dcp.save(_state(grid, model, optimizer), checkpoint_id=str(target))
    layout = placements(grid, model)

    def commit():
        record = dict(meta, step=step, grid=grid.sizes, placements=layout)
        _fsync_write(target / "meta.json", json.dumps(record, indent=2))
        _fsync_write(folder / "latest.tmp", target.name)
        os.replace(folder / "latest.tmp", folder / "latest")
        for old in folder.glob("step-*"):
            if old != target:
                shutil.rmtree(old)

    on_rank0(commit)
    return target


def latest(run_dir: Path) -> Path:
    pointer = run_dir / FOLDER / "latest"
    if not pointer.is_file():
        raise ValueError(f"--resume {run_dir}: no checkpoint there (expected {pointer})")
    return run_dir / FOLDER / pointer.read_text().strip()


def read_meta(run_dir: Path) -> dict:
    return json.loads((latest(run_dir) / "meta.json").read_text())


def check_resumable(run_dir: Path, sizes: dict[str, int], steps: int | None = None) -> dict:
    """The meta of ``run_dir``'s latest checkpoint, if a run on the grid ``sizes`` (every axis, as
    ``validate_sizes`` returns it) can resume from it and, given ``steps``, still has steps to take."""
    meta = read_meta(run_dir)
    if steps is not None and steps <= meta["step"]:
        raise ValueError(f"--resume {run_dir}: the checkpoint is at step {meta['step']}; "
                         f"pass --steps greater than that (got {steps})")
    if meta["grid"] != sizes:
        saved, this = describe(meta["grid"]), describe(sizes)
        raise ValueError(f"--resume {run_dir}: the checkpoint was saved on grid {saved}, this run is {this}; "
                         f"resuming on another grid is not supported yet")
    return meta


def load(run_dir: Path, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: load shards saved at the same grid; returns the checkpoint's meta."""
    _check_optimizer(optimizer)
    meta = check_resumable(run_dir, grid.sizes)
    # DCP loads in place: give AdamW's state its tensors first.
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state.get(param):
                optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
    dcp.load(_state(grid, model, optimizer), checkpoint_id=str(latest(run_dir)))
    return meta
