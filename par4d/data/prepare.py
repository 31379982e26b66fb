"""``par4d data prepare``: text tokenized once into a dataset folder that training reads a window at a time.

Inputs are ``.txt`` files (a document per paragraph: lines up to a blank line, without the last line's
end), ``.jsonl`` files (a document per line: the string in ``field``), ``.parquet`` files (a document per
row of column ``field``, read by ``pyarrow`` a batch of rows at a time), or folders of them (every such file
below, in name order). Each document goes to the validation split when the first 8 bytes of its text's
SHA-256, read as a fraction of 2^64, fall below ``val_share``: the split depends on the text alone, not on
the order of the inputs or on how often preparing was interrupted. A document's tokens are followed by the
tokenizer's end-of-text id where it has one.

Memory is bounded by ``piece_chars``, not by the longest document: the tokenizer holds a few hundred bytes
per character it encodes, so a document longer than ``piece_chars`` characters is given to it in pieces
(:func:`cut`: before the last whitespace of a piece's second half where it has some), a ``.txt`` is read a
bounded part of a line at a time, and a batch holds at most ``ENCODE_PIECES`` pieces' worth of characters.
Such a document goes to the split its first piece's SHA-256 gives (for every shorter one, its whole text).

The folder (docs/data.md):

* ``train-00000.bin``, ``val-00000.bin``, ...: token ids, raw little-endian ``uint16`` (a vocabulary of
  at most 65,536) or ``uint32``, each shard up to ``shard_tokens`` and ending at a document's end, or at
  a piece's end inside a document of several pieces;
* ``train-00000.ends``, ...: beside each shard, where its documents end: raw little-endian ``uint64``
  offsets into the shard's tokens (each a document's end, exclusive: its end-of-text id included), so a
  window knows where each of its documents starts (``--document-mask``);
* ``tokenizer.json``: a copy of the tokenizer, so the folder says what its ids mean;
* ``index.json``, written last: the format, the tokenizer's SHA-256, vocabulary and end-of-text id, the
  dtype, the inputs, and per split its documents, tokens and shards (name, tokens, SHA-256; its ends'
  count and SHA-256). A folder without it is not a dataset: training refuses it. A dataset an earlier
  par4d made has no ends: it trains, but not with ``--document-mask``.

Restartable: ``progress.json`` is written first, so a folder holding one is par4d's unfinished dataset;
shards are written whole (a temporary, then a rename), and after each flush of both splits
``progress.json`` records where in the inputs the next piece starts, with the shards so far and what they
were made from (inputs' sizes and modification times, tokenizer, settings). Run again with the same
arguments, preparing goes on from there (the shards it was writing when stopped are written again); with
other inputs it refuses once shards exist. A failed write (a full disk) is one line naming the file, and
the same command goes on; a run that fails before its first shard removes what it wrote. ``force``
replaces only what par4d's own index or record lists; a file of the user's in the way (an ``index.json``
that is not par4d's, a shard neither lists) is refused, never removed. Every file is read and written
through :class:`par4d.folder.Folder`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from par4d.data.inputs import PIECE_CHARS, Piece, input_files, pieces
from par4d.data.tokenizer import Tokenizer
from par4d.folder import Folder, is_count, path_kind

FORMAT = "par4d-tokens"
VERSION = 1
INDEX, PROGRESS, TOKENIZER = "index.json", "progress.json", "tokenizer.json"
SPLITS = ("train", "val")
ENCODE_BATCH = 256                    # texts per call into tokenizers (it encodes a batch on all cores)
ENCODE_PIECES = 8                     # a batch's characters, in pieces' worth: what bounds the tokenizer's memory


@dataclass(frozen=True)
class Settings:
    """What a dataset is made from, besides its inputs: a restart must find them unchanged."""

    tokenizer_sha256: str
    field: str
    val_share: float
    shard_tokens: int
    piece_chars: int


def dtype_for(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def in_validation(text: str, share: float) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < share * 2.0 ** 64


def check_index(index: object, where: Path) -> dict:
    """``index`` (``where``'s JSON) if it is a par4d dataset index of this version, whole; else raise naming it."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{where} is not a par4d dataset index (made by par4d data prepare)")
    if index.get("version") != VERSION:
        raise ValueError(f"{where}: dataset format version {index.get('version')!r}; this par4d reads {VERSION}")
    try:
        if index["dtype"] not in ("u2", "u4"):
            raise ValueError(f"dtype {index['dtype']!r}, not u2 or u4")
        vocab, eos = index["tokenizer"]["vocab"], index["tokenizer"]["eos"]
        if not (is_count(vocab, 2) and vocab <= 1 << (16 if index["dtype"] == "u2" else 32)):
            raise ValueError(f"vocabulary {vocab!r} in {index['dtype']}")
        if eos is not None and not (is_count(eos) and eos < vocab):
            raise ValueError(f"end-of-text id {eos!r}, not below the vocabulary of {vocab}")
        for split in SPLITS:
            int(index["splits"][split]["documents"]), int(index["splits"][split]["tokens"])
            for shard in index["splits"][split]["shards"]:
                if not (isinstance(shard["name"], str) and is_count(shard["tokens"], 1)):
                    raise TypeError(shard)
        str(index["tokenizer"]["sha256"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where} is damaged ({type(error).__name__}: {error})") from None
    return index


class _Writer:
    """The shards of one dataset folder, flushed whole, and the record of how far preparing got."""

    def __init__(self, folder: Folder, dtype: np.dtype, shard_tokens: int, shards: dict, counts: dict):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards = shards                    # split -> [{"name", "tokens", "sha256"}]
        self.counts = counts                    # split -> documents written
        self.buffers: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self.pending: dict[str, int] = {s: 0 for s in SPLITS}        # tokens buffered per split
        self.docs: dict[str, int] = {s: 0 for s in SPLITS}           # documents ended in them per split
        self.ends: dict[str, list[int]] = {s: [] for s in SPLITS}    # where, in the pending shard

    def add(self, split: str, ids: np.ndarray, last: bool) -> None:
        self.buffers[split].append(ids.astype(self.dtype, copy=False))
        self.pending[split] += len(ids)
        self.docs[split] += last
        if last:
            self.ends[split].append(self.pending[split])

    def full(self) -> bool:
        return self.pending["train"] >= self.shard_tokens or self.pending["val"] >= self.shard_tokens

    def flush(self) -> None:
        for split in SPLITS:
            if not self.pending[split]:
                continue
            name, parts = shard_name(split, len(self.shards[split])), self.buffers[split]
            digest = hashlib.sha256()
            for part in parts:
                digest.update(part)
            _write(self.folder, name, parts)          # the buffers as they are: no copy of a shard's worth
            ends = np.array(self.ends[split], dtype="<u8")
            _write(self.folder, ends_name(name), [ends])
            self.shards[split].append({"name": name, "tokens": self.pending[split], "sha256": digest.hexdigest(),
                                       "ends": len(ends), "ends_sha256": hashlib.sha256(ends).hexdigest()})
            self.counts[split] += self.docs[split]
            self.buffers[split], self.pending[split], self.docs[split], self.ends[split] = [], 0, 0, []


def prepare(inputs: list[str], tokenizer: Tokenizer, out: str | Path, field: str = "text",
            val_share: float = 0.05, shard_tokens: int = 1 << 27, force: bool = False,
            progress: bool = True, say: Callable[[str], None] = print, piece_chars: int = PIECE_CHARS) -> dict:
    """Tokenize ``inputs`` into the dataset folder ``out`` (see the module's docstring); returns its index.
    Refuses, before writing, a complete dataset at ``out`` (unless ``force``: its files are replaced), an
    unfinished one of other inputs or settings, a file of the user's in the way, and bad inputs (naming
    the file and line); a failed write names the file (the same command then goes on)."""
    if not 0.0 < val_share < 1.0:
        raise ValueError(f"--val-share {val_share}: give a share between 0 and 1 (e.g. 0.05)")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens}: give at least 1")
    if piece_chars < 2:
        raise ValueError(f"piece_chars={piece_chars}: give at least 2")
    files = input_files(inputs)
    settings = Settings(tokenizer.sha256, field, val_share, shard_tokens, piece_chars)
    made_from = [{"path": str(f), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    out = Path(out).absolute()
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"--out {out} {path_kind(out)}: give a folder (new, empty, or a dataset's)") from None
    except OSError as error:
        raise ValueError(f"--out {out}: cannot make the folder ({error.strerror})") from None
    folder = Folder(out)
    start, shards, counts = _resume_point(folder, settings, made_from, tokenizer, force, say)
    found = set(folder.names())
    dtype = dtype_for(tokenizer.vocab)
    writer = _Writer(folder, dtype, shard_tokens, shards, counts)
    bar = _bar(sum(m["size"] for m in made_from), progress)
    try:
        _record(folder, settings, made_from, start, writer)    # first: from here on the folder is par4d's
        _write(folder, TOKENIZER, [tokenizer.data])            # the bytes hashed (--tokenizer may be in --out)
        _tokenize(files, field, tokenizer, settings, made_from, start, writer, bar)
    except BaseException:
        if not any(writer.shards[s] for s in SPLITS):     # bad input before the first shard: nothing left behind
            _leave_as_found(folder, found, made)
        raise
    finally:
        if bar is not None:
            bar.close()
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.str.lstrip("<"),
             "tokenizer": {"file": TOKENIZER, "sha256": tokenizer.sha256, "vocab": tokenizer.vocab,
                           "eos": tokenizer.eos},
             "field": field, "val_share": val_share, "piece_chars": piece_chars, "inputs": made_from,
             "splits": {s: {"documents": writer.counts[s], "tokens": sum(h["tokens"] for h in writer.shards[s]),
                            "shards": writer.shards[s]} for s in SPLITS}}
    empty = [s for s in SPLITS if not index["splits"][s]["tokens"]]
    if empty:
        raise ValueError(f"the {empty[0]} split has no tokens ({writer.counts['train']} train and "
                         f"{writer.counts['val']} validation documents): give more text"
                         + (" or another --val-share" if empty[0] == "val" else ""))
    _write(folder, INDEX, [(json.dumps(index, indent=1) + "\n").encode("utf-8")])
    try:
        folder.remove_file(PROGRESS)
    except OSError as error:
        raise ValueError(f"{folder.path(PROGRESS)}: cannot remove it ({error.strerror}); the dataset is "
                         f"finished: remove it by hand") from None
    return index


def _tokenize(files: list[Path], field: str, tokenizer: Tokenizer, settings: Settings, made_from: list[dict],
              start: tuple[int, int, int], writer: _Writer, bar) -> None:
    """Every piece of ``files`` from ``start`` (input, documents of it written, pieces of the next written)
    into ``writer``, flushed whenever a split holds a shard's worth and recorded."""
    if bar is not None:
        bar.update(sum(m["size"] for m in made_from[:start[0]]))

    def encode(batch: list[tuple[Piece, str, int, int]], index: int) -> None:
        """Encode ``batch`` (piece, split, document, piece_number) of input ``index``; flush both splits
        whenever one holds a shard's worth, and record how far that got."""
        tail = [tokenizer.eos] if tokenizer.eos is not None else []
        for (piece, split, document, piece_number), ids in zip(batch, _encoded(tokenizer, [b[0] for b in batch])):
            if piece.text:
                array = np.array(ids + tail if piece.last else ids, dtype=np.uint32)
                if len(array) and int(array.max()) >= tokenizer.vocab:
                    raise ValueError(f"{piece.where}: the tokenizer {tokenizer.path} gave id {int(array.max())}, "
                                     f"not below its vocabulary of {tokenizer.vocab}")
                writer.add(split, array, piece.last)
            if writer.full():
                writer.flush()
                _record(writer.folder, settings, made_from,
                        (index, document + 1, 0) if piece.last else (index, document, piece_number + 1), writer)
        if bar is not None:
            bar.update(sum(b[0].size for b in batch))

    budget = ENCODE_PIECES * settings.piece_chars
    for index in range(start[0], len(files)):
        skip = tuple(start[1:]) if index == start[0] else (0, 0)
        batch: list[tuple[Piece, str, int, int]] = []    # pieces read, not yet encoded
        chars, document, piece_number, split = 0, 0, 0, "train"
        try:
            for piece in pieces(files[index], field, settings.piece_chars):
                if piece_number == 0:         # a document's split: its first piece's (its whole text's where one)
                    split = "val" if in_validation(piece.text, settings.val_share) else "train"
                if (document, piece_number) < skip:
                    if bar is not None:
                        bar.update(piece.size)
                else:
                    batch.append((piece, split, document, piece_number))
                    chars += len(piece.text)
                    if len(batch) == ENCODE_BATCH or chars >= budget:
                        encode(batch, index)
                        batch, chars = [], 0
                document, piece_number = (document + 1, 0) if piece.last else (document, piece_number + 1)
        except OSError as error:        # writes raise ValueError (_write): this is the input's
            raise ValueError(f"{files[index]}: cannot read it ({error.strerror or error})") from None
        encode(batch, index)
    writer.flush()


def _encoded(tokenizer: Tokenizer, batch: list[Piece]) -> list[list[int]]:
    """The ids of each piece; a text the tokenizer cannot encode is named by its file and line."""
    try:
        return tokenizer.encode([piece.text for piece in batch])
    except ValueError:
        for piece in batch:             # which one: only on this path
            try:
                tokenizer.encode([piece.text])
            except ValueError as error:
                raise ValueError(f"{piece.where}: {error}") from None
        raise


def _write(folder: Folder, name: str, parts: list[bytes | np.ndarray]) -> None:
    """Write ``name`` whole, ``parts`` one after another. A failure (a full disk) is one line naming it: the
    last record stands, so the same command goes on from it."""
    def write(f) -> None:
        for part in parts:
            f.write(part)

    try:
        folder.write_with(name, write=write)
    except OSError as error:
        raise ValueError(f"cannot write {folder.path(name)} ({error.strerror or error}); make room and run the "
                         f"same command again: it goes on from its last record") from None


def _leave_as_found(folder: Folder, found: set[str], made: bool) -> None:
    """Remove what a run that made no shard wrote (its record, its copy of the tokenizer, their temporaries;
    nothing that was ``found`` there), and the folder if it ``made`` it. Never masks the failure."""
    with contextlib.suppress(OSError):
        for name in set(folder.names()) - found:
            if name in (PROGRESS, TOKENIZER) or name in (f".{PROGRESS}.tmp", f".{TOKENIZER}.tmp"):
                folder.remove_file(name)
        if made and not folder.names():
            folder.path().rmdir()


def _bar(total: int, progress: bool):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, mininterval=1.0)


