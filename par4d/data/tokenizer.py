"""A Hugging Face tokenizer, through the ``tokenizers`` library: ``--tokenizer PATH`` names a
``tokenizer.json`` or a folder holding one (a model folder). Its SHA-256 names it: a run and a dataset
record it, and a resume or a dataset made with another one is refused. A file is only ever parsed as
JSON by ``tokenizers`` (nothing executed)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from par4d.folder import path_kind

FILE = "tokenizer.json"
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")   # a document's end, where the vocabulary has one


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: its file, the SHA-256 of its bytes, its vocabulary size (one more than its
    largest id), and the id that ends a document (None if its vocabulary has none of :data:`END_OF_TEXT`)."""

    path: str
    sha256: str
    vocab: int
    eos: int | None
    backend: object                  # tokenizers.Tokenizer
    data: bytes                      # the file's bytes, as hashed (a dataset keeps this copy)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (``tokenizers`` encodes a batch on all cores), no special tokens added.
        Raises ``ValueError`` naming the file where the tokenizer cannot encode a text (a WordLevel model
        without an unknown token meeting a word outside its vocabulary)."""
        try:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        except Exception as error:       # tokenizers raises a bare Exception
            raise ValueError(f"the tokenizer {self.path} cannot encode the text ({_first_line(error)})") from None

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names (itself, or the one inside a folder); raises naming it."""
    path = Path(path).absolute()
    if path.is_dir():
        if not (path / FILE).is_file():
            raise ValueError(f"--tokenizer {path}: the folder holds no {FILE}")
        return path / FILE
    if not path.is_file():
        raise ValueError(f"--tokenizer {path} {path_kind(path)}: give a {FILE} or a folder holding one")
    return path


def load_tokenizer(path: str | Path, sha256: str | None = None) -> Tokenizer:
    """The tokenizer at ``path`` (a file or a folder with ``tokenizer.json``), checked to be one and, given
    ``sha256``, to be the very file a run or dataset was made with. Raises ``ValueError`` naming the file."""
    file = tokenizer_file(path)
    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise ValueError(f"--tokenizer {file}: its SHA-256 is {digest[:12]}..., but {sha256[:12]}... was recorded "
                         f"(another tokenizer: its token ids would mean other text)")
    try:
        return parse_tokenizer(data, str(file))
    except ValueError as error:
        raise ValueError(f"--tokenizer {error}") from None


def parse_tokenizer(data: bytes, path: str) -> Tokenizer:
    """The tokenizer whose ``tokenizer.json`` bytes are ``data`` (read from ``path``, which messages name)."""
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_str(data.decode("utf-8"))
    except (UnicodeDecodeError, Exception) as error:      # tokenizers raises its own Exception subclass
        raise ValueError(f"{path} is not a Hugging Face tokenizer file ({_first_line(error)[:200]})") from None
    # The largest id bounds the ids it gives: its count of tokens does not where the ids have gaps.
    vocab = max(backend.get_vocab_size(with_added_tokens=True),
                max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
    if vocab < 2:
        raise ValueError(f"{path}: a vocabulary of {vocab} tokens")
    eos = next((backend.token_to_id(t) for t in END_OF_TEXT if backend.token_to_id(t) is not None), None)
    return Tokenizer(path, hashlib.sha256(data).hexdigest(), vocab, eos, backend, data)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
