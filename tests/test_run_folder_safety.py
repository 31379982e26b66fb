"""A run folder is not a way out: what par4d reads and writes there stays there, and nothing saved is lost.

Run folders get shared, copied and downloaded, so each case plants what an attacker or a careless user
would (links to files outside, names that climb out, a second run, a corrupt or misleading checkpoint)
and checks that no byte outside the run changed, that an intact checkpoint always remains, and that bad
input ends in one clear line before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from par4d import checkpoint
from par4d.cli import main
from par4d.train.lock import LOCK, RunLock
from tests import cases
from tests.helpers import SMALL, train_pooled, train_subprocess

BASE = ["--grid", "x=2", "--steps", "4", "--save-every", "2", *SMALL]     # checkpoints at steps 2 and 4
STEP2, STEP4 = "step-00000002", "step-00000004"
PRECIOUS = b"precious: not par4d's to write\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished run of 2 ranks with checkpoints at steps 2 and 4 (copied by each test, never changed)."""
    from tests.conftest import pool

    run = tmp_path_factory.mktemp("base") / "run"
    train_pooled(pool(2), *BASE, "--out", str(run))
    return run


def _copy(base: Path, tmp_path: Path, name: str = "run") -> Path:
    shutil.copytree(base, tmp_path / name, symlinks=True)
    return tmp_path / name


def _outside(root: Path, run: Path) -> dict[str, bytes]:
    """SHA-256 of every file under ``root`` but inside ``run`` (links not followed): what must not change."""
    out = {}
    for folder, _, files in os.walk(root):
        if Path(folder) == run or run in Path(folder).parents:
            continue
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                out[str(path)] = hashlib.sha256(path.read_bytes()).digest()
    return out


def _victims(tmp_path: Path, count: int) -> list[Path]:
    victims = []
    for i in range(count):
        victim = tmp_path / f"victim-{i}"
        victim.write_bytes(PRECIOUS)
        victims.append(victim)
    return victims


