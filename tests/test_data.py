"""Tokenizers, ``par4d data prepare`` and datasets that stream (docs/data.md): a BPE tokenizer trained here
on the spot (no download); prepared folders hold exactly the inputs' documents' tokens in order; preparing
goes on after an interruption to the same bytes; each rank reads only its rows, and the rows of every
grid are shares of the same global batch; bad input named before anything starts."""

import errno
import hashlib
import json
import os
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from par4d.cli import main
from par4d.data import inputs as reading
from par4d.data import prepare as prep
from par4d.data.dataset import open_dataset, verify
from par4d.data.tokenizer import load_tokenizer
from par4d.folder import Folder
from par4d.grid import Grid
from par4d.train.data import Batches
from tests.helpers import PARAGRAPHS, bpe_tokenizer, checked_config, run_losses, train_alone, train_pooled


@pytest.fixture
def inputs(tmp_path):
    """A tokenizer, a .txt of the first 100 paragraphs, a .jsonl of the next 100, a .parquet of the last."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = bpe_tokenizer(tmp_path / "tok")
    text = tmp_path / "in" / "a.txt"
    text.parent.mkdir()
    text.write_text("\n\n".join(PARAGRAPHS[:100]) + "\n")
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in PARAGRAPHS[100:200]))
    pq.write_table(pa.table({"text": PARAGRAPHS[200:], "n": list(range(100))}), tmp_path / "in" / "c.parquet")
    return tok, tmp_path / "in"


def _expected(tok, share: float) -> dict[str, list[int]]:
    """Each split's tokens as preparing must lay them out: documents in input order, each followed by EOS."""
    out = {"train": [], "val": []}
    for paragraph, ids in zip(PARAGRAPHS, tok.encode(PARAGRAPHS)):
        out["val" if prep.in_validation(paragraph, share) else "train"] += [*ids, tok.eos]
    return out


def _expected_documents(tok) -> np.ndarray:
    """The train split's document of every token: the paragraph (of those in it) it came from."""
    lengths = [len(ids) + 1 for paragraph, ids in zip(PARAGRAPHS, tok.encode(PARAGRAPHS))
               if not prep.in_validation(paragraph, 0.05)]
    return np.repeat(np.arange(len(lengths)), lengths)


def _split_tokens(folder: Path, split: str) -> list[int]:
    index = json.loads((folder / "index.json").read_text())
    return np.concatenate([np.fromfile(folder / s["name"], dtype="<u2")
                           for s in index["splits"][split]["shards"]]).tolist()


