"""Bad input across every command, as an adversary or a new user gives it: each case ends in one line
on stderr naming the thing, a usage error's status (2), no traceback, no file made anywhere, and no hang
(a case still running after HANG_S fails). More specific tests of each class live beside their code
(test_pretrained, test_data, test_settings_file, test_errors); this table keeps the promise in one place."""

import json
import os
import signal
from pathlib import Path

import pytest

from par4d.cli import main

HANG_S = 60     # a bound on a hang, not a timing: each case takes well under a second here


@pytest.fixture
def where(tmp_path, monkeypatch) -> Path:
    """A working folder holding the bad things the cases name."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    Path("file.txt").write_text("hello\n")
    Path("empty").mkdir()
    Path("nested.toml").write_text("[model]\nn_layer = 2\n[model.sizes]\nn_embd = 4\n")
    Path("bogus.toml").write_text('[model]\nmodel = "bogus"\n')
    Path("out.toml").write_text('[checkpoint]\nout = ""\n')
    Path("bad.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    Path("bad.parquet").write_text("not parquet\n")
    Path("unknown.txt").write_text("hello stranger\n")
    _word_level("words.json")
    return tmp_path


def _word_level(path: str) -> None:
    """A WordLevel tokenizer of two words and no unknown token: a word outside them cannot be encoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "<|endoftext|>": 1}))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(path)


