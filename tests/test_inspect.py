"""``par4d inspect`` (docs/data.md): a run's checkpoints verified, the one a resume takes marked, its data and
tokenizer checked against what the run recorded; a checkpoint alone; a dataset's shards verified."""

from par4d.cli import main
from tests.helpers import PARAGRAPHS, bpe_tokenizer, checked_config, train_alone


def test_inspect_says_what_a_resume_would_take_and_what_changed(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"line {i}: some words to learn" for i in range(200)))
    run = tmp_path / "run"
    train_alone(checked_config("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "8",
                               "--seq-len", "16", "--steps", "2", "--save-every", "1", "--no-progress", "--nproc", "1",
                               "--data", str(text), "--out", str(run), world=1))
    capsys.readouterr()
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step-00000002  intact  <- --resume goes on from here" in out and "step-00000001  intact\n" in out
    assert f"data       {text}: the same as recorded" in out and "tokenizer  bytes (256 tokens)" in out
    assert "step       2 of 2" in out and "grid       x=1 y=1 z=1 data=1 pipe=1" in out
    with open(run / "checkpoints" / "step-00000002" / "rank-00000.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    text.write_text(text.read_text() + "more")
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step-00000002  UNUSABLE: " in out and "step-00000001  intact  <- --resume goes on from here" in out
    assert f"data       {text}: CHANGED" in out and "step       1 of 2" in out
    assert main(["inspect", str(run / "checkpoints" / "step-00000001")]) == 0
    assert "intact (every file's SHA-256 and every tensor checked)" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2


def test_inspect_verifies_a_datasets_shards(tmp_path, capsys):
    from par4d.data.prepare import prepare
    from par4d.data.tokenizer import load_tokenizer

    (tmp_path / "in.txt").write_text("\n\n".join(PARAGRAPHS))
    index = prepare([str(tmp_path / "in.txt")], load_tokenizer(bpe_tokenizer(tmp_path / "tok")), tmp_path / "ds",
                    shard_tokens=800, progress=False)
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "every shard intact" in out and f"{index['splits']['train']['tokens']:,} tokens" in out
    shard = index["splits"]["train"]["shards"][0]["name"]
    with open(tmp_path / "ds" / shard, "r+b") as f:
        f.write(b"\xff\xff")
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    assert f"DAMAGED shards: {shard}" in capsys.readouterr().out