def test_a_tokenizer_is_loaded_from_a_file_or_a_folder_and_a_bad_one_is_named(tmp_path):
    path = bpe_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(path)
    assert (tok.vocab, tok.eos) == (300, 0) and load_tokenizer(path.parent).sha256 == tok.sha256
    assert tok.decode(tok.encode(["Paragraph 7: word49"])[0]) == "Paragraph 7: word49"
    with pytest.raises(ValueError, match="another tokenizer"):
        load_tokenizer(path, "0" * 64)
    (tmp_path / "bad.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match="bad.json is not a Hugging Face tokenizer file"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="the folder holds no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_prepare_lays_out_every_document_in_order_in_shards(inputs, tmp_path):
    tok_path, folder = inputs
    tok = load_tokenizer(tok_path)
    index = prep.prepare([str(folder)], tok, tmp_path / "ds", shard_tokens=700, progress=False)
    want = _expected(tok, 0.05)
    assert {s: _split_tokens(tmp_path / "ds", s) for s in ("train", "val")} == want
    assert index["splits"]["val"]["documents"] + index["splits"]["train"]["documents"] == 300
    assert index["splits"]["val"]["tokens"] == len(want["val"]) > 0 and index["dtype"] == "u2"
    shards = index["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["tokens"] < 700 + 600 for s in shards)   # a shard ends at a document's end
    assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert verify(tmp_path / "ds") == []
    first = int(np.fromfile(tmp_path / "ds" / shards[1]["name"], dtype="<u2", count=1)[0])
    with open(tmp_path / "ds" / shards[1]["name"], "r+b") as f:    # another id, in the vocabulary: its checksum
        f.write(np.array([(first + 1) % 300], dtype="<u2").tobytes())
    assert verify(tmp_path / "ds") == [f"shard {shards[1]['name']}: its SHA-256 is not the index's"]


def test_a_dataset_knows_where_every_document_starts(inputs, tmp_path):
    """Every shard's .ends: a token's document (the documents ended at or before it) is the paragraph it came
    from, across shard boundaries and in windows read anywhere; a damaged ends file is named by verify; a
    dataset an earlier par4d made (no ends) trains but cannot mask documents."""
    tok_path, folder = inputs
    tok = load_tokenizer(tok_path)
    prep.prepare([str(folder)], tok, tmp_path / "ds", shard_tokens=700, progress=False)
    dataset = open_dataset(tmp_path / "ds", 16)
    assert dataset.documents_marked
    train = dataset.splits["train"]
    want = _expected_documents(tok)
    assert train.documents(slice(0, len(train))).tolist() == want.tolist()
    begins = np.searchsorted(want, want, side="left")     # each token's document's first token
    for start in (0, 695, 1234, len(train) - 40):        # windows across shard ends too
        assert train.documents(slice(start, start + 40)).tolist() == want[start:start + 40].tolist()
        assert train.document_starts(slice(start, start + 40)).tolist() == begins[start:start + 40].tolist()
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    shard = index["splits"]["train"]["shards"][1]
    ends = tmp_path / "ds" / shard["name"].replace(".bin", ".ends")
    ends.write_bytes(ends.read_bytes()[:-8] + np.array([3], dtype="<u8").tobytes())
    assert verify(tmp_path / "ds") == [f"{ends.name}: its SHA-256 is not the index's"]
    for split in ("train", "val"):                       # as an earlier par4d wrote it
        for record in index["splits"][split]["shards"]:
            del record["ends"], record["ends_sha256"]
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    old = open_dataset(tmp_path / "ds", 16)
    assert not old.documents_marked and len(old.splits["train"][0:16]) == 16
    with pytest.raises(ValueError, match="records no document ends .an earlier par4d prepared it"):
        old.splits["train"].documents(slice(0, 16))


def test_an_interrupted_prepare_goes_on_to_the_same_bytes_and_is_never_taken_for_finished(inputs, tmp_path):
    tok_path, folder = inputs
    tok = load_tokenizer(tok_path)
    calls = {"n": 0}
    flush = prep._Writer.flush

    def dies(writer):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        flush(writer)

    with mock.patch.object(prep, "ENCODE_BATCH", 16), mock.patch.object(prep._Writer, "flush", dies):
        with pytest.raises(KeyboardInterrupt):
            prep.prepare([str(folder)], tok, tmp_path / "ds", shard_tokens=700, progress=False)
    assert not (tmp_path / "ds" / "index.json").exists() and (tmp_path / "ds" / "progress.json").exists()
    with pytest.raises(ValueError, match="no index.json, so not a finished dataset"):
        open_dataset(tmp_path / "ds", 16)
    record = json.loads((tmp_path / "ds" / "progress.json").read_text())
    # the shard the stopped flush was writing is par4d's and written again; a shard nothing lists is a user's
    (tmp_path / "ds" / prep.shard_name("train", len(record["shards"]["train"]))).write_bytes(b"left by the stop")
    (tmp_path / "ds" / "train-00099.bin").write_bytes(b"mine")
    with pytest.raises(ValueError, match="holds train-00099.bin, a shard file par4d's index.json or progress.json "
                                         "does not list"):
        prep.prepare([str(folder)], tok, tmp_path / "ds", shard_tokens=700, progress=False)
    assert (tmp_path / "ds" / "train-00099.bin").read_bytes() == b"mine"
    assert json.loads((tmp_path / "ds" / "progress.json").read_text()) == record
    (tmp_path / "ds" / "train-00099.bin").rename(tmp_path / "mine.bin")
    lines = []
    with mock.patch.object(prep, "ENCODE_BATCH", 16):
        prep.prepare([str(folder)], tok, tmp_path / "ds", shard_tokens=700, progress=False, say=lines.append)
    assert len(lines) == 1 and re.match(r"going on from a\.txt, document [1-9]\d* \([\d,]+ tokens already in ",
                                        lines[0])
    assert {s: _split_tokens(tmp_path / "ds", s) for s in ("train", "val")} == _expected(tok, 0.05)
    train = open_dataset(tmp_path / "ds", 16).splits["train"]             # its documents' ends too
    assert train.documents(slice(0, len(train))).tolist() == _expected_documents(tok).tolist()
    assert not (tmp_path / "ds" / "progress.json").exists()
    with pytest.raises(ValueError, match="holds a dataset already"):
        prep.prepare([str(folder)], tok, tmp_path / "ds", progress=False)


def test_bad_inputs_are_named_and_nothing_is_taken_for_another_run(inputs, tmp_path):
    tok_path, folder = inputs
    tok = load_tokenizer(tok_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        prep.prepare([str(tmp_path / "bad.jsonl")], tok, tmp_path / "ds1", progress=False)
    (tmp_path / "other.jsonl").write_text('{"body": "fine"}\n')
    with pytest.raises(ValueError, match=r"other.jsonl:1: no text field 'text' \(it has 'body'; give --field\)"):
        prep.prepare([str(tmp_path / "other.jsonl")], tok, tmp_path / "ds2", progress=False)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="give .txt, .jsonl or .parquet files"):
        prep.prepare([str(tmp_path / "x.csv")], tok, tmp_path / "ds3", progress=False)
    with pytest.raises(ValueError, match="no column 'body'"):
        prep.prepare([str(folder / "c.parquet")], tok, tmp_path / "ds4", field="body", progress=False)
    flush, calls = prep._Writer.flush, []

    def dies(writer):                       # the second flush stopped: one shard of these inputs made
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        flush(writer)

    with mock.patch.object(prep, "ENCODE_BATCH", 16), mock.patch.object(prep._Writer, "flush", dies):
        with pytest.raises(KeyboardInterrupt):
            prep.prepare([str(folder)], tok, tmp_path / "ds5", shard_tokens=50, progress=False)
    with pytest.raises(ValueError, match="holds an unfinished dataset of other inputs or settings"):
        prep.prepare([str(folder / "a.txt")], tok, tmp_path / "ds5", progress=False)


def test_prepare_loses_nothing_a_user_saved(inputs, tmp_path):
    tok_path, folder = inputs
    tok = load_tokenizer(tok_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.bin").write_bytes(b"mine")
    with pytest.raises(ValueError, match="is not empty and holds no dataset of par4d data prepare"):
        prep.prepare([str(folder)], tok, tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.bin").read_bytes() == b"mine"
    first = prep.prepare([str(folder)], tok, tmp_path / "ds", progress=False)
    again = prep.prepare([str(folder)], load_tokenizer(tmp_path / "ds"), tmp_path / "ds", force=True, progress=False)
    assert again["splits"] == first["splits"]     # its own tokenizer.json, read before the folder was cleared


def test_each_rank_reads_only_its_rows_and_every_grid_shares_one_global_batch(inputs, tmp_path):
    tok_path, folder = inputs
    prep.prepare([str(folder)], load_tokenizer(tok_path), tmp_path / "ds", shard_tokens=500, progress=False)
    dataset = open_dataset(tmp_path / "ds", 16)
    train = dataset.splits["train"]
    read = []

    class Counted:
        def __len__(self):
            return len(train)

        def __getitem__(self, window):
            read.append(window.stop - window.start)
            return train[window]

    batches = Batches.from_splits(Counted(), dataset.splits["val"], 16, 8, seed=3)
    for sizes in ({"data": 2, "z": 2}, {"x": 2, "z": 2}, {"data": 4}, {"y": 2, "data": 2}):
        world = int(np.prod(list(sizes.values())))
        for step in (0, 5):
            whole = batches.train_batch(step)
            read.clear()
            parts = [batches.local_batch(Grid.virtual(sizes, rank), "train", step) for rank in range(world)]
            shards = {}
            for rank, part in enumerate(parts):
                grid = Grid.virtual(sizes, rank)
                shards[(grid.coord("data"), grid.coord("z"))] = part
            rows = [shards[key] for key in sorted(shards)]
            for i in range(2):
                assert torch.equal(torch.cat([r[i] for r in rows]), whole[i]), (sizes, step)
            per_rank = 8 // (sizes.get("data", 1) * sizes.get("z", 1))
            assert read == [17] * per_rank * world      # each rank read its own windows, and nothing more
    # windows cross shard boundaries exactly as the concatenation of the shards has them
    assert train[490:510].tolist() == _split_tokens(tmp_path / "ds", "train")[490:510]
    # shards are mapped as they are read, a bounded number at a time (a file descriptor each)
    whole = _split_tokens(tmp_path / "ds", "train")
    with mock.patch("par4d.data.dataset.MAPPED", 2):
        fresh = open_dataset(tmp_path / "ds", 16).splits["train"]
        assert len(fresh.names) > 3 and not fresh.mapped
        assert [t for a in range(0, len(whole), 123) for t in fresh[a:a + 123].tolist()] == whole
        assert len(fresh.mapped) == 2


def test_par4d_data_prepare_and_train_resume_on_another_grid(inputs, tmp_path, capsys, pool4):
    tok_path, folder = inputs
    assert main(["data", "prepare", str(folder), "--tokenizer", str(tok_path.parent), "--out", str(tmp_path / "ds"),
                 "--shard-tokens", "600", "--no-progress"]) == 0
    assert "prepared" in capsys.readouterr().out
    common = ["--data", str(tmp_path / "ds"), "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
              "--batch-size", "8", "--seq-len", "16", "--no-progress", "--peak-flops", "1e11"]
    alone, piped = tmp_path / "alone", tmp_path / "grid"
    config = checked_config("--nproc", "1", *common, "--steps", "6", "--out", str(alone), world=1)
    assert config.vocab_size == 300 and config.tokenizer == str(tmp_path / "ds" / "tokenizer.json")
    assert config.tokenizer_sha256 == hashlib.sha256((tmp_path / "ds" / "tokenizer.json").read_bytes()).hexdigest()
    train_alone(config)
    train_pooled(pool4, "--grid", "x=2,z=2", *common, "--steps", "4", "--out", str(piped))
    train_pooled(pool4, "--resume", str(piped), "--grid", "z=2,data=2", "--steps", "6")
    assert run_losses(piped) == pytest.approx(run_losses(alone), rel=1e-5)
    assert run_losses(alone)[0] == pytest.approx(np.log(300), abs=0.1)
    # a resume with another tokenizer, a dataset of another one, an unfinished folder: refused before any rank
    other = bpe_tokenizer(tmp_path / "other", vocab=280)
    assert main(["train", "--resume", str(piped), "--tokenizer", str(other), "--steps", "8"]) == 2
    assert "is not the run's tokenizer" in capsys.readouterr().err
    assert main(["train", *common, "--tokenizer", str(other), "--out", str(tmp_path / "r2")]) == 2
    assert "was prepared with another tokenizer than --tokenizer" in capsys.readouterr().err
    (tmp_path / "unfinished").mkdir()
    assert main(["train", *common[2:], "--data", str(tmp_path / "unfinished"), "--out", str(tmp_path / "r3")]) == 2
    assert "no index.json, so not a finished dataset" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["train", *common[2:], "--tokenizer", str(tmp_path / "bad.json"), "--out", str(tmp_path / "r4")]) == 2
    assert "bad.json is not a Hugging Face tokenizer file" in capsys.readouterr().err
    swapped, _ = _dataset(inputs, tmp_path, "swapped")             # its tokenizer.json is not the index's
    (swapped / "tokenizer.json").write_bytes(other.read_bytes())
    assert main(["train", *common[2:], "--data", str(swapped), "--out", str(tmp_path / "r5")]) == 2
    assert "swapped: its tokenizer.json has SHA-256 " in capsys.readouterr().err
    assert not any((tmp_path / r).exists() for r in ("r2", "r3", "r4", "r5"))


def _dataset(inputs, tmp_path, name: str = "ds") -> tuple[Path, dict]:
    tok_path, folder = inputs
    index = prep.prepare([str(folder)], load_tokenizer(tok_path), tmp_path / name, shard_tokens=700, progress=False)
    return tmp_path / name, index


def _edit_index(folder: Path, change) -> None:
    index = json.loads((folder / "index.json").read_text())
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


def test_a_dataset_is_what_its_index_says(inputs, tmp_path):
    tok_path, _ = inputs
    ds, index = _dataset(inputs, tmp_path)
    dataset = open_dataset(ds, 16)
    assert dataset.tokenizer_sha256 == hashlib.sha256((ds / "tokenizer.json").read_bytes()).hexdigest()
    assert (dataset.vocab, dataset.tokenizer.eos) == (300, 0)
    # a tokenizer.json swapped for another: refused on opening, named by verify
    swapped, _ = _dataset(inputs, tmp_path, "swapped")
    (swapped / "tokenizer.json").write_bytes(bpe_tokenizer(tmp_path / "other", vocab=280).read_bytes())
    with pytest.raises(ValueError, match=r"swapped: its tokenizer.json has SHA-256 \w{12}\.\.\., the index.json "
                                         r"recorded \w{12}\.\.\. \(another tokenizer"):
        open_dataset(swapped, 16)
    assert [line.split(" has SHA-256")[0] for line in verify(swapped)] == ["its tokenizer.json"]
    (swapped / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="swapped: its tokenizer.json is missing"):
        open_dataset(swapped, 16)
    # the index's vocabulary and end-of-text id against the tokenizer's
    _edit_index(ds, lambda i: i["tokenizer"].update(vocab=10))
    with pytest.raises(ValueError, match="its index.json says a vocabulary of 10, its tokenizer.json has 300"):
        open_dataset(ds, 16)
    _edit_index(ds, lambda i: i["tokenizer"].update(vocab=300, eos=99999))
    with pytest.raises(ValueError, match=r"index.json is damaged \(ValueError: end-of-text id 99999, not below the "
                                         r"vocabulary of 300\)"):
        open_dataset(ds, 16)
    _edit_index(ds, lambda i: i["tokenizer"].update(eos=5))
    with pytest.raises(ValueError, match="its index.json says end-of-text id 5, its tokenizer.json's is 0"):
        open_dataset(ds, 16)
    _edit_index(ds, lambda i: i["tokenizer"].update(eos=0))
    # a shard overwritten with 0xFF bytes after its 3rd token: opening sees its size only; a window read names
    # the shard, the offset and the id
    name = index["splits"]["train"]["shards"][1]["name"]
    kept = (ds / name).read_bytes()[:6]
    (ds / name).write_bytes(kept + b"\xff" * ((ds / name).stat().st_size - 6))
    train = open_dataset(ds, 16).splits["train"]
    start = index["splits"]["train"]["shards"][0]["tokens"]
    assert len(train[start - 5:start]) == 5
    with pytest.raises(ValueError, match=rf"shard {name} holds token id 65535 at token 3, not below the vocabulary "
                                         rf"of 300 \(damaged: par4d inspect checks every shard\)"):
        train[start - 5:start + 10]
    batches = Batches.from_splits(train, open_dataset(ds, 16).splits["val"], 16, 64, seed=0)
    with pytest.raises(ValueError, match=rf"shard {name} holds token id 65535"):   # not an IndexError in a step
        batches.train_batch(0)
    assert verify(ds) == [f"shard {name} holds token id 65535 at token 3, not below the vocabulary of 300"]


def _paragraphs(data: bytes) -> list[str]:
    """The documents of a .txt, read whole: what reading it a bounded part at a time must give."""
    documents, paragraph = [], []
    for line in data.decode("utf-8").splitlines(keepends=True):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            documents.append(reading._without_line_end("".join(paragraph)))
            paragraph = []
    return documents + ([reading._without_line_end("".join(paragraph))] if paragraph else [])


def test_a_txt_is_read_in_bounded_pieces_that_make_its_documents(tmp_path):
    long = " ".join(f"wörd{i % 50}€" for i in range(300))            # several bounds long, no line break
    data = ("\n  \n" + long + "\r\nsecond line  \n\n\n  indented\nshort\n\n" + "x" * 200 + "\n \t\n" + long).encode()
    (tmp_path / "a.txt").write_bytes(data)
    for bound in (7, 64, 300, 1 << 18):
        documents, cuts = [], []
        for piece in reading.pieces(tmp_path / "a.txt", "text", bound):
            cuts.append(piece.text)
            if piece.last:
                documents.append(cuts)
                cuts = []
        # read a part at a time, cut where cutting the whole text cuts
        assert [c for c in documents if c != [""]] == [list(reading.cut(d, bound)) for d in _paragraphs(data)], bound
        assert sum(p.size for p in reading.pieces(tmp_path / "a.txt", "text", bound)) == len(data)
    cut = list(reading.cut(long, 64))
    assert "".join(cut) == long and all(p[0] == " " for p in cut[1:])        # cut before a space
    assert list(reading.cut("x" * 200, 64)) == ["x" * 64] * 3 + ["x" * 8]       # none: at the bound
    # a line of 4 MB is never held whole
    import tracemalloc

    size = (tmp_path / "line.txt").write_text(" ".join(f"word{i % 50}" for i in range(600_000)))
    tracemalloc.start()
    count = sum(1 for _ in reading.pieces(tmp_path / "line.txt", "text", 1024))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count >= size // 1024 and peak < 100_000, peak


def test_a_long_document_tokenizes_as_one_pass_within_a_bounded_batch(inputs, tmp_path):
    tok_path, _ = inputs
    tok = load_tokenizer(tok_path)
    long = " ".join(f"word{(i * 7) % 50}" for i in range(2000))          # ~14,000 characters, no line break
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "a.txt").write_text(long + "\n\n" + "\n\n".join(PARAGRAPHS) + "\n")
    (tmp_path / "long" / "b.jsonl").write_text(json.dumps({"text": long + " again"}) + "\n")
    texts = []
    encode = prep.Tokenizer.encode

    def recorded(self, batch):
        texts.append([len(t) for t in batch])
        return encode(self, batch)

    with mock.patch.object(prep.Tokenizer, "encode", recorded):
        prep.prepare([str(tmp_path / "long")], tok, tmp_path / "ds", shard_tokens=500, progress=False,
                     piece_chars=256)
    assert max(max(t) for t in texts) <= 256 and max(sum(t) for t in texts) <= prep.ENCODE_PIECES * 256 + 256
    # stopped inside the long document (its third shard's worth), preparing goes on from the piece it recorded
    flush, calls = prep._Writer.flush, {"n": 0}

    def dies(writer):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        flush(writer)

    with mock.patch.object(prep._Writer, "flush", dies), pytest.raises(KeyboardInterrupt):
        prep.prepare([str(tmp_path / "long")], tok, tmp_path / "ds2", shard_tokens=500, progress=False,
                     piece_chars=256)
    at = json.loads((tmp_path / "ds2" / "progress.json").read_text())["next"]
    assert at[:2] == [0, 0] and at[2] > 0                 # the first input's first document, pieces into it
    prep.prepare([str(tmp_path / "long")], tok, tmp_path / "ds2", shard_tokens=500, progress=False, piece_chars=256,
                 say=lambda line: None)
    assert (tmp_path / "ds2" / "index.json").read_bytes() == (tmp_path / "ds" / "index.json").read_bytes()
    want = {"train": [], "val": []}
    for document in [long, *PARAGRAPHS, long + " again"]:               # one pass each; the split: the first piece's
        split = "val" if prep.in_validation(next(reading.cut(document, 256)), 0.05) else "train"
        want[split] += [*tok.encode([document])[0], tok.eos]
    assert {s: _split_tokens(tmp_path / "ds", s) for s in ("train", "val")} == want
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["piece_chars"] == 256 and index["splits"]["train"]["documents"] + index["splits"]["val"][
        "documents"] == 302
    assert verify(tmp_path / "ds") == []


def test_a_full_disk_is_one_line_and_the_same_command_goes_on(inputs, tmp_path, capsys):
    tok_path, folder = inputs
    command = ["data", "prepare", str(folder), "--tokenizer", str(tok_path), "--out", str(tmp_path / "ds"),
               "--shard-tokens", "700", "--no-progress"]
    write_with = Folder.write_with

    def full_at(name: str):
        """Folder.write_with, the disk full halfway through writing ``name``."""
        def writing(self, *parts, write, sync=True):
            def half(f):
                f.write(b"half")
                raise OSError(errno.ENOSPC, "No space left on device")
            write_with(self, *parts, write=half if parts[-1] == name else write, sync=sync)
        return writing

    with mock.patch.object(Folder, "write_with", full_at("train-00000.bin")):    # a first run, failed at once
        assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {tmp_path / 'ds' / 'train-00000.bin'} (No space left on " \
                                    f"device); make room and run the same command again" in err
    assert not (tmp_path / "ds").exists()             # no shard made: the folder it made is gone again
    # killed there instead (no time to clean up), the folder holds par4d's files alone: the same command runs
    with mock.patch.object(Folder, "write_with", full_at("train-00000.bin")), \
            mock.patch.object(prep, "_leave_as_found"):
        assert main(command) == 2
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["progress.json", "tokenizer.json"]
    with mock.patch.object(Folder, "write_with", full_at("train-00003.bin")):    # the same command: it runs
        assert main(command) == 2
    assert "train-00003.bin (No space left on device)" in capsys.readouterr().err
    assert main(command) == 0
    assert "going on from a.txt, document " in capsys.readouterr().err
    assert {s: _split_tokens(tmp_path / "ds", s) for s in ("train", "val")} == _expected(load_tokenizer(tok_path), 0.05)
    # a folder an earlier par4d's failed first run left (its tokenizer.json alone) is taken, another's is not
    (tmp_path / "left").mkdir()
    (tmp_path / "left" / "tokenizer.json").write_bytes(tok_path.read_bytes())
    prep.prepare([str(folder)], load_tokenizer(tok_path), tmp_path / "left", progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is not empty and holds no dataset of par4d data prepare \(tokenizer.json"):
        prep.prepare([str(folder)], load_tokenizer(tok_path), tmp_path / "other", progress=False)
    assert (tmp_path / "other" / "tokenizer.json").read_text() == "{}"


def test_force_replaces_only_what_par4d_listed(inputs, tmp_path, capsys):
    tok_path, folder = inputs
    command = ["data", "prepare", str(folder), "--tokenizer", str(tok_path), "--shard-tokens", "700", "--no-progress"]
    # a user's index.json and shard: refused, with --force too, untouched
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "index.json").write_text("{}")
    (tmp_path / "user" / "train-00000.bin").write_bytes(b"mine")
    for force in ([], ["--force"]):
        assert main([*command, "--out", str(tmp_path / "user"), *force]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "user/index.json is not a par4d dataset index" in err
    assert (tmp_path / "user" / "index.json").read_text() == "{}"
    assert (tmp_path / "user" / "train-00000.bin").read_bytes() == b"mine"
    # a finished dataset with a shard of the user's beside its own: refused; without it, --force keeps the rest
    ds, _ = _dataset(inputs, tmp_path)
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    (ds / "train-00099.bin").write_bytes(b"mine")
    (ds / "notes.md").write_text("mine")
    assert main([*command, "--out", str(ds), "--force"]) == 2
    assert "holds train-00099.bin, a shard file par4d's index.json or progress.json does not list" in \
        capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in ds.iterdir() if p.name not in ("train-00099.bin", "notes.md")} == before
    (ds / "train-00099.bin").unlink()
    assert main([*command, "--out", str(ds), "--force"]) == 0
    assert (ds / "notes.md").read_text() == "mine" and verify(ds) == []
    # a progress.json par4d did not write is not a record: refused, with --force too
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "progress.json").write_text('{"next": [0, 0]}')
    assert main([*command, "--out", str(tmp_path / "p"), "--force"]) == 2
    assert "its progress.json is not a record of this par4d's data prepare" in capsys.readouterr().err
    assert (tmp_path / "p" / "progress.json").read_text() == '{"next": [0, 0]}'


def test_bad_input_of_every_kind_is_one_line_naming_it(inputs, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_path, folder = inputs
    out = tmp_path / "ds"

    def refused(*args: str) -> str:
        assert main(["data", "prepare", *args, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("par4d data: error: ") and "Traceback" not in err
        assert not out.exists()                       # nothing left behind
        return err

    words = Tokenizer(models.WordLevel({"Paragraph": 0, "<|endoftext|>": 1}))   # no unknown token
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    assert f"{folder / 'a.txt'}:1: the tokenizer {tmp_path / 'words.json'} cannot encode the text (WordLevel " \
           f"error: Missing [UNK] token" in refused(str(folder / "a.txt"), "--tokenizer", str(tmp_path / "words.json"),
                                                    "--out", str(out))
    common = ["--tokenizer", str(tok_path), "--out", str(out), "--force"]
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    assert f"{tmp_path / 'fake.parquet'} is not a Parquet file (" in refused(str(tmp_path / "fake.parquet"), *common)
    (tmp_path / "n.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    assert f"{tmp_path / 'n.jsonl'}:2: field 'text' is a number, not a string" in refused(str(tmp_path / "n.jsonl"),
                                                                                         *common)
    (tmp_path / "a.jsonl").write_text('["text"]\n')
    assert "a.jsonl:1: a JSON array, not an object with a text field 'text'" in refused(str(tmp_path / "a.jsonl"),
                                                                                        *common)
    os.mkfifo(tmp_path / "fifo")
    assert f"{tmp_path / 'fifo'} is a FIFO (named pipe): give .txt" in refused(str(tmp_path / "fifo"), *common)
    assert "/dev/zero is a character device: give .txt" in refused("/dev/zero", *common)
    assert f"{folder / 'a.txt' / 'b.txt'} does not exist ({folder / 'a.txt'} is a file, not a folder)" in \
        refused(str(folder / "a.txt" / "b.txt"), *common)
    for given, kind in ((folder / "a.txt", "is a file"), (tmp_path / "fifo", "is a FIFO (named pipe)"),
                        (Path("/dev/zero"), "is a character device")):
        assert f"--out {given} {kind}: give a folder" in refused(str(folder), "--tokenizer", str(tok_path), "--out",
                                                                 str(given))
        if kind != "is a file":
            assert f"--tokenizer {given} {kind}: give a tokenizer.json" in refused(str(folder), "--tokenizer",
                                                                                  str(given), "--out", str(out))
    assert (folder / "a.txt").read_text().startswith("Paragraph 0")
