"""A dataset folder ``par4d data prepare`` made, opened for training: checked, its shards memory-mapped,
nothing read whole.

Opening checks the folder before any rank starts: ``index.json`` is there (else the folder is not a
finished dataset), of this format; its ``tokenizer.json`` is the file the index names by SHA-256 (hashed
here: the run records the file's own), of the index's vocabulary and end-of-text id; every shard a regular
file inside the folder whose size is its token count times the dtype's. The SHA-256 and the largest id of
every shard are checked by :func:`verify` (``par4d inspect``'s work: it reads every byte), not at every
start; a window read holding an id beyond the vocabulary is refused there, naming its shard and offset.

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

from par4d.data.prepare import INDEX, SPLITS, TOKENIZER, ends_name, read_index
from par4d.data.tokenizer import Tokenizer, parse_tokenizer
from par4d.folder import Folder, FolderError

MAPPED = 64                          # shards mapped at once per split (a file descriptor each)
SCAN_BYTES = 1 << 20                 # what verify reads of a shard at a time


class Tokens:
    """One split's tokens across its shards, read by slices (``len``, ``tokens[a:b]`` as int64 numpy). A
    shard is memory-mapped when first read; at most :data:`MAPPED` stay mapped (each mapping holds a file
    descriptor), the least recently read unmapped first. Every id read is checked to be below ``vocab``
    (a damaged shard would fail a rank's step with an IndexError)."""

    def __init__(self, folder: Folder, shards: list[tuple[str, int]], dtype: np.dtype, vocab: int,
                 ends: list[int] | None = None):
        """``ends``: each shard's count of document ends (its ``.ends`` file's), where the dataset records
        them (None: an earlier par4d's dataset, which does not)."""
        self.folder, self.names, self.dtype, self.vocab = folder, [name for name, _ in shards], dtype, vocab
        self.starts = [0]
        for _, tokens in shards:
            self.starts.append(self.starts[-1] + tokens)
        self.mapped: OrderedDict[int, np.ndarray] = OrderedDict()
        self.ends = ends
        self.ended = [0]                  # documents ended before each shard
        for count in ends or ():
            self.ended.append(self.ended[-1] + count)
        self.ends_mapped: OrderedDict[int, np.ndarray] = OrderedDict()

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

    def _ends(self, index: int) -> np.ndarray:
        """Shard ``index``'s document ends (offsets into it), memory-mapped as the shards are."""
        if index in self.ends_mapped:
            self.ends_mapped.move_to_end(index)
            return self.ends_mapped[index]
        name, count = ends_name(self.names[index]), self.ends[index]
        if count == 0:
            self.ends_mapped[index] = np.zeros(0, dtype="<u8")
        else:
            fd = self.folder.open_fd(name)
            try:
                if os.fstat(fd).st_size != count * 8:
                    raise ValueError(f"--data {self.folder.path()}: {name} changed size while the run read it")
                self.ends_mapped[index] = np.frombuffer(mmap.mmap(fd, count * 8, prot=mmap.PROT_READ), dtype="<u8")
            finally:
                os.close(fd)
        while len(self.ends_mapped) > MAPPED:
            self.ends_mapped.popitem(last=False)
        return self.ends_mapped[index]

    def documents(self, window: slice) -> np.ndarray:
        """The document of every token of ``window`` (int64): how many documents of the split end at or before
        it, so two tokens share a document exactly when they share this number. Reads only the ends of the
        shards the window touches (a binary search in each)."""
        if self.ends is None:
            raise ValueError(f"--data {self.folder.path()} records no document ends (an earlier par4d prepared it: "
                             f"prepare it again for --document-mask)")
        start, stop, _ = window.indices(len(self))
        parts, at = [], start
        while at < stop:
            shard = bisect.bisect_right(self.starts, at) - 1
            end = min(stop, self.starts[shard + 1])
            offsets = np.arange(at - self.starts[shard], end - self.starts[shard], dtype=np.uint64)
            parts.append(self.ended[shard] + np.searchsorted(self._ends(shard), offsets, side="right"))
            at = end
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def document_starts(self, window: slice) -> np.ndarray:
        """Where each token of ``window``'s document starts in the split (int64): the end of the document before
        it (0 for the first); reads the ends of the shards those documents end in."""
        documents = self.documents(window)
        starts = np.zeros_like(documents)
        for document in np.unique(documents[documents > 0]).tolist():    # its start: document - 1's end
            shard = bisect.bisect_right(self.ended, document - 1) - 1
            end = int(self._ends(shard)[document - 1 - self.ended[shard]])
            starts[documents == document] = self.starts[shard] + end
        return starts

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        parts, at = [], start
        while at < stop:
            shard = bisect.bisect_right(self.starts, at) - 1
            end = min(stop, self.starts[shard + 1])
            part = self._shard(shard)[at - self.starts[shard]:end - self.starts[shard]]
            if part.max() >= self.vocab:
                raise ValueError(f"--data {self.folder.path()}: "
                                 f"{_bad_id(self.names[shard], part, at - self.starts[shard], self.vocab)} (damaged: "
                                 f"par4d inspect checks every shard)")
            parts.append(part)
            at = end
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class Dataset:
    """An opened dataset folder: its index, its tokenizer (checked against the index) and each split's
    :class:`Tokens`."""

    path: str
    index: dict
    tokenizer: Tokenizer
    splits: dict[str, Tokens]

    @property
    def vocab(self) -> int:
        return self.index["tokenizer"]["vocab"]

    @property
    def documents_marked(self) -> bool:
        """Whether the dataset records where its documents end (every shard's ``.ends``)."""
        return all(split.ends is not None for split in self.splits.values())

    @property
    def tokenizer_sha256(self) -> str:
        """The SHA-256 of the folder's ``tokenizer.json`` itself (the index's, as opening checked)."""
        return self.tokenizer.sha256


def is_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a folder (a dataset, finished or not: :func:`open_dataset` says which)."""
    return Path(path).is_dir()


def _bad_id(name: str, ids: np.ndarray, start: int, vocab: int) -> str:
    """The line naming the first of ``ids`` (shard ``name``'s tokens from token ``start``) at or beyond ``vocab``."""
    first = int(np.argmax(ids >= vocab))
    return (f"shard {name} holds token id {int(ids[first])} at token {start + first:,}, not below the vocabulary "
            f"of {vocab:,}")


def check_tokenizer(folder: Folder, index: dict) -> Tokenizer:
    """The folder's ``tokenizer.json``, checked to be the file the index names by SHA-256, of the index's
    vocabulary and end-of-text id. Raises ``ValueError`` naming the file (the folder's caller prefixes it)."""
    try:
        data = folder.read_bytes(TOKENIZER)
    except FileNotFoundError:
        raise ValueError(f"its {TOKENIZER} is missing (what its ids mean)") from None
    except OSError as error:                    # a FolderError (a link, not a regular file) names it itself
        raise ValueError(f"its {TOKENIZER}: {error.strerror or error}") from None
    recorded = index["tokenizer"]["sha256"]
    digest = hashlib.sha256(data).hexdigest()
    if digest != recorded:
        raise ValueError(f"its {TOKENIZER} has SHA-256 {digest[:12]}..., the {INDEX} recorded {recorded[:12]}... "
                         f"(another tokenizer: the ids would mean other text)")
    tokenizer = parse_tokenizer(data, TOKENIZER)
    vocab, eos = index["tokenizer"]["vocab"], index["tokenizer"]["eos"]
    if vocab != tokenizer.vocab:
        raise ValueError(f"its {INDEX} says a vocabulary of {vocab:,}, its {TOKENIZER} has {tokenizer.vocab:,}")
    if eos != tokenizer.eos:
        raise ValueError(f"its {INDEX} says end-of-text id {eos}, its {TOKENIZER}'s is {tokenizer.eos}")
    return tokenizer


def open_dataset(path: str | Path, seq_len: int, tokenizer_sha256: str | None = None) -> Dataset:
    """The dataset folder at ``path``, checked (see the module's docstring) and memory-mapped. Raises
    ``ValueError`` naming the folder and the problem: not finished, its tokenizer not the index's or of
    another tokenizer (given its ``tokenizer_sha256``), a shard missing, a link or of the wrong size, a
    split without one window of ``seq_len + 1`` tokens."""
    folder = Folder(Path(path).absolute())
    if not folder.exists(INDEX):
        raise ValueError(f"--data {folder.path()}: no {INDEX}, so not a finished dataset (an interrupted "
                         f"par4d data prepare? run it again with the same arguments)")
    index = read_index(folder)
    try:
        tokenizer = check_tokenizer(folder, index)
    except ValueError as error:
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
        records = index["splits"][split]["shards"]
        ends = [shard["ends"] for shard in records] if all("ends" in shard for shard in records) else None
        for shard in records if ends is not None else ():
            name = ends_name(shard["name"])
            try:
                size = folder.size(name) if shard["ends"] else 0
            except (FolderError, OSError) as error:
                raise ValueError(f"--data {folder.path()}: {name!r}: {error}") from None
            if size != shard["ends"] * 8:
                raise ValueError(f"--data {folder.path()}: {name} has {size:,} bytes, the index says "
                                 f"{shard['ends']:,} document ends of 8 bytes")
        splits[split] = Tokens(folder, shards, dtype, index["tokenizer"]["vocab"], ends)
        if len(splits[split]) < seq_len + 2:
            raise ValueError(f"--data {folder.path()}: the {split} split has {len(splits[split]):,} tokens; "
                             f"--seq-len {seq_len} needs at least {seq_len + 2}")
    return Dataset(str(folder.path()), index, tokenizer, splits)


def verify(path: str | Path) -> list[str]:
    """What is wrong with the dataset at ``path``, a line each (none when it is whole): its tokenizer not the
    index's, and every shard missing, of another size, with another SHA-256 than the index's, or holding an
    id beyond the vocabulary (the first named, with its offset). Reads every byte."""
    folder = Folder(Path(path).absolute())
    index = read_index(folder)
    problems = []
    try:
        check_tokenizer(folder, index)
    except ValueError as error:
        problems.append(str(error))
    dtype, vocab = np.dtype(index["dtype"]).newbyteorder("<"), index["tokenizer"]["vocab"]
    for split in SPLITS:
        for shard in index["splits"][split]["shards"]:
            problem = _shard_problem(folder, shard, dtype, vocab)
            if problem is not None:
                problems.append(problem)
    return problems


def _shard_problem(folder: Folder, shard: dict, dtype: np.dtype, vocab: int) -> str | None:
    """What is wrong with one shard (its size, its first id beyond ``vocab``, its SHA-256), or None. One pass."""
    name = shard["name"]
    try:
        fd = folder.open_fd(name)
    except (FolderError, OSError) as error:
        return f"shard {name}: {error}"
    try:
        size = os.fstat(fd).st_size
        if size != shard["tokens"] * dtype.itemsize:
            return (f"shard {name} has {size:,} bytes, the index says {shard['tokens']:,} tokens of "
                    f"{dtype.itemsize} bytes")
        digest, bad, offset = hashlib.sha256(), None, 0
        while chunk := os.pread(fd, SCAN_BYTES, offset * dtype.itemsize):
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if bad is None and ids.max() >= vocab:
                bad = _bad_id(name, ids, offset, vocab)
            offset += len(ids)
    finally:
        os.close(fd)
    if bad is not None:
        return bad
    if digest.hexdigest() != shard.get("sha256"):
        return f"shard {name}: its SHA-256 is not the index's"
    if "ends" in shard:
        try:
            ends = folder.read_bytes(ends_name(name)) if shard["ends"] else b""
        except (FolderError, OSError) as error:
            return f"{ends_name(name)}: {error}"
        if hashlib.sha256(ends).hexdigest() != shard.get("ends_sha256"):
            return f"{ends_name(name)}: its SHA-256 is not the index's"
    return None


def sha256_of_index(path: str | Path) -> str:
    """The SHA-256 of a dataset's ``index.json``: what a run records as its data's identity."""
    return hashlib.sha256(Folder(Path(path).absolute()).read_bytes(INDEX)).hexdigest()
