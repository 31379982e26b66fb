"""Verifying a checkpoint before use: its manifest's sizes and SHA-256, its index's pieces covering every
tensor once, its meta; choosing the newest intact one (docs/checkpoints.md)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from par4d.checkpoint.format import (
    CORRUPT,
    DTYPES,
    ENTRY_FILES,
    FOLDER,
    FORMAT,
    LATEST,
    checkpoint_folder,
    free_name,
    latest,
    step_names,
    step_of,
)
from par4d.folder import ABSURD_BYTES, Folder, FolderError, fd_sha256, is_count
from par4d.grid import AXES, FOLDED
from par4d.layout import Box


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


def check_file(folder: Folder, name: str, record: dict, hashed: bool) -> None:
    """``name``'s size (and, ``hashed``, SHA-256) against its manifest record; raises naming the file."""
    try:
        fd = open_piece(folder, name)
    except FileNotFoundError:
        fd = None
    try:
        check_open(fd, folder.path(name), record, hashed)
    finally:
        if fd is not None:
            os.close(fd)


def open_piece(folder: Folder, name: str) -> int:
    try:
        return folder.open_fd(name)
    except FileNotFoundError:
        raise
    except (OSError, FolderError) as error:
        raise ValueError(f"checkpoint file {folder.path(name)} is unreadable ({error})") from None


def check_open(fd: int | None, path: Path, record: dict, hashed: bool) -> None:
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
    axes = (*AXES, *FOLDED)
    if not (isinstance(grid, dict) and set(grid) <= set(axes) and all(is_count(v, 1) for v in grid.values())):
        raise ValueError(f"{path}: grid is {json.dumps(grid)[:80]}, not axis sizes >= 1 of {', '.join(axes)}")
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
            check_file(folder, name, record, hashed)
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
    for _, name in sorted(step_names(folder).items(), reverse=True):
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
        raise ValueError(f"{run_dir}: no checkpoint there (expected {folder.path()}/step-*)")
    raise ValueError(f"{run_dir}: no intact checkpoint ({'; '.join(problems)})")


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
    for step, name in step_names(folder).items():
        if step > chosen_step:
            aside = free_name(folder, CORRUPT + name)
            folder.rename((name,), aside)
            if report is not None:
                report(f"set aside {name} (unusable) as {FOLDER}/{aside}")
    folder.write_text(LATEST, text=chosen.name)
