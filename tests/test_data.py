"""Tokenizers, ``par4d data prepare`` and datasets that stream (docs/data.md): a BPE tokenizer trained here
on the spot (no download); prepared folders hold exactly the inputs' documents' tokens in order; preparing
goes on after an interruption to the same bytes; each rank reads only its rows, and the rows of every
grid are shares of the same global batch; bad input named before anything starts."""

import json
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from par4d.cli import main
from par4d.data import prepare as prep
from par4d.data.dataset import open_dataset, verify
from par4d.data.tokenizer import load_tokenizer
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
    with open(tmp_path / "ds" / shards[1]["name"], "r+b") as f:    # a flipped byte is found by its checksum
        f.write(b"\xff")
    assert verify(tmp_path / "ds") == [shards[1]["name"]]


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
    (tmp_path / "ds" / "train-00099.bin").write_bytes(b"left by the interruption")
    lines = []
    with mock.patch.object(prep, "ENCODE_BATCH", 16):
        prep.prepare([str(folder)], tok, tmp_path / "ds", shard_tokens=700, progress=False, say=lines.append)
    assert len(lines) == 1 and re.match(r"going on from a\.txt, document [1-9]\d* \([\d,]+ tokens already in ",
                                        lines[0])
    assert {s: _split_tokens(tmp_path / "ds", s) for s in ("train", "val")} == _expected(tok, 0.05)
    assert not (tmp_path / "ds" / "train-00099.bin").exists() and not (tmp_path / "ds" / "progress.json").exists()
    with pytest.raises(ValueError, match="holds a dataset already"):
        prep.prepare([str(folder)], tok, tmp_path / "ds", progress=False)


def test_bad_inputs_are_named_and_nothing_is_taken_for_another_run(inputs, tmp_path):
    tok_path, folder = inputs
    tok = load_tokenizer(tok_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        prep.prepare([str(tmp_path / "bad.jsonl")], tok, tmp_path / "ds1", progress=False)
    (tmp_path / "other.jsonl").write_text('{"body": "fine"}\n')
    with pytest.raises(ValueError, match=r"other.jsonl:1: no text field 'text' \(give --field\)"):
        prep.prepare([str(tmp_path / "other.jsonl")], tok, tmp_path / "ds2", progress=False)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="give .txt, .jsonl or .parquet files"):
        prep.prepare([str(tmp_path / "x.csv")], tok, tmp_path / "ds3", progress=False)
    with pytest.raises(ValueError, match="no column 'body'"):
        prep.prepare([str(folder / "c.parquet")], tok, tmp_path / "ds4", field="body", progress=False)
    with mock.patch.object(prep, "ENCODE_BATCH", 16), mock.patch.object(prep._Writer, "flush",
                                                                        side_effect=[None, KeyboardInterrupt]):
        with pytest.raises(KeyboardInterrupt):
            prep.prepare([str(folder)], tok, tmp_path / "ds5", shard_tokens=50, progress=False)
    (tmp_path / "ds5" / "progress.json").write_text(json.dumps(
        {**json.loads((tmp_path / "ds5" / "progress.json").read_text()), "next": [0, 16]}))
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
              "--batch-size", "8", "--seq-len", "16", "--no-progress"]
    alone, piped = tmp_path / "alone", tmp_path / "grid"
    config = checked_config("--nproc", "1", *common, "--steps", "6", "--out", str(alone), world=1)
    assert config.vocab_size == 300 and config.tokenizer == str(tmp_path / "ds" / "tokenizer.json")
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
    assert not any((tmp_path / r).exists() for r in ("r2", "r3", "r4"))