def _record(folder: Folder, settings: Settings, made_from: list[dict], at: tuple[int, int, int],
            writer: _Writer) -> None:
    record = {"format": FORMAT, "version": VERSION, "settings": settings.__dict__, "inputs": made_from,
              "next": list(at), "shards": writer.shards, "documents": writer.counts}
    _write(folder, PROGRESS, [(json.dumps(record) + "\n").encode("utf-8")])


def _resume_point(folder: Folder, settings: Settings, made_from: list[dict], tokenizer: Tokenizer, force: bool,
                  say: Callable[[str], None]) -> tuple[tuple[int, int, int], dict, dict]:
    """Where preparing starts: (input, documents of it written, pieces of the next written), the shards so
    far, documents per split. Removes (``force``) only files par4d's own index or record lists."""
    fresh = (0, 0, 0), {s: [] for s in SPLITS}, {s: 0 for s in SPLITS}
    names = folder.names()
    if INDEX in names:
        index = read_index(folder)
        if not force:
            raise ValueError(f"--out {folder.path()} holds a dataset already (its {INDEX}); give another folder, "
                             f"or --force to replace it")
        listed = [h["name"] for s in SPLITS for h in index["splits"][s]["shards"]]
        _clear(folder, names, {*listed, *(ends_name(name) for name in listed)})
        return fresh
    if PROGRESS not in names:
        # a first run that failed before its record (an earlier par4d's) leaves only the tokenizer it was given
        own = {f".{name}.tmp" for name in (INDEX, PROGRESS, TOKENIZER)}
        if TOKENIZER in names and folder.read_bytes(TOKENIZER) == tokenizer.data:
            own.add(TOKENIZER)
        if set(names) - own:
            raise ValueError(f"--out {folder.path()} is not empty and holds no dataset of par4d data prepare "
                             f"({sorted(set(names) - own)[0]}, ...); give a new or empty folder")
        return fresh
    record = _read_json(folder, PROGRESS)
    if not _is_record(record):
        raise ValueError(f"--out {folder.path()}: its {PROGRESS} is not a record of this par4d's data prepare "
                         f"(nothing was changed); move it away or give another folder")
    shards, counts = record["shards"], record["documents"]
    ours = _unfinished([h["name"] for s in SPLITS for h in shards[s]])
    if force or not any(shards[s] for s in SPLITS):     # nothing made yet: a failed first run starts again
        _clear(folder, names, ours)
        return fresh
    if record["settings"] != settings.__dict__ or record["inputs"] != made_from:
        raise ValueError(f"--out {folder.path()} holds an unfinished dataset of other inputs or settings (its "
                         f"{PROGRESS}); give the same ones to go on, another folder, or --force to start over")
    _refuse_strays(folder, names, ours)
    at = tuple(record["next"])
    where = f"document {at[1]:,}" + (f", piece {at[2]:,}" if at[2] else "")
    say(f"going on from {Path(made_from[at[0]]['path']).name}, {where} "
        f"({sum(h['tokens'] for s in SPLITS for h in shards[s]):,} tokens already in {folder.path()})")
    return at, shards, counts