# (argv, what the one line says)
CASES = [
    # train: the grid, the numbers, paths that are not what they must be, the config file
    (["train", "--grid", "x=0"], "grid axis x=0 in 'x=0': every axis size must be >= 1"),
    (["train", "--grid", "q=2"], "unknown grid axis 'q'; valid axes are x, y, z, data, pipe"),
    (["train", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["train", "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["train", "--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["train", "--batch-size", "3", "--grid", "z=2", "--nproc", "2"], "--batch-size 3 is not divisible by"),
    (["train", "--data", "/nonexistent"], "--data /nonexistent: no such file"),
    (["train", "--data", "fifo"], "--data fifo is not a file"),
    (["train", "--data", "/dev/zero"], "--data /dev/zero is not a file"),
    (["train", "--data", "empty"], "no index.json, so not a finished dataset"),
    (["train", "--data", "file.txt", "--seq-len", "100"], "--data file.txt has 6 bytes; --seq-len 100 needs"),
    (["train", "--tokenizer", "file.txt"], "is not a Hugging Face tokenizer file"),
    (["train", "--out", "file.txt"], "--out file.txt is a file; give a folder for the run"),
    (["train", "--out", "fifo"], "--out fifo is a file; give a folder for the run"),
    (["train", "--out", ""], "--out '' names no file or folder"),
    (["train", "--resume", "/nonexistent"], "--resume /nonexistent: no such folder"),
    (["train", "--resume", "empty"], "--resume empty is not a par4d run folder"),
    (["train", "--init-from", "hf", "file.txt"], "--init-from hf file.txt: no such folder"),
    (["train", "--init-from", "hf", "empty"], "empty/config.json is missing"),
    (["train", "--config", "file.txt"], "file.txt: not TOML"),
    (["train", "--config", "fifo"], "fifo is not a regular file"),
    (["train", "--config", "nested.toml"], "nested.toml:3"),
    (["train", "--config", "bogus.toml"], "bogus.toml:2: model = 'bogus': give one of"),
    (["train", "--config", "out.toml"], "out.toml:2"),
    # the other commands
    (["inspect", "/nonexistent"], "/nonexistent does not exist"),
    (["inspect", "fifo"], "fifo is a FIFO (named pipe)"),
    (["inspect", "/dev/zero"], "/dev/zero is a character device"),
    (["inspect", "file.txt"], "file.txt is a file"),
    (["inspect", "empty"], "empty is not a par4d run folder"),
    (["export", "--run", "/nonexistent", "--to", "hf", "o"], "--run /nonexistent does not exist"),
    (["export", "--run", "empty", "--to", "hf", "o"], "--run empty is not a par4d run"),
    (["export", "--run", "empty", "--to", "bogus", "o"], "--to bogus: unknown format; valid: hf"),
    (["export", "--run", "empty", "--to", "hf", "o", "--max-shard-mb", "-1"], "--max-shard-mb must be > 0"),
    (["generate", "--run", "empty", "--prompt", "ab\udcff"], "--prompt is not UTF-8 text (byte 0xff at character 2)"),
    (["generate", "--run", "empty", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens 0: give at least 1"),
    (["generate", "--run", "empty", "--prompt", "hi", "--temperature", "inf"], "argument --temperature: inf"),
    (["generate", "--run", "/nonexistent", "--prompt", "hi"], "--run /nonexistent does not exist"),
    (["plan", "--train-tokens", "nan"], "argument --train-tokens: nan: give a finite number above 0"),
    (["plan", "--gpus", "0"], "--gpus and --top must be >= 1 (got 0, 10)"),
    (["plan", "--gpus", "8", "--model", "bogus"], "unknown model 'bogus'"),
    (["plan", "--gpus", "8", "--nodes", "2"], "--nodes: a setting of par4d plan validate; par4d plan does not use"),
    (["plan", "validate", "--link", "1gbit"], "--link 1gbit: the link between emulated nodes; give --nodes too"),
    (["plan", "paper", "--nproc", "3"], "--nproc: a setting of par4d plan validate"),
    (["plan", "validate", "--compile"], "--compile: a setting of par4d plan device; par4d plan validate does not"),
    (["calibrate", "--repeats", "0"], "argument --repeats: 0: give 1 or more"),
    (["calibrate", "--nproc", "-1"], "argument --nproc: -1: give 1 or more"),
    (["calibrate", "--link", "10gbit"], "--link 10gbit: the link between emulated nodes; give --nodes too"),
    (["calibrate", "--out", "fifo"], "--out fifo already exists"),
    (["data", "prepare", "--tokenizer", "/nonexistent", "--out", "d", "file.txt"], "--tokenizer /nonexistent"),
    (["data", "prepare", "--tokenizer", "file.txt", "--out", "d", "file.txt"], "not a Hugging Face tokenizer"),
    (["data", "prepare", "--tokenizer", "words.json", "--out", "d", "bad.jsonl"],
     "bad.jsonl:1: field 'text' is a number, not a string"),
    (["data", "prepare", "--tokenizer", "words.json", "--out", "d", "bad.parquet"], "bad.parquet is not a Parquet"),
    (["data", "prepare", "--tokenizer", "words.json", "--out", "d", "unknown.txt"], "unknown.txt:1"),
    (["data", "prepare", "--tokenizer", "words.json", "--out", "d", "fifo"], "fifo is a FIFO (named pipe)"),
    (["data", "prepare", "--tokenizer", "words.json", "--out", "file.txt", "file.txt"], "is a file: give a folder"),
    (["data", "prepare", "--tokenizer", "words.json", "--out", "d", "file.txt", "--val-share", "2"],
     "--val-share 2.0: give a share between 0 and 1"),
    (["bench", "peers", "--nproc", "0"], "--nproc, --iters and --rounds must be >= 1"),
    (["bench", "moe", "--compile", "tvm"], "argument --compile: invalid choice: 'tvm'"),
    (["bench", "peers", "--model", "hf-mixtral", "--rounds", "0"], "--iters and --rounds must be >= 1 (got 8, 0)"),
    (["train", "--compile", "tvm"], "argument --compile: invalid choice: 'tvm'"),
    (["train", "--float8", "fp4"], "argument --float8: invalid choice: 'fp4'"),
    (["train", "--model", "unet", "--float8", "rowwise"], "--model unet: --float8 rowwise is for par4d's GPT"),
    (["train", "--peak-flops", "0"], "--peak-flops must be a positive number of FLOP/s, got 0.0"),
    (["train", "--bucket-mb", "-1"], "--bucket-mb must be a finite size of at least one byte (2**-20 MB), got -1.0"),
    (["train", "--grid", "auto", "--machine", "h100", "--bucket-mb", "nan"],
     "--bucket-mb must be a finite size of at least one byte (2**-20 MB), got nan"),    # before the planner
    (["plan", "--gpus", "8", "--bucket-mb", "1e308"], "--bucket-mb must be a finite size of at least one byte"),
    (["plan", "--gpus", "8", "--bucket-mb", "1e-9"],
     "--bucket-mb must be a finite size of at least one byte (2**-20 MB), got 1e-09"),
    (["plan", "--gpus", "8", "--variant", "aware", "--bucket-mb", "1"],
     "--pipe, --microbatches, --recompute, --overlap, --bucket-mb"),
    (["bench", "grid", "--nproc", "0"], "--nproc and --iters must be >= 1"),
    (["cluster", "run", "--nodes", "0", "--", "train"], "--nodes and ranks per node must be >= 1"),
    (["cluster", "run", "--nodes", "2", "--link", "bogus", "--", "train"], "--link 'bogus': give a rate like"),
    (["phantom", "compare", "--nproc", "0"], "--nproc 0: every rank count must be >= 1"),
]


def _everything(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _hang(signum, frame):
    raise TimeoutError(f"still running after {HANG_S} s")


@pytest.mark.parametrize("argv,said", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_before_anything_starts(where, capsys, argv, said):
    before = _everything(where)
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_S)
    try:
        try:
            status = main(argv)
        except SystemExit as usage:           # argparse's own errors: its usage lines, then one error line
            status = usage.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert status == 2 and len(errors) == 1 and said in errors[0], err
    assert "Traceback" not in err
    assert _everything(where) == before      # no run folder, no dataset, no profile
