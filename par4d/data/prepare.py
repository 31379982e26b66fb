"""``par4d data prepare``: text tokenized once into a dataset folder that training reads a window at a time.

Inputs are ``.txt`` files (a document per paragraph: lines up to a blank line, without the last line's
end), ``.jsonl`` files (a
document per line: the string in ``field``), ``.parquet`` files (a document per row of column ``field``,
read by ``pyarrow`` a batch of rows at a time), or folders of them (every such file below, in name
order). Each document goes to the validation split when the first 8 bytes of its text's SHA-256, read
as a fraction of 2^64, fall below ``val_share``: the split depends on the text alone, not on the order
of the inputs or on how often preparing was interrupted. A document's tokens are followed by the
tokenizer's end-of-text id where it has one.

The folder (docs/data.md):

* ``train-00000.bin``, ``val-00000.bin``, ...: token ids, raw little-endian ``uint16`` (a vocabulary of
  at most 65,536) or ``uint32``, each shard up to ``shard_tokens`` and ending at a document's end;
* ``tokenizer.json``: a copy of the tokenizer, so the folder says what its ids mean;
* ``index.json``, written last: the format, the tokenizer's SHA-256 and vocabulary, the dtype, the
  inputs, and per split its documents, tokens and shards (name, tokens, SHA-256). A folder without it is
  not a dataset: training refuses it.

Restartable: shards are written whole (a temporary, then a rename), and after each flush of both
splits ``progress.json`` records where in the inputs the next document starts, with the shards so far
and what they were made from (inputs' sizes and modification times, tokenizer, settings). Run again with
the same arguments, preparing goes on from there (shards it did not record are written again); with
other inputs it refuses. Every file is read and written through :class:`par4d.folder.Folder`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from par4d.data.tokenizer import Tokenizer
from par4d.folder import Folder

FORMAT = "par4d-tokens"
VERSION = 1
INDEX, PROGRESS, TOKENIZER = "index.json", "progress.json", "tokenizer.json"
SUFFIXES = (".txt", ".jsonl", ".parquet")
SPLITS = ("train", "val")
ENCODE_BATCH = 256                    # documents per call into tokenizers (it encodes a batch on all cores)


@dataclass(frozen=True)
class Settings:
    """What a dataset is made from, besides its inputs: a restart must find them unchanged."""

    tokenizer_sha256: str
    field: str
    val_share: float
    shard_tokens: int


def dtype_for(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def input_files(inputs: list[str]) -> list[Path]:
    """The files ``inputs`` name (folders expanded to the .txt, .jsonl and .parquet files below them, in name
    order); raises naming the first input that is missing or of another kind."""
    files: list[Path] = []
    for given in inputs:
        path = Path(given).absolute()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise ValueError(f"{given}: a folder without .txt, .jsonl or .parquet files")
            files += found
        elif not path.is_file():
            raise ValueError(f"{given}: no such file or folder")
        elif path.suffix not in SUFFIXES:
            raise ValueError(f"{given}: give .txt, .jsonl or .parquet files (or folders of them)")
        else:
            files.append(path)
    if len(set(files)) != len(files):
        raise ValueError(f"{next(str(f) for f in files if files.count(f) > 1)} is given twice")
    return files


def documents(file: Path, field: str) -> Iterator[tuple[str, int]]:
    """(text, input bytes it stands for) of each document of ``file``, in order."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(file)
        if field not in parquet.schema_arrow.names:
            raise ValueError(f"{file}: no column {field!r} (it has {', '.join(parquet.schema_arrow.names)}); "
                             f"give --field")
        rows = max(1, parquet.metadata.num_rows)
        per_row = file.stat().st_size / rows
        for batch in parquet.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                if not isinstance(value, str):
                    raise ValueError(f"{file}: column {field!r} holds {type(value).__name__}, not text")
                yield value, int(per_row)
        return
    with open(file, "rb") as handle:
        if file.suffix == ".jsonl":
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    yield "", len(line)
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise ValueError(f"{file}:{number}: not a JSON line ({error})") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{file}:{number}: no text field {field!r} (give --field)")
                yield text, len(line)
            return
        paragraph, size = [], 0
        for number, line in enumerate(handle, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{file}:{number}: not UTF-8 text") from None
            size += len(line)
            if text.strip():
                paragraph.append(text)
            elif paragraph:
                yield _paragraph(paragraph), size
                paragraph, size = [], 0
        if paragraph or size:
            yield _paragraph(paragraph), size


def _paragraph(lines: list[str]) -> str:
    """A .txt document: its lines as the file has them, without the line end of the last."""
    text = "".join(lines)
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def in_validation(text: str, share: float) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < share * 2.0 ** 64


class _Writer:
    """The shards of one dataset folder, flushed whole, and the record of how far preparing got."""

    def __init__(self, folder: Folder, dtype: np.dtype, shard_tokens: int, shards: dict, counts: dict):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards = shards                    # split -> [{"name", "tokens", "sha256"}]
        self.counts = counts                    # split -> documents written
        self.buffers: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self.pending: dict[str, int] = {s: 0 for s in SPLITS}        # tokens buffered per split
        self.docs: dict[str, int] = {s: 0 for s in SPLITS}           # documents buffered per split

    def add(self, split: str, ids: list[int]) -> None:
        self.buffers[split].append(np.asarray(ids, dtype=self.dtype))
        self.pending[split] += len(ids)
        self.docs[split] += 1

    def full(self) -> bool:
        return self.pending["train"] >= self.shard_tokens or self.pending["val"] >= self.shard_tokens

    def flush(self) -> None:
        for split in SPLITS:
            if not self.pending[split]:
                continue
            data = np.concatenate(self.buffers[split]).tobytes()
            name = f"{split}-{len(self.shards[split]):05d}.bin"
            self.folder.write_bytes(name, data=data)
            self.shards[split].append({"name": name, "tokens": self.pending[split],
                                       "sha256": hashlib.sha256(data).hexdigest()})
            self.counts[split] += self.docs[split]
            self.buffers[split], self.pending[split], self.docs[split] = [], 0, 0


def prepare(inputs: list[str], tokenizer: Tokenizer, out: str | Path, field: str = "text",
            val_share: float = 0.05, shard_tokens: int = 1 << 27, force: bool = False,
            progress: bool = True, say: Callable[[str], None] = print) -> dict:
    """Tokenize ``inputs`` into the dataset folder ``out`` (see the module's docstring); returns its index.
    Refuses, before writing, a complete dataset at ``out`` (unless ``force``: its files are replaced), an
    unfinished one of other inputs or settings, and bad inputs (naming the file and line)."""
    if not 0.0 < val_share < 1.0:
        raise ValueError(f"--val-share {val_share}: give a share between 0 and 1 (e.g. 0.05)")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens}: give at least 1")
    files = input_files(inputs)
    settings = Settings(tokenizer.sha256, field, val_share, shard_tokens)
    made_from = [{"path": str(f), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    folder = Folder(out)
    start, shards, counts = _resume_point(folder, settings, made_from, force, say)
    dtype = dtype_for(tokenizer.vocab)
    folder.write_bytes(TOKENIZER, data=tokenizer.data)     # the bytes hashed (--tokenizer may be in --out)
    writer = _Writer(folder, dtype, shard_tokens, shards, counts)
    total = sum(m["size"] for m in made_from)
    bar = _bar(total, progress)
    done_bytes = sum(m["size"] for m in made_from[:start[0]])
    if bar is not None:
        bar.update(done_bytes)
    def encode(batch: list[tuple[str, int]], index: int, first: int) -> None:
        """Encode ``batch`` (documents ``first``, ``first + 1``, ... of input ``index``); flush both splits
        whenever one holds a shard's worth, at a document's end, and record how far that got."""
        texts = [text for text, _ in batch]
        for number, (text, ids) in enumerate(zip(texts, tokenizer.encode(texts)), first + 1):
            if text:
                writer.add("val" if in_validation(text, val_share) else "train",
                           ids + [tokenizer.eos] if tokenizer.eos is not None else ids)
            if writer.full():
                writer.flush()
                _record(folder, settings, made_from, (index, number), writer)
        if bar is not None:
            bar.update(sum(size for _, size in batch))

    for index in range(start[0], len(files)):
        skip = start[1] if index == start[0] else 0
        batch: list[tuple[str, int]] = []       # documents read, not yet encoded
        position = 0                            # documents of this input read
        for text, size in documents(files[index], field):
            position += 1
            if position <= skip:
                if bar is not None:
                    bar.update(size)
                continue
            batch.append((text, size))
            if len(batch) == ENCODE_BATCH:
                encode(batch, index, position - len(batch))
                batch = []
        encode(batch, index, position - len(batch))
    writer.flush()
    if bar is not None:
        bar.close()
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.str.lstrip("<"),
             "tokenizer": {"file": TOKENIZER, "sha256": tokenizer.sha256, "vocab": tokenizer.vocab,
                           "eos": tokenizer.eos},
             "field": field, "val_share": val_share, "inputs": made_from,
             "splits": {s: {"documents": writer.counts[s], "tokens": sum(h["tokens"] for h in writer.shards[s]),
                            "shards": writer.shards[s]} for s in SPLITS}}
    empty = [s for s in SPLITS if not index["splits"][s]["tokens"]]
    if empty:
        raise ValueError(f"the {empty[0]} split has no tokens ({writer.counts['train']} train and "
                         f"{writer.counts['val']} validation documents): give more text"
                         + (" or another --val-share" if empty[0] == "val" else ""))
    folder.write_text(INDEX, text=json.dumps(index, indent=1) + "\n")
    if folder.exists(PROGRESS):
        folder.remove_file(PROGRESS)
    return index


def _bar(total: int, progress: bool):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, mininterval=1.0)


