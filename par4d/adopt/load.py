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

from par4d.adopt.expert_files import stacked_view
from par4d.adopt.pretrained import opened, weight_files
from par4d.grid import Grid
from par4d.layout import Placement, boxes, fill, place, placement_of, slice_reader
from par4d.nn.base import ShardedModule


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | Path, grid: Grid) -> None:
    """Fill every parameter of ``model`` (made by ``par4d.parallelize`` on ``grid``) and every
    buffer the file holds from ``path``, keyed as the unparallelized model's ``state_dict``:
    one safetensors file, or a Hugging Face model folder's weights (one file, or shards named by
    ``model.safetensors.index.json``: :mod:`par4d.adopt.pretrained`). Parameters still on the meta
    device are made on ``grid.device`` first (tied ones stay tied, read under whichever of their
    names the file holds, as ``save_pretrained`` keeps only one). Values are cast to the
    parameter's dtype (bf16 weights into an fp32 model). Not collective: each rank reads its own
    slices.

    A parameter the file lacks, or holds at another shape, raises ``ValueError`` naming it,
    before anything is read; so does a buffer left on the meta device that the file does
    not hold, unless the model knows how to compute it (a Hugging Face model's
    ``_init_weights``: rotary frequencies, for one)."""
    files = weight_files(path)
    coords = grid.coords()
    with opened(files) as handles:
        shapes = {key: tuple(handles[key].get_slice(key).get_shape()) for key in handles}
        handles, shapes = stacked_view(handles, shapes)      # a mixture's experts, stored one by one
        _fill(model, _sources(model, grid, shapes, path), handles, shapes, grid, coords)
        for prefix, module in model.named_modules():
            for attribute, buffer in list(module.named_buffers(recurse=False)):
                name = f"{prefix}.{attribute}" if prefix else attribute
                if name in handles:
                    value = handles[name].get_tensor(name)
                    setattr(module, attribute, value.to(grid.device) if buffer.is_meta else buffer.copy_(value))
    compute_buffers(model, grid.device)


class _Whole:
    """Whole tensors in memory, read as ``safe_open`` handles are (:func:`par4d.layout.slice_reader`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def get_slice(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]


@torch.no_grad()
def fill_parameters(model: nn.Module, grid: Grid, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the parameters of ``model`` (made by ``par4d.parallelize`` on ``grid``) that ``tensors`` names
    (whole tensors, keyed as the unparallelized model's ``state_dict``; a tied parameter under any of its
    names), each rank keeping its shards; parameters on the meta device are made first. The others are
    left as they are: a model is filled a block at a time (:mod:`par4d.adopt.init`)."""
    wanted = _wanted(model, grid)
    owner = {name: param_id for param_id, (names, _) in wanted.items() for name in names}
    unknown = sorted(set(tensors) - set(owner))
    if unknown:
        raise ValueError(f"fill_parameters: {unknown[0]} is not a parameter of {type(model).__name__}")
    sources = {owner[name]: name for name in tensors}
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    for param_id, key in sources.items():
        if shapes[key] != wanted[param_id][1]:
            raise ValueError(f"fill_parameters: {key} has shape {shapes[key]}, the model {wanted[param_id][1]}")
    whole = _Whole(tensors)
    _fill(model, sources, {key: whole for key in tensors}, shapes, grid, grid.coords())


def _fill(model: nn.Module, sources: dict[int, str], handles: dict, shapes: dict[str, tuple[int, ...]], grid: Grid,
          coords: dict[str, int]) -> None:
    """Each parameter ``sources`` names (by id: its key) filled from its handle, tied ones kept tied."""
    made: dict[int, nn.Parameter] = {}
    new: set[int] = set()
    for _, module in model.named_modules(remove_duplicate=False):
        for attribute, param in list(module.named_parameters(recurse=False)):
            if id(param) in new or (id(param) not in made and id(param) not in sources):
                continue                  # made already (a module met twice), or not one to fill
            if id(param) not in made:
                key = sources[id(param)]
                made[id(param)] = _filled(param, handles[key], key, shapes[key], grid, coords)
                new.add(id(made[id(param)]))
            setattr(module, attribute, made[id(param)])


def check_weights(model: nn.Module, path: str | Path) -> None:
    """Raise what :func:`load_safetensors` would about ``model`` (unparallelized, on the meta
    device) and ``path``: a parameter missing or at another shape. Reads headers only."""
    files = weight_files(path)
    with opened(files) as handles:
        _, shapes = stacked_view(handles, {key: tuple(handles[key].get_slice(key).get_shape()) for key in handles})
        _sources(model, None, shapes, path)


def _sources(model: nn.Module, grid: Grid | None, shapes: dict[str, tuple[int, ...]], path) -> dict[int, str]:
    """{id of each parameter: the key the file holds it under}; raises for the first one missing or
    at another shape than the model's (full, on ``grid``)."""
    sources = {}
    for param_id, (names, full) in _wanted(model, grid).items():
        held = [n for n in names if n in shapes]
        if not held:
            tied = f" (nor {', '.join(names[1:])}, tied to it)" if len(names) > 1 else ""
            raise ValueError(f"load_safetensors: {path}: {names[0]} is not in the file{tied}")
        if shapes[held[0]] != full:
            raise ValueError(f"load_safetensors: {path}: {held[0]} has shape {shapes[held[0]]} in the file, "
                             f"the model {full}")
        sources[param_id] = held[0]
    return sources


def _wanted(model: nn.Module, grid: Grid | None) -> dict[int, tuple[list[str], tuple[int, ...]]]:
    """{id of each parameter: (its state-dict names, tied ones all, in order; its full shape)}."""
    out: dict[int, tuple[list[str], tuple[int, ...]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            placement = placement_of(param)
            sharded = isinstance(module, ShardedModule) and placement is not None
            full = placement.full_shape(tuple(param.shape), grid) if sharded else tuple(param.shape)
            out.setdefault(id(param), ([], full))[0].append(f"{prefix}.{attribute}" if prefix else attribute)
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


def compute_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers still on the meta device (not saved: computed in the model's constructor) are
    made on ``device`` and computed by the model's own initialisation, if it has one."""
    left = [(n, m) for n, m in model.named_modules() if any(b.is_meta for b in m.buffers(recurse=False))]
    init = getattr(model, "_init_weights", None)
    if left and init is None:
        raise ValueError(f"load_safetensors: {left[0][0]} has buffers on the meta device that the file does not "
                         f"hold and {type(model).__name__} cannot compute (no _init_weights)")
    for _, module in left:
        for attribute, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, attribute, torch.empty_like(buffer, device=device))
        init(module)
