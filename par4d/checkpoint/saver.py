"""Saving a checkpoint: every rank its pieces, rank 0 the index, meta and manifest last, then the
``latest`` pointer and the rotation (docs/checkpoints.md)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import save_file

from par4d.checkpoint.format import (
    FOLDER,
    FORMAT,
    LATEST,
    check_optimizer,
    free_name,
    gather_all,
    latest,
    owns,
    placements,
    step_name,
    step_names,
    tensors_of,
)
from par4d.folder import Folder, fd_sha256
from par4d.grid import Grid
from par4d.layout import boxes
from par4d.rank0 import on_rank0


def save(run_dir: Path, step: int, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict, keep: int = 2) -> Path:
    """Collective: save model and optimizer shards of ``step``; returns its folder.

    Once it is complete: this and the ``keep - 1`` newest checkpoints of earlier steps stay (a
    corrupt latest one falls back to the one before it), older ones are deleted; folders of
    later steps (an interrupted save, or a timeline a resume left behind) and an incomplete
    earlier attempt at this step are moved aside as ``abandoned-step-<N>``, never deleted. The
    complete checkpoint ``latest`` names is never rewritten: saving its step again (a restart
    after the final save) returns it as it is."""
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least 1 checkpoint")
    check_optimizer(optimizer)
    run, name = Folder(run_dir), step_name(step)
    folder = run.sub(FOLDER)
    target = folder.sub(name)
    if _is_latest(run_dir, name):
        dist.barrier()
        return target.path()

    def prepare():
        run.mkdir(FOLDER)
        if folder.exists(name):   # an earlier attempt at this step, never complete (else it were the latest)
            folder.rename((name,), free_name(folder, f"abandoned-{name}"))
        folder.mkdir(name, exist_ok=False)

    on_rank0(lambda: _naming_the_file(prepare, step))
    dist.barrier()
    file = f"rank-{grid.rank:05d}.safetensors"
    owned, records = {}, {}
    for key, tensor, placement, full in tensors_of(grid, model, optimizer):
        if not owns(grid, placement):
            continue
        owned[key] = tensor.detach().contiguous().cpu()
        pieces = boxes(placement, full, grid.coords(), grid.sizes)
        records[key] = {"shape": list(full), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "piece": {"file": file, "boxes": [b.as_list() for b in pieces]}}
    digest, failed = None, None
    if owned:
        try:
            target.write_file(file, write=lambda path: save_file(owned, path))   # on disk before the manifest
            fd = target.open_fd(file)
            try:
                digest = {"file": file, "bytes": os.fstat(fd).st_size, "sha256": fd_sha256(fd)}
            finally:
                os.close(fd)
        except (SafetensorError, OSError) as error:   # disk full, quota: the earlier checkpoints are intact
            why = getattr(error, "strerror", None) or error
            failed = (f"cannot write checkpoint file {target.path(file)} ({why}); the checkpoints before step "
                      f"{step} are intact: make room and --resume")
    every = gather_all((records, digest, failed))    # a rank that could not write: every rank says so, none waits
    failures = [f for _, _, f in every if f is not None]
    if failures:
        raise OSError(failures[0])
    layout = {key: record for stage in gather_all(placements(grid, model)) for key, record in stage.items()}

    def commit():
        index: dict[str, dict] = {}
        for rank_records, _, _ in every:
            for key, record in rank_records.items():
                entry = index.setdefault(key, {"shape": record["shape"], "dtype": record["dtype"], "pieces": []})
                entry["pieces"].append(record["piece"])
        entries = {"index.json": json.dumps({"format": FORMAT, "tensors": index}),
                   "meta.json": json.dumps(dict(meta, step=step, grid=grid.sizes, placements=layout), indent=2)}
        files = [d for _, d, _ in every if d is not None]
        for entry, text in entries.items():     # their records from the bytes written, not read back
            data = text.encode()
            target.write_bytes(entry, data=data)
            files.append({"file": entry, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        target.write_text("manifest.json", text=json.dumps({"format": FORMAT, "files": files}, indent=1))
        # The folder's entries and the new pointer are durable (write_text syncs both) before older
        # checkpoints are deleted.
        folder.write_text(LATEST, text=name)
        steps = _steps(folder)
        for later in sorted(s for s in steps if s > step):
            folder.rename((steps[later],), free_name(folder, f"abandoned-{steps[later]}"))
        for old in sorted((s for s in steps if s < step), reverse=True)[keep - 1:]:
            folder.remove_tree(steps[old])

    on_rank0(lambda: _naming_the_file(commit, step))
    dist.barrier()     # no rank returns (and perhaps loads) before the checkpoint is complete
    return target.path()


def _naming_the_file(work: Callable[[], None], step: int) -> None:
    """Rank 0's part of a save; a full disk or a quota says which file, and that nothing saved is lost."""
    try:
        work()
    except OSError as error:
        raise OSError(f"cannot write {error.filename or 'the checkpoint'} ({error.strerror or error}); the "
                      f"checkpoints before step {step} are intact: make room and --resume") from None


def _steps(folder: Folder) -> dict[int, str]:
    """Step -> name of the real checkpoint folders (``step-<N>``) in ``folder`` (links left out)."""
    return {step: name for step, name in step_names(folder).items() if folder.kind(name) == "folder"}


def _is_latest(run_dir: Path, name: str) -> bool:
    """Whether ``name`` is the complete checkpoint the ``latest`` pointer names."""
    try:
        return latest(run_dir).name == name and Folder(run_dir).kind(FOLDER, name, "manifest.json") == "file"
    except ValueError:
        return False


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any checkpoint folder (intact or not: :func:`choose` tells)."""
    folder = Folder(run_dir).sub(FOLDER)
    return folder.kind() == "folder" and bool(step_names(folder))
