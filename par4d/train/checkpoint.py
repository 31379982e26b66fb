"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Each rank saves its own shards under keys that name the shard's coordinates
(``blocks.0.mlp.fc.weight@x1.y0.z1``); copies that are replicated over an axis share
one key, and DCP writes such a key once. ``meta.json`` records the step, grid and
configs; a checkpoint is written to ``checkpoint.tmp`` and renamed over the previous
one only when complete, so an interrupted save never loses the last good one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from par4d.grid import Grid
from par4d.layout import TENSOR_AXES, spec

CHECKPOINT = "checkpoint"


def _shard_key(grid: Grid, name: str, param: torch.Tensor) -> str:
    placement = spec(param)
    axes = [a for a in TENSOR_AXES if placement is not None and a in placement.sharded and grid.size(a) > 1]
    return name + ("@" + ".".join(f"{a}{grid.coord(a)}" for a in axes) if axes else "")


def _state(grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        key = _shard_key(grid, name, param)
        state[f"model/{key}"] = param.data
        for slot, value in optimizer.state.get(param, {}).items():
            state[f"optim/{key}/{slot}"] = value
    return state


def save(run_dir: Path, step: int, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict) -> Path:
    """Collective: save model and optimizer shards of ``step`` into ``run_dir/checkpoint``."""
    final, tmp = run_dir / CHECKPOINT, run_dir / f"{CHECKPOINT}.tmp"
    if grid.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(_state(grid, model, optimizer), checkpoint_id=str(tmp))
    if grid.rank == 0:
        (tmp / "meta.json").write_text(json.dumps(dict(meta, step=step, grid=grid.sizes), indent=2))
        old = run_dir / f"{CHECKPOINT}.old"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()
    return final


def read_meta(run_dir: Path) -> dict:
    path = run_dir / CHECKPOINT / "meta.json"
    if not path.is_file():
        raise ValueError(f"--resume {run_dir}: no checkpoint there (expected {path})")
    return json.loads(path.read_text())


def load(run_dir: Path, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: load shards saved at the same grid; returns the checkpoint's meta."""
    meta = read_meta(run_dir)
    if meta["grid"] != grid.sizes:
        saved = " ".join(f"{a}={s}" for a, s in meta["grid"].items())
        raise ValueError(f"--resume {run_dir}: the checkpoint was saved on grid {saved}, this run is "
                         f"{grid.describe()}; resuming on another grid is not supported yet")
    # Materialize optimizer state so DCP has tensors to load into.
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in optimizer.state or not optimizer.state[param]:
                optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
    state = _state(grid, model, optimizer)
    dcp.load(state, checkpoint_id=str(run_dir / CHECKPOINT))
    return meta