def _record(folder: Folder, settings: Settings, made_from: list[dict], at: tuple[int, int], writer: _Writer) -> None:
    record = {"settings": settings.__dict__, "inputs": made_from, "next": list(at), "shards": writer.shards,
              "documents": writer.counts}
    folder.write_text(PROGRESS, text=json.dumps(record) + "\n")


def _resume_point(folder: Folder, settings: Settings, made_from: list[dict], force: bool,
                  say: Callable[[str], None]) -> tuple[tuple[int, int], dict, dict]:
    """Where preparing starts: (input, documents of it already written), the shards so far, documents per split."""
    fresh = (0, 0), {s: [] for s in SPLITS}, {s: 0 for s in SPLITS}
    if folder.exists(INDEX):
        if not force:
            raise ValueError(f"--out {folder.path()} holds a dataset already (its {INDEX}); give another folder, "
                             f"or --force to replace it")
        _clear(folder)
        return fresh
    if not folder.exists(PROGRESS):
        if folder.names():
            raise ValueError(f"--out {folder.path()} is not empty and holds no dataset of par4d data prepare; "
                             f"give a new or empty folder")
        return fresh
    record = folder.read_json(PROGRESS)
    if force:
        _clear(folder)
        return fresh
    if not (isinstance(record, dict) and isinstance(record.get("next"), list) and len(record["next"]) == 2
            and isinstance(record.get("shards"), dict) and isinstance(record.get("documents"), dict)):
        raise ValueError(f"--out {folder.path()}: its {PROGRESS} is damaged; give --force to start over")
    if record.get("settings") != settings.__dict__ or record.get("inputs") != made_from:
        raise ValueError(f"--out {folder.path()} holds an unfinished dataset of other inputs or settings (its "
                         f"{PROGRESS}); give the same ones to go on, another folder, or --force to start over")
    shards, counts = record["shards"], record["documents"]
    kept = {h["name"] for s in SPLITS for h in shards[s]}
    for name in folder.names():
        if _is_shard(name) and name not in kept:
            folder.remove_file(name)             # written after the last record: written again
    at = tuple(record["next"])
    say(f"going on from {Path(made_from[at[0]]['path']).name}, document {at[1]:,} "
        f"({sum(h['tokens'] for s in SPLITS for h in shards[s]):,} tokens already in {folder.path()})")
    return at, shards, counts


def _clear(folder: Folder) -> None:
    """Remove the files a dataset of this format consists of, and nothing else of the folder's."""
    for name in folder.names():
        if name in (INDEX, PROGRESS, TOKENIZER) or _is_shard(name):
            folder.remove_file(name)


def _is_shard(name: str) -> bool:
    return re.fullmatch(r"(train|val)-\d{5,}\.bin", name) is not None
