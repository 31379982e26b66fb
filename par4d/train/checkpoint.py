"""Sharded checkpoints that load at any grid: safetensors files and JSON, no pickle.

A checkpoint is a folder ``checkpoints/step-<N>/``:

* ``rank-<r>.safetensors``: the pieces rank r owns: its shard of every parameter and of
  its AdamW state, unless another rank holds the same piece (a copy replicated over an
  axis is written once, by the replica at coordinate 0 of every axis it is copied over);
* ``index.json``: per tensor (``model/<name>``, ``optim/<name>/<slot>``), its full shape
  and dtype, and per piece the file, the key and the boxes (:class:`par4d.layout.Box`)
  that say where the piece lies in the full tensor;
* ``meta.json``: the run's settings, the step, the grid, every parameter's placement;
* ``manifest.json``, written last: every file's size and SHA-256.

Loading on any grid whose model has the same full shapes: each rank computes the boxes
of its own shards on its grid, intersects them with the saved boxes, and reads only the
overlapping slices (``safetensors``' lazy slices), so no rank reads the whole model. The
text file ``checkpoints/latest`` names the newest complete checkpoint and is replaced
atomically.

Why not ``torch.distributed.checkpoint``: its default reader unpickles its ``.metadata``
file (a crafted checkpoint runs code), and its resharding needs DTensor placements,
which cannot express par4d's chunked splits (a fused qkv shard is three rectangles of
the full weight) without torch's private strided sharding. Safetensors holds raw
tensors with a JSON header, which is also what ``transformers`` reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from par4d.grid import AXES, Grid
from par4d.layout import Box, Placement, boxes, fill, overlap, placement_of, slice_reader
from par4d.train.rank0 import on_rank0

FOLDER = "checkpoints"
ADAMW_SLOTS = ("step", "exp_avg", "exp_avg_sq")
FORMAT = "par4d-safetensors-1"


def _placement(name: str, param: torch.Tensor) -> Placement:
    placement = placement_of(param)
    if placement is None:
        raise ValueError(f"parameter {name!r} has no placement: par4d cannot tell how it is sharded")
    return placement


def placements(grid: Grid, model: nn.Module) -> dict[str, dict]:
    """Every parameter's full shape and placement, as ``meta.json`` records them."""
    out = {}
    for name, param in model.named_parameters():
        placement = _placement(name, param)
        out[name] = {"shape": list(placement.full_shape(tuple(param.shape), grid)), **placement.as_dict()}
    return out


def _coords(grid: Grid) -> dict[str, int]:
    return {a: grid.coord(a) for a in AXES}


def _owns(grid: Grid, placement: Placement) -> bool:
    """Whether this rank writes its piece: it is coordinate 0 of every axis the piece is copied
    over (pipe is not one: a parameter lives on one pipeline stage only)."""
    return all(grid.coord(a) == 0 for a in AXES if a not in placement.sharded and a != "pipe")


