"""What ``par4d data prepare`` reads: input files (``.txt``, ``.jsonl``, ``.parquet``, or folders of them) as
documents, each in pieces of at most ``piece_chars`` characters, read a bounded part at a time: memory is
bounded by the piece, never by the longest line (:mod:`par4d.data.prepare` says what a document is)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from par4d.folder import path_kind

SUFFIXES = (".txt", ".jsonl", ".parquet")
PIECE_CHARS = 1 << 16                 # the longest text the tokenizer is given (it holds ~260 bytes a character)
WHITESPACE = " \t\n\r\f\v"


class Piece(NamedTuple):
    """A document's text, or one piece of it: the input bytes it stands for, whether it ends its document,
    and where that document starts (``file:line``, or a Parquet row) for messages."""

    text: str
    size: int
    last: bool
    where: str


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
            raise ValueError(f"{given} {path_kind(path)}: give .txt, .jsonl or .parquet files (or folders of them)")
        elif path.suffix not in SUFFIXES:
            raise ValueError(f"{given}: give .txt, .jsonl or .parquet files (or folders of them)")
        else:
            files.append(path)
    if len(set(files)) != len(files):
        raise ValueError(f"{next(str(f) for f in files if files.count(f) > 1)} is given twice")
    return files


def cut(text: str, piece_chars: int) -> Iterator[str]:
    """``text`` in pieces of at most ``piece_chars`` characters. Each is cut before the last whitespace of
    its second half where it has some, so that a byte-level or whitespace pre-tokenizer splits the same
    words as in one pass (their ids are one pass's); else at ``piece_chars``, inside a word."""
    start, half = 0, max(1, piece_chars // 2)
    while len(text) - start > piece_chars:
        end = max(text.rfind(c, start + half, start + piece_chars + 1) for c in WHITESPACE)
        end = end if end > start else start + piece_chars
        yield text[start:end]
        start = end
    yield text[start:]


def pieces(file: Path, field: str, piece_chars: int = PIECE_CHARS) -> Iterator[Piece]:
    """The documents of ``file``, in order, each in pieces of at most ``piece_chars`` characters (:func:`cut`).
    Raises ``ValueError`` naming the file and line (or row) of anything that is not a document."""
    if file.suffix == ".parquet":
        yield from _parquet_pieces(file, field, piece_chars)
        return
    with open(file, "rb") as handle:
        if file.suffix == ".jsonl":
            yield from _jsonl_pieces(handle, file, field, piece_chars)
        else:
            yield from _text_pieces(handle, file, piece_chars)


def _parquet_pieces(file: Path, field: str, piece_chars: int) -> Iterator[Piece]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except (pyarrow.ArrowException, OSError) as error:
        raise ValueError(f"{file} is not a Parquet file ({str(error).splitlines()[0][:200]})") from None
    if field not in parquet.schema_arrow.names:
        raise ValueError(f"{file}: no column {field!r} (it has {', '.join(parquet.schema_arrow.names)}); "
                         f"give --field")
    per_row = int(file.stat().st_size / max(1, parquet.metadata.num_rows))
    row = 0
    try:
        for batch in parquet.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                if not isinstance(value, str):
                    raise ValueError(f"{file}: row {row}: column {field!r} holds {type(value).__name__}, not text")
                yield from _cut_document(value, per_row, f"{file}: row {row}", piece_chars)
    except pyarrow.ArrowException as error:       # a damaged page, found as it is read
        raise ValueError(f"{file}: row {row + 1}: not readable Parquet ({str(error).splitlines()[0][:200]})") \
            from None


_JSON_TYPES = ((type(None), "null"), (bool, "boolean"), ((int, float), "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def _json_type(value: object) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def _jsonl_pieces(handle, file: Path, field: str, piece_chars: int) -> Iterator[Piece]:
    """A record is read whole (JSON gives a string whole); its text is cut like any other."""
    for number, line in enumerate(handle, 1):
        if not line.strip():
            yield Piece("", len(line), True, f"{file}:{number}")
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{file}:{number}: not a JSON line ({error})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{number}: a JSON {_json_type(record)}, not an object with a text field "
                             f"{field!r}")
        if field not in record:
            raise ValueError(f"{file}:{number}: no text field {field!r} (it has "
                             f"{', '.join(map(repr, list(record)[:8]))}; give --field)")
        if not isinstance(record[field], str):
            raise ValueError(f"{file}:{number}: field {field!r} is a {_json_type(record[field])}, not a string")
        yield from _cut_document(record[field], len(line), f"{file}:{number}", piece_chars)


def _cut_document(text: str, size: int, where: str, piece_chars: int) -> Iterator[Piece]:
    """``text``'s pieces, the first standing for ``size`` bytes of input, the last ending the document."""
    parts = list(cut(text, piece_chars))
    for i, part in enumerate(parts):
        yield Piece(part, size if i == 0 else 0, i == len(parts) - 1, where)


def _text_pieces(handle, file: Path, piece_chars: int) -> Iterator[Piece]:
    """A .txt's paragraphs, read at most ``piece_chars`` bytes at a time: a line without a break is never
    held whole. Whitespace at a line's start is held until the line shows text (a line of whitespace is
    blank: it ends a document), at most ``piece_chars`` characters of it (more is text)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    number = first = 1              # the line being read; where the document being read starts
    parts, chars = [], 0            # the document's text not given out yet
    line, line_chars = [], 0        # the line's text while it holds only whitespace
    blank, started, size = True, False, 0    # the line so far; pieces of the document given out; bytes not yet
    while True:
        chunk = handle.readline(piece_chars)
        try:
            text = decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            raise ValueError(f"{file}:{number}: not UTF-8 text") from None
        size += len(chunk)
        if blank:
            line.append(text)
            line_chars += len(text)
            if text.strip() or line_chars > piece_chars:
                if not parts and not started:
                    first = number
                blank = False
                parts += line
                chars += line_chars
        else:
            parts.append(text)
            chars += len(text)
        if chunk.endswith(b"\n") or not chunk:
            if (blank or not chunk) and (parts or started):    # a blank line, or the file's end: the document ends
                for part in _cut_document(_without_line_end("".join(parts)), size, f"{file}:{first}", piece_chars):
                    yield part
                parts, chars, started, size = [], 0, False, 0
            line, line_chars, blank = [], 0, True
            number += 1
        # a cut depends only on the first piece_chars + 1 characters, so it falls where one pass over the
        # whole text puts it; the 2 spare characters are a last line's end, which the document does not keep
        while chars > piece_chars + 2:
            whole = "".join(parts)
            part = next(cut(whole, piece_chars))
            yield Piece(part, size, False, f"{file}:{first}")
            parts, chars, started, size = [whole[len(part):]], len(whole) - len(part), True, 0
        if not chunk:
            break
    if size:                                          # blank lines after the last document
        yield Piece("", size, True, f"{file}:{number - 1}")


def _without_line_end(text: str) -> str:
    """A .txt document: its lines as the file has them, without the line end of the last."""
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
