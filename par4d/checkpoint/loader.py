"""Loading a checkpoint into any grid's shards: each rank reads only the slices of the saved pieces that
overlap its own (docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from par4d.checkpoint.format import DTYPES, ENTRY_FILES, check_optimizer, checkpoint_folder, tensors_of
from par4d.checkpoint.verifier import Checkpoint, check_file, check_open, choose_checkpoint, open_piece, verify
from par4d.folder import FolderError, fd_path
from par4d.grid import Grid
from par4d.layout import Box, boxes, fill, overlap, slice_reader


class _Pieces:
    """The saved pieces of a checkpoint, opened (and checked) on first use; ``fill`` copies the
    part of tensor ``key`` that a box of one's own holds."""

    def __init__(self, checkpoint: Checkpoint, hashed: bool, opened: contextlib.ExitStack):
        self.checkpoint, self.hashed, self.opened = checkpoint, hashed, opened
        self.readers: dict[str, object] = {}
        self.keys: dict[str, set[str]] = {}     # each file's tensor names, read once

    def _reader(self, name: str):
        if name not in self.readers:
            folder = self.checkpoint.folder
            try:
                fd = open_piece(folder, name)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                self.opened.callback(os.close, fd)
            # The file checked is the file read: one descriptor, hashed, then opened by the library.
            check_open(fd, folder.path(name), self.checkpoint.files[name], self.hashed)
            try:
                self.readers[name] = self.opened.enter_context(safe_open(fd_path(fd, folder.path(name)), "pt"))
                self.keys[name] = set(self.readers[name].keys())
            except (SafetensorError, OSError, FolderError) as error:
                raise ValueError(f"checkpoint file {folder.path(name)} is not a readable safetensors file "
                                 f"({error})") from None
        return self.readers[name]

    def _check_piece(self, name: str, key: str, record: dict, piece: list[Box]) -> None:
        reader, where = self._reader(name), self.checkpoint.folder.path(name)
        if key not in self.keys[name]:
            raise ValueError(f"checkpoint file {where} has no tensor {key!r}, which index.json puts there")
        found = reader.get_slice(key)
        shape, dtype = tuple(found.get_shape()), found.get_dtype()
        if dtype != DTYPES[record["dtype"]]:
            raise ValueError(f"checkpoint file {where}: {key} has dtype {dtype}, index.json says {record['dtype']}")
        for box in piece:
            kept = [(start, length) for (_, length), start in zip(box.full, box.local) if start is not None]
            if len(kept) != len(shape) or any(s + n > m for (s, n), m in zip(kept, shape)):
                raise ValueError(f"checkpoint file {where}: {key} has shape {shape}, too small for the piece "
                                 f"index.json describes")

    def fill(self, key: str, tensor: torch.Tensor, wanted: list[Box]) -> None:
        record = self.checkpoint.tensors[key]
        for piece in record["pieces"]:
            saved = [Box.from_list(b) for b in piece["boxes"]]
            meeting = [(s, w) for s in saved for w in wanted if overlap(s, w) is not None]
            if not meeting:
                continue
            self._check_piece(piece["file"], key, record, saved)
            read = slice_reader(self._reader(piece["file"]), key)
            for s, w in meeting:
                fill(tensor, w, s, read)


@contextlib.contextmanager
def pieces(checkpoint: Checkpoint, hashed: bool = True) -> Iterator[_Pieces]:
    """The pieces of ``checkpoint`` to read tensors from (``hashed``: each file's SHA-256 is checked
    when it is first opened)."""
    with contextlib.ExitStack() as opened:
        yield _Pieces(checkpoint, hashed, opened)


def full_shape_problem(checkpoint: Checkpoint, key: str, full: tuple[int, ...], phantom: bool = False) -> str | None:
    """Why ``checkpoint`` cannot give tensor ``key`` of shape ``full`` (missing, or saved at another shape), or None."""
    record = checkpoint.tensors.get(key)
    if record is None:
        return f"checkpoint {checkpoint.path} has no {key!r}"
    if tuple(record["shape"]) != tuple(full):
        why = " (phantom layers' shapes depend on the grid's x)" if phantom else ""
        return (f"checkpoint {checkpoint.path}: {key} has full shape {tuple(record['shape'])}, "
                f"this model {tuple(full)}{why}")
    return None


@torch.no_grad()
def load(run_dir: Path, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer,
         folder: Path | None = None, verified: bool = False) -> dict:
    """Load a checkpoint of ``run_dir`` (``folder``, or else the newest intact one) into this
    grid's shards, whatever grid saved it; returns its meta. Each rank reads only the slices of
    the saved pieces that overlap its own shards.

    Each rank checks the SHA-256 of every file it reads from, unless ``verified``: ``folder`` was
    chosen by :func:`choose` (which checked every file) in this job, as ``par4d train`` does once
    before its ranks start; then the sizes are checked only, and N ranks do not hash the same
    files N times over. The index and meta are checked in full either way."""
    check_optimizer(optimizer)
    if folder is None:
        chosen, hashed = choose_checkpoint(run_dir), False
    else:
        chosen, hashed = verify(checkpoint_folder(folder), hashed=False, cover=not verified), not verified
        for name in ENTRY_FILES if hashed else ():
            check_file(chosen.folder, name, chosen.files[name], hashed=True)
    phantom = getattr(getattr(model, "config", None), "mlp", None) == "phantom"
    for group in optimizer.param_groups:        # AdamW's state needs its tensors before they are filled
        for param in group["params"]:
            if not optimizer.state.get(param):
                # fused (and capturable) AdamW keeps its step count on the parameter's device, else on the CPU
                on_device = group.get("fused") or group.get("capturable")
                step = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
                optimizer.state[param] = {"step": step, "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
    wanted = list(tensors_of(grid, model, optimizer))
    for key, _, _, full in wanted:              # every shape first: nothing is filled from a wrong checkpoint
        problem = full_shape_problem(chosen, key, full, phantom)
        if problem:
            raise ValueError(problem)
    with pieces(chosen, hashed) as saved:
        for key, tensor, placement, full in wanted:
            saved.fill(key, tensor, boxes(placement, full, grid.coords(), grid.sizes))
    return chosen.meta