def read_index(folder: Folder) -> dict:
    """The folder's ``index.json``, checked to be a whole par4d dataset index; raises naming it."""
    return check_index(_read_json(folder, INDEX), folder.path(INDEX))


def _read_json(folder: Folder, name: str) -> object:
    try:
        return folder.read_json(name)            # a FolderError (a link, not JSON) names the file itself
    except OSError as error:
        raise ValueError(f"{folder.path(name)}: {error.strerror or error}") from None


def _is_record(record: object) -> bool:
    """Whether ``record`` is a ``progress.json`` this par4d wrote (whole)."""
    try:
        return (record["format"] == FORMAT and record["version"] == VERSION and isinstance(record["settings"], dict)
                and isinstance(record["inputs"], list) and len(record["next"]) == 3
                and all(is_count(n) for n in record["next"])
                and all(is_count(record["documents"][s]) for s in SPLITS)
                and all(_is_shard(h["name"]) and is_count(h["tokens"], 1) and isinstance(h["sha256"], str)
                        for s in SPLITS for h in record["shards"][s]))
    except (KeyError, TypeError):
        return False


def _refuse_strays(folder: Folder, names: list[str], ours: set[str]) -> None:
    """Refuse a shard file that is not ``ours`` (listed by par4d's index or record): a run might write over it."""
    stray = [name for name in names if _is_shard(name) and name not in ours]
    if stray:
        raise ValueError(f"--out {folder.path()} holds {stray[0]}, a shard file par4d's {INDEX} or {PROGRESS} does "
                         f"not list (not par4d's to replace; nothing was changed): move it away")


