"""A dataset folder ``par4d data prepare`` made, opened for training: checked, its shards memory-mapped,
nothing read whole.

Opening checks the folder before any rank starts: ``index.json`` is there (else the folder is not a
finished dataset), of this format, its tokenizer the run's (by SHA-256), every shard a regular file inside
the folder whose size is its token count times the dtype's. The SHA-256 of every shard is checked by
:func:`verify` (``par4d inspect``'s work: it reads every byte), not at every start.

A split is the concatenation of its shards; :class:`Tokens` reads a window of it from the memory maps
(across a shard's end where one falls inside), so a dataset many times larger than memory trains with
only the windows of a step in memory. Shards are mapped as they are read, at most :data:`MAPPED` at a
time, so a dataset of thousands of shards does not run out of file descriptors.
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from par4d.data.prepare import FORMAT, INDEX, SPLITS, VERSION
from par4d.folder import Folder, FolderError

MAPPED = 64                          # shards mapped at once per split (a file descriptor each)


class Tokens:
    """One split's tokens across its shards, read by slices (``len``, ``tokens[a:b]`` as int64 numpy). A
    shard is memory-mapped when first read; at most :data:`MAPPED` stay mapped (each mapping holds a file
    descriptor), the least recently read unmapped first."""

    def __init__(self, folder: Folder, shards: list[tuple[str, int]], dtype: np.dtype):
        self.folder, self.names, self.dtype = folder, [name for name, _ in shards], dtype
        self.starts = [0]
        for _, tokens in shards:
            self.starts.append(self.starts[-1] + tokens)
        self.mapped: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.starts[-1]

    def _shard(self, index: int) -> np.ndarray:
        if index in self.mapped:
            self.mapped.move_to_end(index)
            return self.mapped[index]
        fd = self.folder.open_fd(self.names[index])
        try:
            size = (self.starts[index + 1] - self.starts[index]) * self.dtype.itemsize
            if os.fstat(fd).st_size != size:
                raise ValueError(f"--data {self.folder.path()}: shard {self.names[index]} changed size while the "
                                 f"run read it")
            self.mapped[index] = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), dtype=self.dtype)
        finally:
            os.close(fd)                  # the mapping keeps its own descriptor
        while len(self.mapped) > MAPPED:  # slices are copied out, so the mapping closes once dropped
            self.mapped.popitem(last=False)
        return self.mapped[index]

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        parts, at = [], start
        while at < stop:
            shard = bisect.bisect_right(self.starts, at) - 1
            end = min(stop, self.starts[shard + 1])
            parts.append(self._shard(shard)[at - self.starts[shard]:end - self.starts[shard]])
            at = end
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class Dataset:
    """An opened dataset folder: its index and each split's :class:`Tokens`."""

    path: str
    index: dict
    splits: dict[str, Tokens]

    @property
    def vocab(self) -> int:
        return self.index["tokenizer"]["vocab"]

    @property
    def tokenizer_sha256(self) -> str:
        return self.index["tokenizer"]["sha256"]


def is_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a folder (a dataset, finished or not: :func:`open_dataset` says which)."""
    return Path(path).is_dir()


def _check_index(index: object, where: Path) -> dict:
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{where} is not a par4d dataset index (made by par4d data prepare)")
    if index.get("version") != VERSION:
        raise ValueError(f"{where}: dataset format version {index.get('version')!r}; this par4d reads {VERSION}")
    try:
        if index["dtype"] not in ("u2", "u4"):
            raise ValueError(f"dtype {index['dtype']!r}, not u2 or u4")
        if not 1 < int(index["tokenizer"]["vocab"]) <= 1 << (16 if index["dtype"] == "u2" else 32):
            raise ValueError(f"vocabulary {index['tokenizer']['vocab']} in {index['dtype']}")
        for split in SPLITS:
            int(index["splits"][split]["documents"]), int(index["splits"][split]["tokens"])
            for shard in index["splits"][split]["shards"]:
                if not (isinstance(shard["name"], str) and isinstance(shard["tokens"], int) and shard["tokens"] > 0):
                    raise TypeError(shard)
        int(index["tokenizer"]["vocab"]), str(index["tokenizer"]["sha256"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where} is damaged ({type(error).__name__}: {error})") from None
    return index


def open_dataset(path: str | Path, seq_len: int, tokenizer_sha256: str | None = None) -> Dataset:
    """The dataset folder at ``path``, checked (see the module's docstring) and memory-mapped. Raises
    ``ValueError`` naming the folder and the problem: not finished, of another tokenizer (given its
    ``tokenizer_sha256``), a shard missing, a link or of the wrong size, a split without one window of
    ``seq_len + 1`` tokens."""
    folder = Folder(Path(path).absolute())
    where = folder.path(INDEX)
    if not folder.exists(INDEX):
        raise ValueError(f"--data {folder.path()}: no {INDEX}, so not a finished dataset (an interrupted "
                         f"par4d data prepare? run it again with the same arguments)")
    try:
        index = _check_index(folder.read_json(INDEX), where)
    except FolderError as error:
        raise ValueError(f"--data {folder.path()}: {error}") from None
    if tokenizer_sha256 is not None and index["tokenizer"]["sha256"] != tokenizer_sha256:
        raise ValueError(f"--data {folder.path()} was prepared with another tokenizer (SHA-256 "
                         f"{index['tokenizer']['sha256'][:12]}..., the run's {tokenizer_sha256[:12]}...)")
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    splits = {}
    for split in SPLITS:
        shards = [(shard["name"], shard["tokens"]) for shard in index["splits"][split]["shards"]]
        for name, tokens in shards:       # every shard there, at its size, before any rank starts
            try:
                size = folder.size(name)
            except (FolderError, OSError) as error:
                raise ValueError(f"--data {folder.path()}: shard {name!r}: {error}") from None
            if size != tokens * dtype.itemsize:
                raise ValueError(f"--data {folder.path()}: shard {name} has {size:,} bytes, the index says "
                                 f"{tokens:,} tokens of {dtype.itemsize} bytes")
        splits[split] = Tokens(folder, shards, dtype)
        if len(splits[split]) < seq_len + 2:
            raise ValueError(f"--data {folder.path()}: the {split} split has {len(splits[split]):,} tokens; "
                             f"--seq-len {seq_len} needs at least {seq_len + 2}")
    return Dataset(str(folder.path()), index, splits)


def verify(path: str | Path) -> list[str]:
    """Every shard's SHA-256 against the index; the names of those that differ (reads every byte)."""
    folder = Folder(Path(path).absolute())
    index = _check_index(folder.read_json(INDEX), folder.path(INDEX))
    bad = []
    for split in SPLITS:
        for shard in index["splits"][split]["shards"]:
            try:
                digest = folder.sha256(shard["name"])
            except (FolderError, OSError):
                digest = None
            if digest != shard["sha256"]:
                bad.append(shard["name"])
    return bad


def sha256_of_index(path: str | Path) -> str:
    """The SHA-256 of a dataset's ``index.json``: what a run records as its data's identity."""
    return hashlib.sha256(Folder(Path(path).absolute()).read_bytes(INDEX)).hexdigest()