def _tensors(grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer):
    """(key, local tensor, placement, full shape) of the model's parameters and their AdamW state;
    the step counter is a scalar, replicated (one full piece)."""
    for name, param in model.named_parameters():
        placement = _placement(name, param)
        full = placement.full_shape(tuple(param.shape), grid)
        yield f"model/{name}", param.data, placement, full
        for slot in ADAMW_SLOTS:
            value = optimizer.state.get(param, {}).get(slot)
            if value is None:
                continue
            if slot == "step":
                yield f"optim/{name}/{slot}", value, Placement((), ()), ()
            else:
                yield f"optim/{name}/{slot}", value, placement, full


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.AdamW) or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError(f"checkpoints hold AdamW state (without amsgrad); got {type(optimizer).__name__}")


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flush a written file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _gather(value):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def save(run_dir: Path, step: int, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict, keep: int = 2) -> Path:
    """Collective: save model and optimizer shards of ``step``; returns its folder.

    Once it is complete: this and the ``keep - 1`` newest checkpoints of earlier steps stay (a
    corrupt latest one falls back to the one before it), older ones are deleted; folders of
    later steps (an interrupted save, or a timeline a resume left behind: none of them was
    intact when it resumed) are moved aside as ``abandoned-step-<N>``, never deleted. The
    complete checkpoint ``latest`` names is never rewritten: saving its step again (a
    restart after the final save) returns it as it is."""
    if keep < 1:
        raise ValueError(f"--keep must be >= 1, got {keep}")
    _check_optimizer(optimizer)
    folder = run_dir / FOLDER
    target = folder / f"step-{step:08d}"
    if _is_latest(run_dir, target):
        dist.barrier()
        return target

    def prepare():
        folder.mkdir(parents=True, exist_ok=True)
        if target.exists():  # an incomplete earlier attempt at this step: never the latest
            shutil.rmtree(target)
        target.mkdir()

    on_rank0(prepare)
    dist.barrier()
    file = f"rank-{grid.rank:05d}.safetensors"
    owned, records = {}, {}
    for key, tensor, placement, full in _tensors(grid, model, optimizer):
        if not _owns(grid, placement):
            continue
        owned[key] = tensor.detach().contiguous().cpu()
        pieces = boxes(placement, full, _coords(grid), grid.sizes)
        records[key] = {"shape": list(full), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "piece": {"file": file, "boxes": [b.as_list() for b in pieces]}}
    digest = None
    if owned:
        save_file(owned, str(target / file))
        _fsync(target / file)    # on disk before the manifest says it is complete and older checkpoints go
        digest = {"file": file, "bytes": (target / file).stat().st_size, "sha256": _sha256(target / file)}
    every = _gather((records, digest))
    layout = {name: record for stage in _gather(placements(grid, model)) for name, record in stage.items()}

    def commit():
        index: dict[str, dict] = {}
        for rank_records, _ in every:
            for key, record in rank_records.items():
                entry = index.setdefault(key, {"shape": record["shape"], "dtype": record["dtype"], "pieces": []})
                entry["pieces"].append(record["piece"])
        _fsync_write(target / "index.json", json.dumps({"format": FORMAT, "tensors": index}))
        _fsync_write(target / "meta.json", json.dumps(dict(meta, step=step, grid=grid.sizes, placements=layout),
                                                       indent=2))
        files = [d for _, d in every if d is not None]
        for name in ("index.json", "meta.json"):
            files.append({"file": name, "bytes": (target / name).stat().st_size, "sha256": _sha256(target / name)})
        _fsync_write(target / "manifest.json", json.dumps({"format": FORMAT, "files": files}, indent=1))
        _fsync(target)           # the folder's entries too
        _fsync_write(folder / "latest.tmp", target.name)
        os.replace(folder / "latest.tmp", folder / "latest")
        _fsync(folder)           # the new pointer is durable before older checkpoints are deleted
        for later in sorted(f for f in folder.glob("step-*") if f.name > target.name):
            later.rename(folder / f"abandoned-{later.name}")
        earlier = sorted((f for f in folder.glob("step-*") if f.name < target.name), reverse=True)
        for old in earlier[keep - 1:]:
            shutil.rmtree(old)

    on_rank0(commit)
    dist.barrier()     # no rank returns (and perhaps loads) before the checkpoint is complete
    return target


def _is_latest(run_dir: Path, target: Path) -> bool:
    """Whether ``target`` is the complete checkpoint the ``latest`` pointer names."""
    try:
        return latest(run_dir) == target and (target / "manifest.json").is_file()
    except ValueError:
        return False


def latest(run_dir: Path) -> Path:
    """The folder the ``latest`` pointer names (not verified: see :func:`choose`)."""
    pointer = run_dir / FOLDER / "latest"
    if not pointer.is_file():
        raise ValueError(f"--resume {run_dir}: no checkpoint there (expected {pointer})")
    return run_dir / FOLDER / pointer.read_text(errors="replace").strip()


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any checkpoint folder (intact or not: :func:`choose` tells)."""
    return bool(_candidates(run_dir))


def _candidates(run_dir: Path) -> list[Path]:
    """The checkpoint folders of a run, the one ``latest`` names first, then newest first."""
    folder = run_dir / FOLDER
    found = sorted(folder.glob("step-*"), reverse=True) if folder.is_dir() else []
    try:
        named = latest(run_dir)
    except ValueError:
        named = None
    if named is not None and named in found:
        found.remove(named)
        found.insert(0, named)
    return found


def verify(checkpoint_dir: Path) -> dict[str, dict]:
    """Check every file of a checkpoint against ``manifest.json`` (size and SHA-256); returns
    the manifest's records. Raises ``ValueError`` naming the first file that fails."""
    manifest_path = checkpoint_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{manifest_path} is missing (an interrupted save, or a checkpoint of par4d before "
                         f"2026-11-23, which used another format)")
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, this par4d reads {FORMAT!r}")
        files = {f["file"]: f for f in manifest["files"]}
        for required in ("index.json", "meta.json"):
            if required not in files:
                raise ValueError(f"it lists no {required}")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        raise ValueError(f"{manifest_path} is unreadable ({error})") from None
    for name, record in files.items():
        _check_size(checkpoint_dir / name, record)
        _check_sum(checkpoint_dir / name, record)
    return files