def _link(path: Path, target: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to(target)


def _rehash(step: Path, *names: str) -> None:
    """Give ``names`` of the checkpoint ``step`` their true size and SHA-256 in its manifest (a crafted
    checkpoint whose damage a hash cannot show)."""
    manifest = json.loads((step / "manifest.json").read_text())
    for record in manifest["files"]:
        if record["file"] in names:
            data = (step / record["file"]).read_bytes()
            record.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (step / "manifest.json").write_text(json.dumps(manifest))


def _edit_json(step: Path, name: str, edit) -> None:
    value = json.loads((step / name).read_text())
    (step / name).write_text(json.dumps(edit(value)))
    _rehash(step, name)


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


# -- writes and reads outside the run folder ------------------------------------------------

def test_a_resume_never_writes_through_links_planted_in_the_run(base, tmp_path, capsys, pool2):
    run = _copy(base, tmp_path)
    planted = [run / "metrics.jsonl.tmp", run / ".metrics.jsonl.tmp", run / "checkpoints" / "latest.tmp",
               run / "checkpoints" / ".latest.tmp", run / "summary.json", run / ".summary.json.tmp",
               run / "loss.png", run / ".loss.png.tmp"]
    for path, victim in zip(planted, _victims(tmp_path, len(planted))):
        _link(path, victim)
    before = _outside(tmp_path, run)
    train_pooled(pool2, "--resume", str(run), "--steps", "6")
    assert _outside(tmp_path, run) == before
    for name in ("summary.json", "loss.png", "metrics.jsonl", "checkpoints/latest"):
        assert _regular(run / name), name
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    assert (run / "checkpoints" / "latest").read_text() == "step-00000006"


@pytest.mark.parametrize("where", ["metrics.jsonl", "checkpoints"])
def test_a_link_where_a_resume_reads_is_refused_before_any_rank_starts(base, tmp_path, capsys, where):
    run = _copy(base, tmp_path)
    other = _copy(base, tmp_path, "other")
    shutil.move(run / where, tmp_path / "moved")
    _link(run / where, other / where)
    before = _outside(tmp_path, run)
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert str(run / where) in err and ("symbolic link" in err or "not a regular file" in err), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _outside(tmp_path, run) == before


def test_export_never_writes_through_links_planted_in_its_folder(base, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--run", str(base), "--to", "hf", str(out)]) == 0
    # ... nor through an index or a shard an earlier export would have left (removed as links, not followed)
    planted = [out / "config.json.tmp", out / ".config.json.tmp", out / ".model.safetensors.tmp",
               out / "config.json", out / "model.safetensors", out / "model.safetensors.index.json",
               out / "model-00002-of-00002.safetensors"]
    for path, victim in zip(planted, _victims(tmp_path, len(planted))):
        _link(path, victim)
    before = _outside(tmp_path, out)
    assert main(["export", "--run", str(base), "--to", "hf", str(out), "--force"]) == 0
    assert _outside(tmp_path, out) == before
    assert _regular(out / "config.json") and _regular(out / "model.safetensors")
    stale = [out / "model.safetensors.index.json", out / "model-00002-of-00002.safetensors"]
    assert not any(path.is_symlink() or path.exists() for path in stale)     # one file now: the links are gone
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


def _escape_index(step: Path, target: str) -> None:
    """The first piece of the first tensor moved to ``target`` (the index rehashed: only confinement stops it)."""
    def edit(index):
        first = next(iter(index["tensors"].values()))
        first["pieces"][0]["file"] = target
        return index
    _edit_json(step, "index.json", edit)


def _escape_manifest(step: Path, target: str) -> None:
    """The manifest lists ``target`` (a file outside, with its true size and hash) and the index uses it."""
    outside = (step / target) if not target.startswith("/") else Path(target)
    data = outside.read_bytes()
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"].append({"file": target, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    (step / "manifest.json").write_text(json.dumps(manifest))
    _escape_index(step, target)


def _link_piece(step: Path, other: Path) -> None:
    """A piece replaced by a link to the same piece of another run (same bytes, same hash)."""
    _link(step / "rank-00000.safetensors", other / "checkpoints" / STEP4 / "rank-00000.safetensors")


def _link_step(step: Path, other: Path) -> None:
    """The whole checkpoint folder a link to another run's."""
    shutil.rmtree(step)
    step.symlink_to(other / "checkpoints" / STEP4)


@pytest.mark.parametrize("escape", [
    lambda step, other: _escape_index(step, "../../../victim-0"),
    lambda step, other: _escape_index(step, str(other / "checkpoints" / STEP4 / "rank-00000.safetensors")),
    lambda step, other: _escape_manifest(step, "../../../victim-0"),
    lambda step, other: _escape_manifest(step, str(other / "checkpoints" / STEP4 / "rank-00000.safetensors")),
    _link_piece,
    _link_step,
], ids=["index-dotdot", "index-absolute", "manifest-dotdot", "manifest-absolute", "piece-link", "folder-link"])
def test_checkpoint_paths_are_confined_to_the_checkpoint(base, tmp_path, capsys, escape):
    """A piece named outside the checkpoint (climbing out, absolute, or a link, even to identical bytes
    elsewhere) makes it unusable: a resume falls back past it and export refuses it, naming it."""
    run, other = _copy(base, tmp_path), _copy(base, tmp_path, "other")
    _victims(tmp_path, 1)
    step = run / "checkpoints" / STEP4
    escape(step, other)
    reports = []
    assert checkpoint.choose(run, reports.append) == run / "checkpoints" / STEP2
    assert len(reports) == 1 and STEP4 in reports[0], reports
    assert main(["export", "--run", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0    # from step 2
    assert f"checkpoint {STEP4} is unusable" in capsys.readouterr().err
    # Named directly, the checkpoint is reached from its run folder (the user's choice) as a resume reaches
    # it: a step folder that is a link is refused as well.
    assert main(["export", "--run", str(step), "--to", "hf", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("par4d export: error:") and err.count("\n") == 1, err
    assert escape is not _link_step or f"{step} is a symbolic link" in err, err
    assert not (tmp_path / "hf2").exists()


# -- data loss --------------------------------------------------------------------------------

def _sha_tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("damage", ["flipped", "linked"])
def test_a_resume_past_a_corrupt_checkpoint_sets_it_aside_and_keeps_an_intact_one(base, tmp_path, capsys, pool2,
                                                                                  damage):
    run = _copy(base, tmp_path)
    piece = run / "checkpoints" / STEP4 / "rank-00000.safetensors"
    if damage == "flipped":
        data = bytearray(piece.read_bytes())
        data[len(data) // 2] ^= 1
        piece.write_bytes(bytes(data))
    else:
        _link(piece, Path("/etc/hostname") if Path("/etc/hostname").is_file() else Path(sys.executable))
    corrupt = _sha_tree(run / "checkpoints" / STEP4)
    before = _outside(tmp_path, run)
    summary = train_pooled(pool2, "--resume", str(run), "--steps", "6")
    assert summary["resumed_from"]["step"] == 2
    said = capsys.readouterr().out
    assert f"checkpoint {STEP4} is unusable" in said, said
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["corrupt-step-00000004", "latest", STEP4, "step-00000006"]
    assert _sha_tree(folder / "corrupt-step-00000004") == corrupt        # set aside as it was, not deleted
    for step in (STEP4, "step-00000006"):
        checkpoint.verify(folder / step)
    assert _outside(tmp_path, run) == before


def test_a_pointer_to_an_older_checkpoint_resumes_from_the_newest_and_overwrites_nothing(base, tmp_path, capsys,
                                                                                         pool2):
    run = _copy(base, tmp_path)
    (run / "checkpoints" / "latest").write_text(STEP2)
    newest = _sha_tree(run / "checkpoints" / STEP4)
    summary = train_pooled(pool2, "--resume", str(run), "--steps", "6")
    assert summary["resumed_from"]["step"] == 4
    assert f"names {STEP2}, but {STEP4} is newer and intact" in capsys.readouterr().out
    assert _sha_tree(run / "checkpoints" / STEP4) == newest


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(base, tmp_path, capsys, pool2):
    new, resumed = tmp_path / "new", _copy(base, tmp_path)
    for folder, args in ((new, ["--out", str(new), *BASE]), (resumed, ["--resume", str(resumed), "--steps", "6"])):
        before = {p.name for p in folder.iterdir()} if folder.exists() else set()
        with RunLock(folder):
            assert main(["train", "--nproc", "2", *args]) == 2
            err = capsys.readouterr().err
            assert f"{folder} is in use by another par4d run (pid {os.getpid()} on" in err, err
            if folder == new:   # under torchrun rank 0 takes the lock: the same refusal, from the rank
                with pytest.raises(AssertionError, match="is in use by another par4d run"):
                    train_pooled(pool2, *args)
        assert {p.name for p in folder.iterdir()} <= before | {LOCK}


def test_a_new_run_checks_its_folder_again_once_it_holds_the_lock(tmp_path):
    """Between the check before launch and the lock, another run may have written there: a new run's lock
    refuses a folder that holds anything but the lock, and gives the lock back; a resume's does not."""
    folder = tmp_path / "run"
    with RunLock(folder, new=True):      # missing: made, and empty but for the lock
        pass
    (folder / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=f"--out {folder} already holds files"):
        RunLock(folder, new=True)
    with RunLock(folder):                 # the refused one gave the lock back; a resume takes it as it is
        pass


def test_a_folder_tells_a_link_on_the_way_from_a_file_on_the_way(tmp_path):
    from par4d.folder import Folder

    (tmp_path / "afile").write_text("")
    (tmp_path / "real").mkdir()
    (tmp_path / "alink").symlink_to(tmp_path / "real")
    folder = Folder(tmp_path)
    assert [folder.kind("afile", "x"), folder.kind("alink", "x"), folder.sub("afile").kind(),
            folder.sub("alink").kind(), folder.kind("real"), folder.kind("nothing")] == \
        ["other", "link", "other", "link", "folder", None]


def test_the_lock_of_a_killed_run_is_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from par4d.train.lock import RunLock; "
                               f"lock = RunLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"pid {holder.pid} on"):
            RunLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(tmp_path):     # the kernel released it with the process
        pass


def _drop_box(index):
    piece = next(p for r in index["tensors"].values() for p in r["pieces"] if len(p["boxes"]) > 1)
    piece["boxes"].pop()
    return index


def _overlapping(index):
    """The pieces of a tensor split over x=2: the second one moved onto the first (same volume)."""
    record = next(r for k, r in index["tensors"].items() if k.startswith("model/") and len(r["pieces"]) == 2
                  and len(r["shape"]) == 2)
    first, second = (p["boxes"][0][0] for p in record["pieces"])
    second[:] = [list(e) for e in first]
    return index


@pytest.mark.parametrize("edit, words", [
    (_drop_box, "each element must be saved exactly once"),
    (_overlapping, "overlap"),
], ids=["uncovered", "overlapping"])
def test_every_element_of_every_tensor_is_covered_exactly_once(base, tmp_path, edit, words):
    run = _copy(base, tmp_path)
    _edit_json(run / "checkpoints" / STEP4, "index.json", edit)
    with pytest.raises(ValueError, match=words):
        checkpoint.verify(run / "checkpoints" / STEP4)
    assert checkpoint.choose(run) == run / "checkpoints" / STEP2


def _batch_norm_round_trip(folder: str) -> None:
    """A model with batch norms trained (their running statistics moved), saved, and loaded into a fresh
    copy: parameters, running statistics and the evaluation's output are the same."""
    import torch.distributed as dist
    import torch.nn as nn

    from par4d import parallelize
    from par4d.layout import shard_batch

    grid = cases.grid(data=2)

    def model(seed):
        torch.manual_seed(seed)
        return parallelize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                         nn.Linear(4 * 6 * 6, 5)), grid)

    images = shard_batch(grid, torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(3)))
    trained, fresh = model(0), model(1)
    optimizer = torch.optim.AdamW(trained.parameters())
    for _ in range(3):     # training mode: the running statistics move off (0, 1)
        trained(images * 2 + 1).square().mean().backward()
        for param in trained.parameters():     # the data-parallel mean: replicas stay equal
            dist.all_reduce(param.grad)
            param.grad /= 2
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(Path(folder), 3, grid, trained, optimizer, {})
    checkpoint.load(Path(folder), grid, fresh, torch.optim.AdamW(fresh.parameters()))
    for (name, a), b in zip(trained.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(trained[1].running_mean, torch.zeros(4))
    assert torch.equal(trained.eval()(images), fresh.eval()(images))


def test_batch_norm_running_statistics_are_saved_and_loaded(pool2, tmp_path):
    pool2.run(_batch_norm_round_trip, str(tmp_path / "run"))


# -- sizes and fields from files: one line, before anything is built ---------------------------

def _only(base: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy whose only checkpoint is step 4 (nothing to fall back to)."""
    run = _copy(base, tmp_path)
    shutil.rmtree(run / "checkpoints" / STEP2)
    return run, run / "checkpoints" / STEP4


def _meta(**changes):
    return lambda meta: {**meta, **changes}


def _train_config(**changes):
    return lambda meta: {**meta, "train_config": {**meta["train_config"], **changes}}


def _deep(meta):
    return "DEEP"


@pytest.mark.parametrize("edit, words", [
    (_meta(step="4"), 'meta.json: step is "4", not a count of steps'),
    (lambda meta: [meta], "meta.json holds a JSON list, not an object"),
    (_meta(train_config=None), "train_config is null, not an object"),
    (_deep, "meta.json is not readable JSON (nested too deep)"),
    (_meta(grid={"x": -2}), 'meta.json: grid is {"x": -2}, not axis sizes >= 1'),
    (_train_config(grid={"x": -2}), "train_config: grid is {'x': -2}, not axis sizes >= 1"),
    (_train_config(batch_size="8"), "train_config: batch_size is '8' (str), not int"),
    (_train_config(colour="red"), "train_config has 'colour', not a setting of par4d train"),
    (_train_config(n_embd=2 ** 40), "parameters; their values, gradients and AdamW state need at least"),
    (_train_config(n_embd=2 ** 17, n_head=2), "parameters; their values, gradients and AdamW state need at least"),
    (_train_config(lr=-1.0), "meta.json: the run's saved settings are refused: --lr must be a finite number > 0"),
], ids=["step-str", "list", "null-config", "deep", "grid-x", "config-grid", "batch-str", "unknown-key", "n_embd-2^40",
        "n_embd-2^17", "lr"])
def test_fields_read_from_meta_json_are_checked(base, tmp_path, capsys, edit, words):
    run, step = _only(base, tmp_path)
    if edit is _deep:
        (step / "meta.json").write_text("[" * 200_000 + "]" * 200_000)
        _rehash(step, "meta.json")
    else:
        _edit_json(step, "meta.json", edit)
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_missing_or_garbled_pointer_is_said_and_the_newest_intact_checkpoint_used(base, tmp_path, capsys):
    from par4d.cli import _parser
    from par4d.cli.configure import resumable, world_size

    run = _copy(base, tmp_path)
    for pointer in (None, b"\x80garbage"):
        if pointer is None:
            (run / "checkpoints" / "latest").unlink()
        else:
            (run / "checkpoints" / "latest").write_bytes(pointer)
        args = _parser().parse_args(["train", "--resume", str(run), "--steps", "6"])
        resumed = resumable(args)
        assert resumed[0].name == STEP4 and world_size(args, resumed) == (2, False)   # the run's 2 ranks, not 4
        said = capsys.readouterr().out
        assert "latest" in said and f"the newest intact checkpoint is {STEP4}" in said, said


def test_sizes_from_a_hugging_face_config_are_checked_before_anything_is_built(base, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", "--run", str(base), "--to", "hf", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_layer": 10 ** 7}))
    result = train_subprocess("--init-from", "hf", str(out), "--nproc", "2", "--grid", "x=2", "--steps", "1",
                              "--no-progress", "--out", str(tmp_path / "run"), status=2, timeout=60)
    assert "n_layer=10000000" in result.stderr and "parameters" in result.stderr, result.stderr
    (out / "config.json").write_text(json.dumps({**config, "n_layer": "12"}))
    result = train_subprocess("--init-from", "hf", str(out), "--steps", "1", "--out", str(tmp_path / "run"), status=2)
    assert 'config.json: n_layer is "12", not a size >= 1' in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_a_corpus_larger_than_memory_is_refused_with_its_size(tmp_path, capsys):
    from par4d.launch.host import host_memory

    memory = host_memory()
    if memory is None:
        pytest.skip("this system does not tell its memory")
    data = tmp_path / "huge.txt"
    with data.open("wb") as f:      # sparse: no disk is used
        f.truncate(2 * memory)
    assert main(["train", "--data", str(data), "--nproc", "2", "--grid", "x=2", *SMALL,
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--data {data} has {2 * memory / 1e9:,.1f} GB; par4d reads the text whole" in err, err
    assert not (tmp_path / "run").exists()


def _pickle_piece(step: Path) -> None:
    import pickle

    (step / "rank-00000.safetensors").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    _rehash(step, "rank-00000.safetensors")


def _truncate_piece(step: Path) -> None:
    piece = step / "rank-00000.safetensors"
    piece.write_bytes(piece.read_bytes()[:100])


@pytest.mark.parametrize("damage, words", [
    (_pickle_piece, "rank-00000.safetensors is not a readable safetensors file"),
    (_truncate_piece, "rank-00000.safetensors is missing or has the wrong size"),
], ids=["pickled", "truncated"])
def test_export_of_a_damaged_checkpoint_is_one_line_naming_the_file(base, tmp_path, capsys, damage, words):
    run, step = _only(base, tmp_path)
    damage(step)
    assert main(["export", "--run", str(step), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_export_to_a_place_it_cannot_write_is_one_line(base, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out, words in ((tmp_path / "file" / "hf", "is a file, not a folder"),
                       (Path("/proc/par4d-export"), "--to hf /proc/par4d-export")):
        assert main(["export", "--run", str(base), "--to", "hf", str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    # A full disk: safetensors says so in an error of its own, and the file written last, in an OSError
    import errno
    from unittest import mock

    from safetensors import SafetensorError

    real = os.replace
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_room_for_config(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if dst == "config.json":
            raise full
        return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    failing = mock.patch("par4d.train.export.save_file", side_effect=SafetensorError("No space left on device"))
    for patch, name in ((failing, "model.safetensors"), (mock.patch("par4d.folder.os.replace", no_room_for_config),
                                                           "config.json")):
        out = tmp_path / f"full-{name}"
        with patch:
            assert main(["export", "--run", str(base), "--to", "hf", str(out)]) == 2
        err = capsys.readouterr().err
        assert (f"cannot write {out / name} (No space left on device); the run is untouched: make room and export "
                f"again") in err and err.count("\n") == 1, err


def test_plan_with_no_grid_that_runs_the_model_exits_1(capsys):
    assert main(["plan", "--model", "gpt-20b", "--gpus", "10000000", "--gpus-per-node", "4",
                 "--machine", "perlmutter"]) == 1
    captured = capsys.readouterr()
    assert "0 of" in captured.out and "no grid of 10,000,000 devices runs gpt-20b" in captured.err


def test_errors_about_a_resumed_runs_own_values_name_the_run_not_a_flag(base, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("a resumed run checks its own text. " * 40)
    run = tmp_path / "on-text"
    from tests.conftest import pool

    train_pooled(pool(2), *BASE, "--data", str(text), "--out", str(run))
    text.write_text("another text altogether, not the one it started on. " * 40)
    assert main(["train", "--resume", str(run), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert f"the run's data {text} ({text}) is not the text this run started on" in err, err
    assert "--data" not in err
    assert main(["train", "--resume", str(base), "--steps", "6", "--grid", "data=3"]) == 2
    err = capsys.readouterr().err
    assert "the run's batch_size 8 (train_config in its meta.json) is not divisible by data * z = 3 * 1" in err, err


def test_an_interrupted_launcher_waits_for_its_ranks_before_saying_what_they_saved():
    """After a second Ctrl-C torch's agent stops waiting for its ranks; par4d's launcher waits for them
    (its own children), so the step it reports as saved is the one they saved."""
    from par4d.launch import children, wait_for_children

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        assert rank.pid in children()
        wait_for_children(limit=20, pids=[rank.pid])    # (this process has the pools' ranks too)
        assert rank.poll() is not None and rank.pid not in children()    # it had exited when the wait ended
    finally:
        rank.kill()
        rank.wait()


def _load_into_other_shapes(run: str) -> None:
    from par4d.models import GPT, GPTConfig

    grid = cases.grid(x=2)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=48), grid=grid)
    checkpoint.load(Path(run), grid, model, torch.optim.AdamW(model.parameters()))


def test_a_dense_model_of_other_shapes_is_refused_naming_the_tensor_not_phantom_layers(base, pool2):
    for message in pool2.errors(_load_into_other_shapes, str(base), timeout=60):
        assert "model/wte.weight has full shape (256, 32), this model (256, 48)" in message, message
        assert "phantom" not in message
