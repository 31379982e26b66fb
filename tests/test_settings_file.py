"""``par4d train --config FILE`` (docs/config.md): TOML sections of every option, flags over the file, bad files
named by file and line before anything starts, a run's own ``config.toml`` trains the same run again, and
the shipped examples under configs/ are valid settings of par4d train."""

from math import prod
from pathlib import Path

import pytest

from par4d.cli import _parser, main
from par4d.grid import parse_grid
from par4d.train.settings_file import SECTIONS, apply, read
from tests.helpers import run_losses, train_in_pool

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _args(*flags: str):
    return _parser().parse_args(["train", *flags])


def test_a_file_fills_what_no_flag_gave(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nn_layer = 3\nn_head = 2\n[data]\nseq_len = 32\ndata = "x.txt"\n'
                    '[grid]\nx = 2\nz = 2\ndata = 1\n[optimizer]\nlr = 0.01\n[checkpoint]\nmax_restarts = 2\n'
                    '[logging]\nprogress = false\n')
    args = _args("--n-layer", "5", "--lr", "0.5")
    apply(args, read(path), str(path))
    assert (args.n_layer, args.n_head, args.seq_len, args.data, args.grid) == (5, 2, 32, "x.txt", "x=2,z=2,data=1")
    assert (args.lr, args.max_restarts, args.no_progress) == (0.5, 2, True)
    args = _args("--grid", "y=4", "--no-progress")
    apply(args, read(path), str(path))
    assert args.grid == "y=4" and args.no_progress is True


