"""Sharded checkpoints that load at any grid: safetensors files and JSON, no pickle.

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

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from par4d.folder import Folder, FolderError, fd_path, fd_sha256
from par4d.grid import AXES, Grid
from par4d.layout import Box, Placement, boxes, fill, overlap, placement_of, slice_reader
from par4d.train.config import ABSURD_BYTES, is_count
from par4d.train.rank0 import on_rank0

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


def _step_names(folder: Folder) -> dict[int, str]:
    """Step -> name of every entry of ``folder`` named as a checkpoint (``step-<N>``), whatever it is."""
    return {step: name for name in folder.names() if (step := step_of(name)) is not None}


def step_name(step: int) -> str:
    return f"step-{step:08d}"


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


def _buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent buffers a ``state_dict`` holds (batch norms' running statistics), by name. Mixed
    precision's masters (:class:`par4d.optim.precision.Masters`) hold parameters only: none there."""
    for prefix, module in model.named_modules() if isinstance(model, nn.Module) else ():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def _coords(grid: Grid) -> dict[str, int]:
    return {a: grid.coord(a) for a in AXES}


def _owns(grid: Grid, placement: Placement) -> bool:
    """Whether this rank writes its piece: it is coordinate 0 of every axis the piece is copied
    over (pipe is not one: a parameter lives on one pipeline stage, but for a weight tied across
    stages, which the earlier stage's copy writes)."""
    return placement.pipe_peer >= 0 and all(grid.coord(a) == 0 for a in AXES
                                            if a not in placement.sharded and a != "pipe")


def _tensors(grid: Grid, model: nn.Module, optimizer: torch.optim.Optimizer):
    """(key, local tensor, placement, full shape) of the model's parameters, their AdamW state and
    the model's persistent buffers (whole on every rank unless placed); the step counter is a
    scalar, replicated (one full piece)."""
    for name, param in model.named_parameters():
        placement = _placement(name, param)
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
    for name, buffer in _buffers(model):
        placement = placement_of(buffer) or WHOLE
        yield f"model/{name}", buffer, placement, placement.full_shape(tuple(buffer.shape), grid)


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.AdamW) or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError(f"checkpoints hold AdamW state (without amsgrad); got {type(optimizer).__name__}")


def _gather(value):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


# -- saving ---------------------------------------------------------------------------

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
        raise ValueError(f"--keep must be >= 1, got {keep}")
    _check_optimizer(optimizer)
    run, name = Folder(run_dir), step_name(step)
    folder = run.sub(FOLDER)
    target = folder.sub(name)
    if _is_latest(run_dir, name):
        dist.barrier()
        return target.path()

    def prepare():
        run.mkdir(FOLDER)
        if folder.exists(name):   # an earlier attempt at this step, never complete (else it were the latest)
            folder.rename((name,), _free_name(folder, f"abandoned-{name}"))
        folder.mkdir(name, exist_ok=False)

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
        try:
            target.write_file(file, write=lambda path: save_file(owned, path))   # on disk before the manifest
        except (SafetensorError, OSError) as error:   # disk full, quota: the earlier checkpoints are intact
            raise OSError(f"cannot write checkpoint file {target.path(file)} ({error}); the checkpoints before "
                          f"step {step} are intact: make room and --resume") from None
        fd = target.open_fd(file)
        try:
            digest = {"file": file, "bytes": os.fstat(fd).st_size, "sha256": fd_sha256(fd)}
        finally:
            os.close(fd)
    every = _gather((records, digest))
    layout = {key: record for stage in _gather(placements(grid, model)) for key, record in stage.items()}

    def commit():
        index: dict[str, dict] = {}
        for rank_records, _ in every:
            for key, record in rank_records.items():
                entry = index.setdefault(key, {"shape": record["shape"], "dtype": record["dtype"], "pieces": []})
                entry["pieces"].append(record["piece"])
        entries = {"index.json": json.dumps({"format": FORMAT, "tensors": index}),
                   "meta.json": json.dumps(dict(meta, step=step, grid=grid.sizes, placements=layout), indent=2)}
        files = [d for _, d in every if d is not None]
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
            folder.rename((steps[later],), _free_name(folder, f"abandoned-{steps[later]}"))
        for old in sorted((s for s in steps if s < step), reverse=True)[keep - 1:]:
            folder.remove_tree(steps[old])

    on_rank0(commit)
    dist.barrier()     # no rank returns (and perhaps loads) before the checkpoint is complete
    return target.path()


