"""Sharded checkpoints that load at any grid: safetensors files and JSON, no pickle.

The room's modules: :mod:`~par4d.checkpoint.format` (names, the tensors a model and its AdamW hold,
which rank writes which piece), :mod:`~par4d.checkpoint.saver`, :mod:`~par4d.checkpoint.verifier` and
:mod:`~par4d.checkpoint.loader`. :func:`save_checkpoint` and :func:`load_checkpoint` are the public calls.

A checkpoint is a folder ``checkpoints/step-<N>/``:

* ``rank-<r>.safetensors``: the pieces rank r owns: its shard of every parameter, of its
  AdamW state and of every persistent buffer (batch norms' running statistics), unless
  another rank holds the same piece (a copy replicated over an axis is written once, by
  the replica at coordinate 0 of every axis it is copied over);
* ``index.json``: per tensor (``model/<name>``, ``optim/<name>/<slot>``), its full shape
  and dtype, and per piece the file, the key and the boxes (:class:`par4d.layout.Box`)
  that say where the piece lies in the full tensor;
* ``meta.json``: the run's settings, the step, the grid, every parameter's placement;
* ``manifest.json``, written last: every file's size and SHA-256.

Loading on any grid whose model has the same full shapes: each rank computes the boxes
of its own shards on its grid, intersects them with the saved boxes, and reads only the
overlapping slices (``safetensors``' lazy slices), so no rank reads the whole model. The
text file ``checkpoints/latest`` names the newest complete checkpoint and is replaced
atomically; it is a hint for people and tools: a resume takes the newest checkpoint that
verifies, whatever ``latest`` says.

A checkpoint is verified before use (:func:`verify`): every file the manifest lists has its
size and SHA-256; every name is a plain file inside the checkpoint folder (read through
:class:`par4d.folder.Folder`: never a link, ``..`` or an absolute path); the files the
index's pieces use are exactly the manifest's; and each tensor's boxes cover every element
of it exactly once. Nothing verified is ever deleted but by rotation after a newer one is
complete; a checkpoint that fails is renamed ``corrupt-step-<N>`` when a run resumes past
it, never deleted.

Why not ``torch.distributed.checkpoint``: its default reader unpickles its ``.metadata``
file (a crafted checkpoint runs code), and its resharding needs DTensor placements,
which cannot express par4d's chunked splits (a fused qkv shard is three rectangles of
the full weight) without torch's private strided sharding. Safetensors holds raw
tensors with a JSON header, which is also what ``transformers`` reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from par4d.checkpoint.format import CORRUPT, FOLDER, WHOLE, checkpoint_folder, latest, placements, step_name, step_of
from par4d.checkpoint.loader import full_shape_problem, load, pieces
from par4d.checkpoint.saver import has_checkpoint, save
from par4d.checkpoint.verifier import Checkpoint, choose, choose_checkpoint, read_meta, set_aside_newer, verify
from par4d.folder import is_count
from par4d.grid import Grid
from par4d.optim.precision import Precision
from par4d.rank0 import on_rank0

__all__ = ["CORRUPT", "FOLDER", "WHOLE", "Checkpoint", "checkpoint_folder", "choose",
           "choose_checkpoint", "full_shape_problem", "has_checkpoint", "latest", "load",
           "load_checkpoint", "pieces", "placements", "read_meta", "save", "save_checkpoint", "set_aside_newer",
           "step_name", "step_of", "verify"]


def _stepped(model: nn.Module, optimizer: torch.optim.Optimizer | Precision
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(what is saved, the optimizer whose state is saved): a precision policy's fp32 masters and their
    optimizer, else the model and the optimizer themselves."""
    if isinstance(optimizer, Precision):
        if optimizer.model is not model:
            raise ValueError(f"the precision policy steps another model than the {type(model).__name__} given: "
                             f"pass the model it was made for")
        return optimizer.masters, optimizer.optimizer
    return model, optimizer


def save_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | Precision,
                    grid: Grid, *, step: int, keep: int = 2, meta: dict | None = None) -> Path:
    """Collective: save this rank's shards of ``model`` and of its AdamW state (``optimizer``: an AdamW over
    its parameters, or a precision policy, whose fp32 masters are saved) as ``folder/checkpoints/step-<N>``;
    returns that folder. The ``keep`` newest checkpoints stay, older ones are deleted once this one is
    complete. ``meta``: JSON-able settings saved beside it (:func:`load_checkpoint` returns them)."""
    if not is_count(step):
        raise ValueError(f"save_checkpoint(step={step!r}): give the step count, an integer >= 0")
    saved, state = _stepped(model, optimizer)
    return save(Path(folder), step, grid, saved, state, dict(meta or {}), keep)


def load_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | Precision,
                    grid: Grid, *, step: int | None = None) -> dict:
    """Collective: fill ``model``'s shards and ``optimizer``'s state on this ``grid`` from the newest intact
    checkpoint of ``folder`` (or that of ``step``), whatever grid saved it (each rank reads only the slices
    it holds; every file it reads is checked against the manifest's SHA-256). Returns the checkpoint's meta:
    ``step``, ``grid`` (the grid that saved it) and what :func:`save_checkpoint` was given."""
    saved, state = _stepped(model, optimizer)
    chosen = Path(folder) / FOLDER / step_name(step) if step is not None else None
    if chosen is None:      # rank 0 verifies every file of the newest intact one; the others check sizes only
        box = [on_rank0(lambda: str(choose(Path(folder))))]
        dist.broadcast_object_list(box, src=0)
        chosen = Path(box[0])
    meta = load(Path(folder), grid, saved, state, chosen, verified=step is None)
    if isinstance(optimizer, Precision):
        optimizer.load_masters()       # the model's (rounded) parameters from the fp32 masters
    return meta