@pytest.mark.parametrize("text, message", [
    ("[model]\nn_layer = 2\nn_laeyr = 3\n", r"run.toml:3: unknown key 'n_laeyr' in \[model\]; valid: model, n_layer"),
    ("[data]\nlr = 0.1\n", r"run.toml:2: unknown key 'lr' in \[data\] \(it belongs in \[optimizer\]\)"),
    ("[model]\nn_layer = 2\n\n[optimiser]\nlr = 0.1\n", r"run.toml:4: unknown section \[optimiser\]"),
    ("[model]\nn_layer = \"4\"\n", r"run.toml:2: n_layer = '4' must be an integer"),
    ("[optimizer]\nlr = true\n", r"run.toml:2: lr = True must be a number"),
    ("[grid]\nx = 2\nauto = true\n", r"gives both axis sizes and auto = true"),
    ("[model\n", r"not TOML"),
    ("[model]\nn_layer = 2\n\n[model.sizes]\nx = 1\n", r"run.toml:4: unknown key 'sizes' in \[model\]"),
])
def test_bad_files_are_named_with_their_line(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        apply(_args(), read(path), str(path))


def test_bad_files_stop_par4d_train_before_anything_starts(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[schedule]\nsteps = 3\nwarmup = 2\n")
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    assert f"{path}:3: unknown key 'warmup' in [schedule]" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, message", [
    ('[model]\nmodel = "bogus"\n', ":2: model = 'bogus': give one of gpt, hf-gpt2, hf-llama, hf-mixtral, "
                                     "hf-qwen3-moe, hf-olmoe, hf-deepseek-v3, unet (as its flag takes)"),
    ('[optimizer]\nprecision = "fp8"\n', ":2: precision = 'fp8': give one of fp32, bf16, fp16"),
    ('[grid]\nhierarchical = "yes"\n', ":2: hierarchical = 'yes': give one of auto, on, off"),
    ('[checkpoint]\nout = ""\n', ":2: out = '' names no file or folder (remove the key for the default)"),
    ('[data]\ndata = " "\n', ":2: data = ' ' names no file or folder"),
])
def test_a_file_takes_the_values_its_flags_take(tmp_path, capsys, text, message):
    """A --config value goes through its flag's choices (argparse never sees it), and an empty path is not
    the default: each is one line naming the file and line, before anything is written."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    runs = sorted(Path("runs").iterdir()) if Path("runs").is_dir() else []
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"par4d train: error: {path}{message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]
    assert (sorted(Path("runs").iterdir()) if Path("runs").is_dir() else []) == runs     # no new run folder
    assert main(["train", "--out", ""]) == 2
    assert "--out '' names no file or folder (omit --out for the default)" in capsys.readouterr().err


def test_every_key_is_a_flag_of_par4d_train():
    from par4d.train.config import TrainConfig
    from par4d.train.settings_file import NOT_KEPT

    dests, fields = set(vars(_args())), set(TrainConfig.__dataclass_fields__)
    for section, keys in SECTIONS.items():
        for key, (dest, _) in keys.items():
            assert dest in dests or dest.startswith("axis_") or dest in ("grid_auto", "progress"), (section, key)
            assert dest in fields or dest.startswith("axis_") or dest in NOT_KEPT, (section, key)   # config.toml's


def test_a_settings_file_is_read_through_a_link_to_a_regular_file_only(tmp_path):
    """A config is the user's: a link to their file is read. One that ends anywhere else (a FIFO, a device,
    a folder, nothing) is one line naming the link and where it leads, at once (no read that blocks)."""
    import os

    (tmp_path / "real.toml").write_text("[schedule]\nsteps = 3\n")
    (tmp_path / "run.toml").symlink_to(tmp_path / "real.toml")
    (tmp_path / "chain.toml").symlink_to(tmp_path / "run.toml")
    assert read(tmp_path / "run.toml") == read(tmp_path / "chain.toml") == read(tmp_path / "real.toml") == {"steps": 3}
    os.mkfifo(tmp_path / "fifo")
    for name, target, said in [("fifo.toml", tmp_path / "fifo", "not a regular file"),
                               ("zero.toml", Path("/dev/zero"), "/dev/zero"),
                               ("folder.toml", tmp_path, "not a regular file"),
                               ("gone.toml", tmp_path / "gone", "gone")]:
        (tmp_path / name).symlink_to(target)
        with pytest.raises(ValueError) as refused:
            read(tmp_path / name)
        assert str(refused.value).startswith(f"--config {tmp_path / name} (a link to ") and said in str(refused.value)


@pytest.mark.parametrize("name", ["demo.toml", "gpt2-small.toml", "llama-3d.toml"])
def test_the_shipped_examples_are_valid(name, tmp_path, monkeypatch):
    from par4d.cli.configure import configure

    monkeypatch.chdir(tmp_path)
    args = _args()
    apply(args, read(CONFIGS / name), name)
    if args.data is not None:      # gpt2-small.toml trains on a prepared folder: not here
        args.data = None
    if args.grid == "auto":
        args.grid = None
    args.out = str(tmp_path / "run")
    world = prod(parse_grid(args.grid).values()) if args.grid else 4
    config = configure(args, world, inside=False)
    assert config.steps >= 300 and config.n_layer >= 4


def _configured(*flags: str, world: int):
    """The config `par4d train FLAGS` launches: the file applied first, as the CLI does."""
    from dataclasses import replace

    from par4d.cli.configure import configure

    args = _args(*flags)
    apply(args, read(args.config), args.config)
    return replace(configure(args, world, inside=False), peak_flops=1.0)


def test_a_runs_config_toml_trains_the_same_run_again(tmp_path, pool4):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nn_layer = 2\nn_embd = 32\nn_head = 2\n[data]\nseq_len = 16\nbatch_size = 8\n'
                    '[grid]\nx = 2\nz = 2\n[schedule]\nsteps = 3\n[logging]\nprogress = false\n')
    first, again = tmp_path / "first", tmp_path / "again"
    pool4.run(train_in_pool, _configured("--config", str(path), "--out", str(first), world=4))
    saved = first / "config.toml"
    assert "[grid]\nx = 2\ny = 1\nz = 2\ndata = 1\npipe = 1\n" in saved.read_text()
    pool4.run(train_in_pool, _configured("--config", str(saved), "--out", str(again), world=4))
    assert run_losses(again) == run_losses(first) and len(run_losses(first)) == 3
    assert (again / "config.toml").read_text() == saved.read_text()
