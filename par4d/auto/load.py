"""Weights for a model ``par4d.parallelize`` made, read shard by shard from a
``safetensors`` file of the unparallelized model's state dict.

Built on the meta device (``with torch.device("meta"): model = Model(config)``) and made
parallel, a model never exists whole on a rank: each rank reads from the file only the
slices of its own shards (:func:`par4d.layout.boxes`), and whole tensors only for what
stays whole (norms, biases of replicated layers, tied weights).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from par4d.grid import AXES, Grid
from par4d.layout import Placement, boxes, fill, place, placement_of, slice_reader
from par4d.nn.base import ShardedModule


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | Path, grid: Grid) -> None:
    """Fill every parameter of ``model`` (made by ``par4d.parallelize`` on ``grid``) and every
    buffer the file holds from ``path``, keyed as the unparallelized model's ``state_dict``.
    Parameters still on the meta device are made on ``grid.device`` first (tied ones stay
    tied). Not collective: each rank reads its own slices.

    A parameter the file lacks, or holds at another shape, raises ``ValueError`` naming it,
    before anything is read; so does a buffer left on the meta device that the file does
    not hold, unless the model knows how to compute it (a Hugging Face model's
    ``_init_weights``: rotary frequencies, for one)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"load_safetensors: no such file {path}")
    coords = {a: grid.coord(a) for a in AXES}
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        wanted = _wanted(model, grid)
        problems = [f"{name} is not in the file" for name in wanted if name not in keys]
        problems += [f"{name} has shape {tuple(f.get_slice(name).get_shape())} in the file, the model "
                     f"{full}" for name, (_, _, full) in wanted.items()
                     if name in keys and tuple(f.get_slice(name).get_shape()) != full]
        if problems:
            raise ValueError(f"load_safetensors: {path}: {problems[0]}" +
                             (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        made: dict[int, nn.Parameter] = {}
        for name, (module, attribute, full) in wanted.items():
            param = getattr(module, attribute)
            if id(param) not in made:
                made[id(param)] = _filled(param, f, name, full, grid, coords)
            setattr(module, attribute, made[id(param)])
        for prefix, module in model.named_modules():
            for attribute, buffer in list(module.named_buffers(recurse=False)):
                name = f"{prefix}.{attribute}" if prefix else attribute
                if name in keys:
                    value = f.get_tensor(name)
                    setattr(module, attribute, value.to(grid.device) if buffer.is_meta else buffer.copy_(value))
    _computed_buffers(model, grid)


def _wanted(model: nn.Module, grid: Grid) -> dict[str, tuple[nn.Module, str, tuple[int, ...]]]:
    """{state-dict name: (its module, attribute, full shape)} of every parameter, tied ones under each name."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            placement = placement_of(param)
            sharded = isinstance(module, ShardedModule) and placement is not None
            full = placement.full_shape(tuple(param.shape), grid) if sharded else tuple(param.shape)
            out[f"{prefix}.{attribute}" if prefix else attribute] = (module, attribute, full)
    return out


def _filled(param: nn.Parameter, f, name: str, full: tuple[int, ...], grid: Grid,
            coords: dict[str, int]) -> nn.Parameter:
    """``param`` (or, if on the meta device, a new one on the grid's device with the same
    placement) holding its shard of the file's tensor ``name``."""
    placement = placement_of(param) or Placement((), ())
    target = param
    if param.is_meta:
        target = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=grid.device),
                              requires_grad=param.requires_grad)
        if placement_of(param) is not None:
            place(target, placement)
    whole = boxes(Placement((), ()), full, {}, {})[0]
    for box in boxes(placement, full, coords, grid.sizes):
        fill(target.data, box, whole, slice_reader(f, name))
    return target


def _computed_buffers(model: nn.Module, grid: Grid) -> None:
    """Buffers still on the meta device (not saved: computed in the model's constructor) are
    made on the grid's device and computed by the model's own initialisation, if it has one."""
    left = [(n, m) for n, m in model.named_modules() if any(b.is_meta for b in m.buffers(recurse=False))]
    init = getattr(model, "_init_weights", None)
    if left and init is None:
        raise ValueError(f"load_safetensors: {left[0][0]} has buffers on the meta device that the file does not "
                         f"hold and {type(model).__name__} cannot compute (no _init_weights)")
    for _, module in left:
        for attribute, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, attribute, torch.empty_like(buffer, device=grid.device))
        init(module)