def _check_size(path: Path, record: dict) -> None:
    size = path.stat().st_size if path.is_file() else None
    if size != record["bytes"]:
        raise ValueError(f"checkpoint file {path} is missing or has the wrong size "
                         f"({size} bytes, manifest.json says {record['bytes']})")


def _check_sum(path: Path, record: dict) -> None:
    if _sha256(path) != record["sha256"]:
        raise ValueError(f"checkpoint file {path} does not match its SHA-256 in manifest.json (corrupt)")


def choose(run_dir: Path, report=None) -> Path:
    """The newest checkpoint of ``run_dir`` that verifies; each one skipped is reported
    (``report(line)``) with the file that failed. Raises if none is intact."""
    problems = []
    for candidate in _candidates(run_dir):
        try:
            verify(candidate)
        except ValueError as error:
            problems.append(str(error))
            if report is not None:
                report(f"checkpoint {candidate.name} is unusable: {error}; trying the one before it")
            continue
        return candidate
    if not problems:
        raise ValueError(f"--resume {run_dir}: no checkpoint there (expected {run_dir / FOLDER}/step-*)")
    raise ValueError(f"--resume {run_dir}: no intact checkpoint ({'; '.join(problems)})")


def read_meta(checkpoint_dir: Path) -> dict:
    return json.loads((checkpoint_dir / "meta.json").read_text())


def check_resumable(run_dir: Path, steps: int | None = None, report=None) -> tuple[Path, dict]:
    """(the checkpoint to resume from, its meta): the newest intact one of ``run_dir`` and,
    given ``steps``, only if the run still has steps to take. Any grid may resume it (the
    model's shapes must divide the new grid: the caller builds the model there first)."""
    folder = choose(run_dir, report)
    meta = read_meta(folder)
    if steps is not None and steps <= meta["step"]:
        raise ValueError(f"--resume {run_dir}: the checkpoint is at step {meta['step']}; "
                         f"pass --steps greater than that (got {steps})")
    return folder, meta


@torch.no_grad()
def load(run_dir: Path, grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer,
         folder: Path | None = None, verified: bool = False) -> dict:
    """Load a checkpoint of ``run_dir`` (``folder``, or else the newest intact one) into this
    grid's shards, whatever grid saved it; returns its meta. Each rank reads only the slices of
    the saved pieces that overlap its own shards.

    Each rank checks the SHA-256 of the index, the meta and every file it reads from, unless
    ``verified``: ``folder`` was chosen by :func:`choose` (which checked every file) in this
    job, as ``par4d train`` does once before its ranks start; then the sizes are checked only,
    and N ranks do not hash the same files N times over."""
    _check_optimizer(optimizer)
    if folder is None:
        folder, verified = choose(run_dir), True
    folder = Path(folder)
    check = _check_size if verified else _check_sum
    files = {f["file"]: f for f in json.loads((folder / "manifest.json").read_text())["files"]}
    for name in ("index.json", "meta.json"):
        check(folder / name, files[name])
    meta = read_meta(folder)
    index = json.loads((folder / "index.json").read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{folder / 'index.json'}: format {index.get('format')!r}, this par4d reads {FORMAT!r}")
    tensors = index["tensors"]
    for group in optimizer.param_groups:        # AdamW's state needs its tensors before they are filled
        for param in group["params"]:
            if not optimizer.state.get(param):
                optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
    readers: dict[str, object] = {}
    with contextlib.ExitStack() as opened:

        def reader_of(name: str):   # opened, and checked against the manifest, on first use
            if name not in readers:
                check(folder / name, files[name])
                readers[name] = opened.enter_context(safe_open(str(folder / name), "pt"))
            return readers[name]

        for key, tensor, placement, full in _tensors(grid, model, optimizer):
            record = tensors.get(key)
            if record is None:
                raise ValueError(f"checkpoint {folder} has no {key!r}")
            if tuple(record["shape"]) != tuple(full):
                raise ValueError(f"checkpoint {folder}: {key} has full shape {tuple(record['shape'])}, this model "
                                 f"{tuple(full)} (phantom layers' shapes depend on the grid's x)")
            for piece in record["pieces"]:
                if piece["file"] not in files:
                    raise ValueError(f"checkpoint {folder}: {piece['file']} is not in manifest.json")
            for wanted in boxes(placement, full, _coords(grid), grid.sizes):
                for piece in record["pieces"]:
                    for saved in map(Box.from_list, piece["boxes"]):
                        if overlap(saved, wanted) is not None:
                            fill(tensor, wanted, saved, slice_reader(reader_of(piece["file"]), key))
    return meta