def _unfinished(listed: list[str]) -> set[str]:
    """The shards of an unfinished dataset: those its record lists, and the next of each split (the flush
    that was writing them when it stopped had not recorded them yet: they are written again)."""
    shards = {*listed, *(shard_name(s, sum(name.startswith(s + "-") for name in listed)) for s in SPLITS)}
    return shards | {ends_name(name) for name in shards}


def _clear(folder: Folder, names: list[str], ours: set[str]) -> None:
    """Remove par4d's dataset from ``folder``: its shards (``ours``), index, record and tokenizer, and their
    temporaries; nothing else. A shard file not ``ours``, or a ``progress.json`` par4d did not write, is
    refused first (it is a user's)."""
    _refuse_strays(folder, names, ours)
    if PROGRESS in names and not _is_record(_read_json(folder, PROGRESS)):
        raise ValueError(f"--out {folder.path()}: its {PROGRESS} is not a record of this par4d's data prepare "
                         f"(nothing was changed); move it away")
    own = {*ours, INDEX, PROGRESS, TOKENIZER}
    for name in names:
        if name in own or (name.startswith(".") and name.endswith(".tmp") and name[1:-4] in own):
            folder.remove_file(name)


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.bin"


def ends_name(shard: str) -> str:
    """The file of where shard ``shard``'s documents end."""
    return shard.removesuffix(".bin") + ".ends"


def _is_shard(name: str) -> bool:
    """A shard's name, or its ends' (a file a run writes: never a user's)."""
    return re.fullmatch(r"(train|val)-\d{5,}\.(bin|ends)", name) is not None
