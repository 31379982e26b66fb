"""``par4d inspect`` (docs/data.md): a run's checkpoints verified, the one a resume takes marked, its data and
tokenizer checked against what the run recorded; a checkpoint alone; a dataset's tokenizer and shards verified.
Exit status 1 when anything is damaged or changed, 2 when the folder is none of these."""

import os

from par4d.cli import main
from tests.helpers import PARAGRAPHS, bpe_tokenizer, checked_config, train_alone


def test_inspect_says_what_a_resume_would_take_and_what_changed(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"line {i}: some words to learn" for i in range(200)))
    run = tmp_path / "run"
    train_alone(checked_config("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "8",
                               "--seq-len", "16", "--steps", "2", "--save-every", "1", "--no-progress",
                               "--peak-flops", "1e11", "--nproc", "1", "--bucket-mb", "0.5",
                               "--data", str(text), "--out", str(run), world=1))
    capsys.readouterr()
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step-00000002  intact  <- --resume goes on from here" in out and "step-00000001  intact\n" in out
    assert f"data       {text}: the same as recorded" in out and "tokenizer  bytes (256 tokens)" in out
    assert "step       2 of 2" in out and "grid       x=1 y=1 z=1 data=1 pipe=1" in out
    assert "overlap all, gradient buckets of 0.5 MB, seed 0" in out
    with open(run / "checkpoints" / "step-00000002" / "rank-00000.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    assert main(["inspect", str(run)]) == 1                   # a damaged checkpoint
    out = capsys.readouterr().out
    assert "step-00000002  UNUSABLE: " in out and "step-00000001  intact  <- --resume goes on from here" in out
    assert f"data       {text}: the same as recorded" in out
    text.write_text(text.read_text() + "more")
    assert main(["inspect", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"data       {text}: CHANGED" in out and "step       1 of 2" in out
    assert main(["inspect", str(run / "checkpoints" / "step-00000001")]) == 0
    assert "intact (every file's SHA-256 and every tensor checked)" in capsys.readouterr().out
    assert main(["inspect", str(run / "checkpoints" / "step-00000002")]) == 1
    assert "checkpoint " in (out := capsys.readouterr().out) and ": UNUSABLE: " in out
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"par4d inspect: error: {tmp_path / 'nowhere'} does not exist: give a run, " \
                                      f"checkpoint or dataset folder\n"
    os.mkfifo(tmp_path / "fifo")
    for given, kind in ((text, "is a file"), (tmp_path / "fifo", "is a FIFO (named pipe)")):
        assert main(["inspect", str(given)]) == 2
        assert f"{given} {kind}: give a run, checkpoint or dataset folder" in capsys.readouterr().err


def test_inspect_verifies_a_datasets_tokenizer_and_shards(tmp_path, capsys):
    from par4d.data.prepare import prepare
    from par4d.data.tokenizer import load_tokenizer

    (tmp_path / "in.txt").write_text("\n\n".join(PARAGRAPHS))
    index = prepare([str(tmp_path / "in.txt")], load_tokenizer(bpe_tokenizer(tmp_path / "tok")), tmp_path / "ds",
                    shard_tokens=800, progress=False)
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "intact (its tokenizer the index's; every shard's SHA-256 and ids checked)" in out
    assert f"{index['splits']['train']['tokens']:,} tokens" in out
    shards = [s["name"] for s in index["splits"]["train"]["shards"]]
    with open(tmp_path / "ds" / shards[0], "r+b") as f:      # an id beyond the vocabulary, at token 2
        f.seek(4)
        f.write(b"\xff\xff")
    with open(tmp_path / "ds" / shards[1], "r+b") as f:      # another id in the vocabulary
        f.write(b"\x01\x00" if f.read(2) != b"\x01\x00" else b"\x02\x00")
    (tmp_path / "ds" / "tokenizer.json").write_bytes(bpe_tokenizer(tmp_path / "other", vocab=280).read_bytes())
    assert main(["inspect", str(tmp_path / "ds")]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED (3 problems)" in out and "its tokenizer.json has SHA-256 " in out
    assert f"shard {shards[0]} holds token id 65535 at token 2, not below the vocabulary of 300" in out
    assert f"shard {shards[1]}: its SHA-256 is not the index's" in out
    (tmp_path / "ds" / "index.json").write_text("{}")
    assert main(["inspect", str(tmp_path / "ds")]) == 2
    assert "index.json is not a par4d dataset index" in capsys.readouterr().err
