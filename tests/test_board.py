"""Metrics where people look (docs/data.md): TensorBoard event files beside metrics.jsonl, with the same values;
the validation loss every --eval-every steps, which changes no training step; a resume that purges what
an interrupted attempt wrote after its step; a planted link refused before any rank starts."""

import json

import pytest

from par4d.cli import main
from tests.helpers import run_losses, train_pooled

COMMON = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "16",
          "--no-progress", "--peak-flops", "1e11", "--grid", "x=2,z=2"]


def _scalars(run) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_what_metrics_jsonl_holds_and_eval_every_changes_no_step(tmp_path, capsys, pool4):
    plain, board = tmp_path / "plain", tmp_path / "board"
    train_pooled(pool4, *COMMON, "--steps", "4", "--no-tensorboard", "--out", str(plain))
    assert not (plain / "tensorboard").exists()
    train_pooled(pool4, *COMMON, "--steps", "4", "--eval-every", "2", "--save-every", "2", "--out", str(board))
    assert run_losses(board) == run_losses(plain)             # evaluating on the way changes no training step
    rows = [json.loads(line) for line in (board / "metrics.jsonl").read_text().splitlines()]
    assert [("val_loss" in r) for r in rows] == [False, True, False, False]   # step 4's is the summary's
    scalars = _scalars(board)
    assert [v for _, v in scalars["loss/train"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [s for s, _ in scalars["loss/validation"]] == [2, 4]
    assert scalars["loss/validation"][1][1] == pytest.approx(json.loads((board / "summary.json").read_text())
                                                             ["val_loss"], rel=1e-6)
    assert [v for _, v in scalars["optimizer/grad_norm"]] == pytest.approx([r["grad_norm"] for r in rows], rel=1e-6)
    assert {f"memory/peak_rss_bytes/rank_{r}" for r in range(4)} <= set(scalars)
    for tag in ("optimizer/lr", "throughput/tokens_per_s", "throughput/model_flops_per_s",
                "throughput/percent_of_peak", "communication/exposed_s", "communication/bytes", "memory/rss_bytes"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
    import shutil

    shutil.rmtree(board / "checkpoints" / "step-00000004")   # as if the run had died before saving step 4
    train_pooled(pool4, "--resume", str(board), "--steps", "6")    # from step 2: steps 3 and 4 run again
    assert [s for s, _ in _scalars(board)["loss/train"]] == [1, 2, 3, 4, 5, 6]   # the first attempt's 3, 4 purged
    assert [json.loads(line)["step"] for line in (board / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4,
                                                                                                          5, 6]


def test_a_resume_refuses_a_link_where_tensorboard_writes(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *COMMON[:-2], "--nproc", "1", "--steps", "2", "--out", str(run)]) == 0
    (tmp_path / "elsewhere").mkdir()
    import shutil

    shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").symlink_to(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4"]) == 2
    assert "tensorboard is not a folder of the run (a link or a file)" in capsys.readouterr().err
    assert list((tmp_path / "elsewhere").iterdir()) == []