def _free_name(folder: Folder, base: str) -> str:
    """``base``, or ``base.1``, ``base.2``, ... : the first name not taken in ``folder``."""
    name, n = base, 0
    while folder.exists(name):
        n += 1
        name = f"{base}.{n}"
    return name


def _steps(folder: Folder) -> dict[int, str]:
    """Step -> name of the real checkpoint folders (``step-<N>``) in ``folder`` (links left out)."""
    return {step: name for step, name in _step_names(folder).items() if folder.kind(name) == "folder"}


def _is_latest(run_dir: Path, name: str) -> bool:
    """Whether ``name`` is the complete checkpoint the ``latest`` pointer names."""
    try:
        return latest(run_dir).name == name and Folder(run_dir).kind(FOLDER, name, "manifest.json") == "file"
    except ValueError:
        return False


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


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any checkpoint folder (intact or not: :func:`choose` tells)."""
    folder = Folder(run_dir).sub(FOLDER)
    return folder.kind() == "folder" and bool(_step_names(folder))


# -- verifying --------------------------------------------------------------------------

@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder whose manifest, index and meta have been read and checked."""

    folder: Folder
    meta: dict
    tensors: dict[str, dict]      # index.json's: key -> {"shape", "dtype", "pieces"}
    files: dict[str, dict]        # manifest.json's: file -> {"bytes", "sha256"}

    @property
    def path(self) -> Path:
        return self.folder.path()

    @property
    def step(self) -> int:
        return self.meta["step"]


