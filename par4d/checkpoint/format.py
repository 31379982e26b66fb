"""What a checkpoint is made of (docs/checkpoints.md): its names, the tensors a model and its AdamW hold,
which rank writes which piece, and the checks on values read from its JSON files."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from par4d.folder import Folder
from par4d.grid import AXES, FOLDED, Grid
from par4d.layout import Placement, placement_of

FOLDER = "checkpoints"
LATEST = "latest"
ADAMW_SLOTS = ("step", "exp_avg", "exp_avg_sq")
FORMAT = "par4d-safetensors-1"
STEP = re.compile(r"step-(\d{8,})")
WHOLE = Placement((), ())
# The dtypes a checkpoint may hold, by their names in index.json; safetensors' names for them.
DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
ENTRY_FILES = ("index.json", "meta.json")
CORRUPT = "corrupt-"      # the prefix of a checkpoint set aside as unusable (set_aside_newer)


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step-<N>``), or None for any other name."""
    match = STEP.fullmatch(name)
    return int(match.group(1)) if match else None


def step_names(folder: Folder) -> dict[int, str]:
    """Step -> name of every entry of ``folder`` named as a checkpoint (``step-<N>``), whatever it is."""
    return {step: name for name in folder.names() if (step := step_of(name)) is not None}


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def param_placement(name: str, param: torch.Tensor) -> Placement:
    placement = placement_of(param)
    if placement is None:
        raise ValueError(f"parameter {name!r} has no placement: par4d cannot tell how it is sharded")
    return placement


def placements(grid: Grid, model: nn.Module) -> dict[str, dict]:
    """Every parameter's full shape and placement, as ``meta.json`` records them."""
    out = {}
    for name, param in model.named_parameters():
        placement = param_placement(name, param)
        out[name] = {"shape": list(placement.full_shape(tuple(param.shape), grid)), **placement.as_dict()}
    return out


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent buffers a ``state_dict`` holds (batch norms' running statistics), by name. Mixed
    precision's masters (:class:`par4d.optim.precision.Masters`) hold parameters only: none there."""
    for prefix, module in model.named_modules() if isinstance(model, nn.Module) else ():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def owns(grid: Grid, placement: Placement) -> bool:
    """Whether this rank writes its piece: it is coordinate 0 of every axis the piece is copied
    over (pipe is not one: a parameter lives on one pipeline stage, but for a weight tied across
    stages, which the earlier stage's copy writes). A piece cut over a folded axis (an expert's) is
    copied over its host's other ranks only: the first of those writes it."""
    first = {a: grid.coord(a) for a in AXES}
    for folded, host in FOLDED.items():
        if folded in placement.sharded:
            first[host] //= grid.size(folded)
    return placement.pipe_peer >= 0 and all(first[a] == 0 for a in AXES if a not in placement.sharded and a != "pipe")


def tensors_of(grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer):
    """(key, local tensor, placement, full shape) of the model's parameters, their AdamW state and
    the model's persistent buffers (whole on every rank unless placed); the step counter is a
    scalar, replicated (one full piece)."""
    for name, param in model.named_parameters():
        placement = param_placement(name, param)
        full = placement.full_shape(tuple(param.shape), grid)
        yield f"model/{name}", param.data, placement, full
        for slot in ADAMW_SLOTS:
            value = optimizer.state.get(param, {}).get(slot)
            if value is None:
                continue
            if slot == "step":               # (a weight tied across stages: written by the earlier one)
                yield f"optim/{name}/{slot}", value, replace(WHOLE, pipe_peer=placement.pipe_peer), ()
            else:
                yield f"optim/{name}/{slot}", value, placement, full
    for name, buffer in persistent_buffers(model):
        placement = placement_of(buffer) or WHOLE
        yield f"model/{name}", buffer, placement, placement.full_shape(tuple(buffer.shape), grid)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.AdamW) or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError(f"checkpoints hold AdamW state (without amsgrad); got {type(optimizer).__name__}")


def gather_all(value):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def checkpoint_folder(path: str | Path) -> Folder:
    """The checkpoint folder ``path`` (``RUN/checkpoints/step-<N>``) as its run's ``Folder`` reaches it:
    the run folder is the user's choice, ``checkpoints`` and the step below it are never links."""
    path = Path(path).absolute()
    if path.parent.name != FOLDER or step_of(path.name) is None:
        raise ValueError(f"{path} is not a checkpoint folder of a par4d run (RUN/{FOLDER}/step-<N>)")
    return Folder(path.parent.parent).sub(FOLDER, path.name)


def free_name(folder: Folder, base: str) -> str:
    """``base``, or ``base.1``, ``base.2``, ... : the first name not taken in ``folder``."""
    name, n = base, 0
    while folder.exists(name):
        n += 1
        name = f"{base}.{n}"
    return name



def latest(run_dir: Path) -> Path:
    """The folder the ``latest`` pointer names (not verified: see :func:`choose`)."""
    folder = Folder(run_dir).sub(FOLDER)
    pointer = folder.path(LATEST)
    if folder.kind(LATEST) != "file":
        raise ValueError(f"{pointer} is missing (or not a regular file)")
    try:
        name = folder.read_text(LATEST, limit=256).strip()
    except ValueError as error:
        raise ValueError(f"{pointer} is unreadable ({error})") from None
    if step_of(name) is None:
        raise ValueError(f"{pointer} holds {name[:40]!r}, not the name of a checkpoint (step-<N>)")
    return folder.path(name)