def _manifest(folder: Folder) -> dict[str, dict]:
    path = folder.path("manifest.json")
    if folder.kind("manifest.json") is None:
        raise ValueError(f"{path} is missing (an interrupted save, or a checkpoint of par4d before "
                         f"2026-11-23, which used another format)")
    manifest = folder.read_json("manifest.json")
    problem = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        problem = (f"format {manifest.get('format')!r}, this par4d reads {FORMAT!r}" if isinstance(manifest, dict)
                   else "not a JSON object")
    elif not isinstance(manifest.get("files"), list):
        problem = "no list of files"
    if problem:
        raise ValueError(f"{path} is unreadable ({problem})")
    files = {}
    for record in manifest["files"]:
        ok = (isinstance(record, dict) and isinstance(record.get("file"), str) and is_count(record.get("bytes"))
              and isinstance(record.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", record["sha256"]))
        if not ok:
            raise ValueError(f"{path}: a malformed record {json.dumps(record)[:120]}")
        name = record["file"]
        if not (name in ENTRY_FILES or re.fullmatch(r"rank-\d{5,}\.safetensors", name)):
            raise ValueError(f"{path} lists {name[:80]!r}, not a file of a checkpoint (index.json, meta.json, "
                             f"rank-<r>.safetensors): par4d reads only those, inside {folder.path()}")
        if name in files:
            raise ValueError(f"{path} lists {name} twice")
        files[name] = record
    for required in ENTRY_FILES:
        if required not in files:
            raise ValueError(f"{path} is unreadable (it lists no {required})")
    return files


def _check_file(folder: Folder, name: str, record: dict, hashed: bool) -> None:
    """``name``'s size (and, ``hashed``, SHA-256) against its manifest record; raises naming the file."""
    try:
        fd = _open_piece(folder, name)
    except FileNotFoundError:
        fd = None
    try:
        _check_open(fd, folder.path(name), record, hashed)
    finally:
        if fd is not None:
            os.close(fd)


def _open_piece(folder: Folder, name: str) -> int:
    try:
        return folder.open_fd(name)
    except FileNotFoundError:
        raise
    except (OSError, FolderError) as error:
        raise ValueError(f"checkpoint file {folder.path(name)} is unreadable ({error})") from None


def _check_open(fd: int | None, path: Path, record: dict, hashed: bool) -> None:
    """The file open as ``fd`` (None: missing) against its manifest record: its size from the descriptor
    first (a file of the wrong size is never hashed), then, ``hashed``, its SHA-256 through that descriptor."""
    try:
        size = None if fd is None else os.fstat(fd).st_size
        if size == record["bytes"] and hashed:
            digest = fd_sha256(fd)
    except OSError as error:
        raise ValueError(f"checkpoint file {path} is unreadable ({error})") from None
    if size != record["bytes"]:
        raise ValueError(f"checkpoint file {path} is missing or has the wrong size "
                         f"({size} bytes, manifest.json says {record['bytes']})")
    if hashed and digest != record["sha256"]:
        raise ValueError(f"checkpoint file {path} does not match its SHA-256 in manifest.json (corrupt)")


def _box(record: object, shape: list[int]) -> Box | None:
    """The box ``record`` (``[[[start, length], ...], [local start or null, ...]]``) if it is one
    inside a tensor of ``shape``, else None."""
    if not (isinstance(record, list) and len(record) == 2 and all(isinstance(r, list) for r in record)):
        return None
    full, local = record
    if len(full) != len(shape) or len(local) != len(shape):
        return None
    for extent, start, size in zip(full, local, shape):
        if not (isinstance(extent, list) and len(extent) == 2 and is_count(extent[0]) and is_count(extent[1], 1)
                and extent[0] + extent[1] <= size and (start is None or is_count(start))):
            return None
        if start is None and extent[1] != 1:
            return None
    return Box.from_list(record)


def _check_cover(key: str, shape: tuple[int, ...], found: list[Box], where: Path) -> None:
    """Every element of the tensor covered by exactly one box: the volumes add up to its size and
    no two boxes meet (boxes sorted by their start in dim 0, each compared with those that start
    before it ends there)."""
    volume = sum(math.prod(length for _, length in b.full) for b in found)
    if volume != math.prod(shape):
        raise ValueError(f"{where}: the pieces of {key} hold {volume:,} elements, the tensor {tuple(shape)} has "
                         f"{math.prod(shape):,} (each element must be saved exactly once)")
    if not shape:
        return
    ordered = sorted(found, key=lambda b: b.full[0][0])
    for i, a in enumerate(ordered):
        end = a.full[0][0] + a.full[0][1]
        for b in ordered[i + 1:]:
            if b.full[0][0] >= end:
                break
            if all(max(sa, sb) < min(sa + la, sb + lb) for (sa, la), (sb, lb) in zip(a.full, b.full)):
                raise ValueError(f"{where}: two pieces of {key} overlap (at {[s for s, _ in a.full]} and "
                                 f"{[s for s, _ in b.full]}); each element must be saved exactly once")


def _index(folder: Folder, files: dict[str, dict], cover: bool = True) -> dict[str, dict]:
    """index.json's tensors, checked: shapes, dtypes, pieces in files of the manifest whose boxes
    lie inside their tensor and (``cover``) cover it exactly once; the manifest lists no file the index
    leaves unused."""
    path = folder.path("index.json")
    index = folder.read_json("index.json")
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("tensors"), dict):
        found = index.get("format") if isinstance(index, dict) else None
        raise ValueError(f"{path}: format {found!r}, this par4d reads {FORMAT!r} (a JSON object with its tensors)")
    used = set()
    for key, record in index["tensors"].items():
        if not (isinstance(record, dict) and isinstance(record.get("shape"), list)
                and all(is_count(n) for n in record["shape"]) and record.get("dtype") in DTYPES
                and isinstance(record.get("pieces"), list)):
            raise ValueError(f"{path}: {key[:80]} is malformed (shape, dtype or pieces)")
        shape, found = record["shape"], []
        if math.prod(shape) > ABSURD_BYTES:
            raise ValueError(f"{path}: {key[:80]} has shape {shape}, larger than any tensor par4d saves")
        for piece in record["pieces"]:
            if not (isinstance(piece, dict) and isinstance(piece.get("boxes"), list)):
                raise ValueError(f"{path}: a piece of {key[:80]} is malformed")
            name = piece.get("file")
            if name not in files or name in ENTRY_FILES:
                raise ValueError(f"{path}: a piece of {key[:80]} is in {str(name)[:80]!r}, which manifest.json does "
                                 f"not list (a checkpoint reads only the files its manifest vouches for)")
            used.add(name)
            for box in piece["boxes"]:
                checked = _box(box, shape)
                if checked is None:
                    raise ValueError(f"{path}: a piece of {key[:80]} has a box {json.dumps(box)[:80]} outside its "
                                     f"tensor {shape}")
                found.append(checked)
        if cover:
            _check_cover(key, tuple(shape), found, path)
    unused = sorted(set(files) - set(ENTRY_FILES) - used)
    if unused:
        raise ValueError(f"{path}: manifest.json lists {', '.join(unused[:3])}, which no piece of the index uses")
    return index["tensors"]


def _meta(folder: Folder) -> dict:
    """meta.json, checked where par4d reads it: the step, the grid, and the objects it keeps."""
    path = folder.path("meta.json")
    meta = folder.read_json("meta.json")
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a JSON {type(meta).__name__}, not an object")
    if not is_count(meta.get("step")):
        raise ValueError(f"{path}: step is {json.dumps(meta.get('step'))[:40]}, not a count of steps")
    grid = meta.get("grid")
    if not (isinstance(grid, dict) and set(grid) <= set(AXES) and all(is_count(v, 1) for v in grid.values())):
        raise ValueError(f"{path}: grid is {json.dumps(grid)[:80]}, not axis sizes >= 1 of {', '.join(AXES)}")
    for key in ("train_config", "model_config", "placements"):
        if key in meta and not isinstance(meta[key], dict):
            raise ValueError(f"{path}: {key} is {json.dumps(meta[key])[:40]}, not an object")
    return meta


def verify(source: Path | Folder, hashed: bool = True, cover: bool = True) -> Checkpoint:
    """Check a checkpoint folder: every file the manifest lists has its size and (``hashed``) its
    SHA-256, and the index and meta are well formed (names inside the folder, the manifest's files
    exactly the index's, and, ``cover``, every tensor covered exactly once: a checkpoint verified in
    full once need not be swept again by every rank that loads it). Raises ``ValueError`` naming the
    first file that fails."""
    try:
        folder = source if isinstance(source, Folder) else checkpoint_folder(source)
        files = _manifest(folder)
        for name, record in files.items():
            _check_file(folder, name, record, hashed)
        tensors, meta = _index(folder, files, cover), _meta(folder)
    except FolderError as error:
        raise ValueError(str(error)) from None
    except OSError as error:
        raise ValueError(f"checkpoint {folder.path()} is unreadable ({error})") from None
    return Checkpoint(folder, meta, tensors, files)


def choose_checkpoint(run_dir: Path, report: Callable[[str], None] | None = None) -> Checkpoint:
    """The newest checkpoint of ``run_dir`` that verifies (by step, whatever ``latest`` says); each
    one skipped is reported (``report(line)``) with the file that failed. Raises if none is intact."""
    folder = Folder(run_dir).sub(FOLDER)
    problems = []
    for _, name in sorted(_step_names(folder).items(), reverse=True):
        kind = folder.kind(name)
        try:
            if kind != "folder":
                raise ValueError(f"{folder.path(name)} is {'a symbolic link' if kind == 'link' else 'not a folder'}")
            chosen = verify(folder.sub(name))
        except ValueError as error:
            problems.append(str(error))
            if report is not None:
                report(f"checkpoint {name} is unusable: {error}; trying the one before it")
            continue
        if report is not None:
            _report_pointer(run_dir, name, report)
        return chosen
    if not problems:
        raise ValueError(f"--resume {run_dir}: no checkpoint there (expected {folder.path()}/step-*)")
    raise ValueError(f"--resume {run_dir}: no intact checkpoint ({'; '.join(problems)})")


def _report_pointer(run_dir: Path, chosen: str, report: Callable[[str], None]) -> None:
    try:
        named = latest(run_dir).name
    except ValueError as error:
        report(f"{error}; the newest intact checkpoint is {chosen}")
        return
    if step_of(named) < step_of(chosen):      # latest() returns only a checkpoint's name
        report(f"{FOLDER}/{LATEST} names {named}, but {chosen} is newer and intact: resuming from {chosen}")


def choose(run_dir: Path, report: Callable[[str], None] | None = None) -> Path:
    """The folder of :func:`choose_checkpoint`."""
    return choose_checkpoint(run_dir, report).path


def read_meta(checkpoint_dir: Path) -> dict:
    """The checked meta.json of a checkpoint folder (not verified against its manifest)."""
    try:
        return _meta(checkpoint_folder(checkpoint_dir))
    except FolderError as error:
        raise ValueError(str(error)) from None


def set_aside_newer(run_dir: Path, chosen: Path, report: Callable[[str], None] | None = None) -> None:
    """Before a run resumes from ``chosen``: every checkpoint of a later step (none verified, or it
    were chosen) is renamed ``corrupt-step-<N>``, never deleted nor overwritten, and ``latest`` names
    ``chosen``. Saves and rotation then never take an unusable checkpoint for the newest one."""
    folder, chosen_step = Folder(run_dir).sub(FOLDER), step_of(chosen.name)
    for step, name in _step_names(folder).items():
        if step > chosen_step:
            aside = _free_name(folder, CORRUPT + name)
            folder.rename((name,), aside)
            if report is not None:
                report(f"set aside {name} (unusable) as {FOLDER}/{aside}")
    folder.write_text(LATEST, text=chosen.name)


# -- loading --------------------------------------------------------------------------

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
                fd = _open_piece(folder, name)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                self.opened.callback(os.close, fd)
            # The file checked is the file read: one descriptor, hashed, then opened by the library.
            _check_open(fd, folder.path(name), self.checkpoint.files[name], self.hashed)
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


def checkpoint_folder(path: str | Path) -> Folder:
    """The checkpoint folder ``path`` (``RUN/checkpoints/step-<N>``) as its run's ``Folder`` reaches it:
    the run folder is the user's choice, ``checkpoints`` and the step below it are never links."""
    path = Path(path).absolute()
    if path.parent.name != FOLDER or step_of(path.name) is None:
        raise ValueError(f"{path} is not a checkpoint folder of a par4d run (RUN/{FOLDER}/step-<N>)")
    return Folder(path.parent.parent).sub(FOLDER, path.name)


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
    _check_optimizer(optimizer)
    if folder is None:
        chosen, hashed = choose_checkpoint(run_dir), False
    else:
        chosen, hashed = verify(checkpoint_folder(folder), hashed=False, cover=not verified), not verified
        for name in ENTRY_FILES if hashed else ():
            _check_file(chosen.folder, name, chosen.files[name], hashed=True)
    phantom = getattr(getattr(model, "config", None), "mlp", None) == "phantom"
    for group in optimizer.param_groups:        # AdamW's state needs its tensors before they are filled
        for param in group["params"]:
            if not optimizer.state.get(param):
                # fused (and capturable) AdamW keeps its step count on the parameter's device, else on the CPU
                on_device = group.get("fused") or group.get("capturable")
                step = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
                optimizer.state[param] = {"step": step, "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}
    wanted = list(_tensors(grid, model, optimizer))
    for key, _, _, full in wanted:              # every shape first: nothing is filled from a wrong checkpoint
        problem = full_shape_problem(chosen, key, full, phantom)
        if problem:
            raise ValueError(problem)
    with pieces(chosen, hashed) as saved:
        for key, tensor, placement, full in wanted:
            saved.fill(key, tensor, boxes(placement, full, _coords(grid), grid.sizes))
    return chosen.meta
