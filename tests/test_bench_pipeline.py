"""``par4d bench pipeline`` on the pool's 4 ranks with a tiny model: its rows (the worker itself
raises unless every torch schedule's losses agree with par4d's), its timeline and figure, its
argument checks, and the CLI's refusal to overwrite an existing --out."""

import argparse

import pytest

from par4d.bench.pipeline import ROWS, markdown, pipeline_worker, settings
from par4d.bench.pipeline_timeline import plot
from par4d.cli import main

FIELDS = ("framework", "name", "s_per_iter", "bubble_fraction", "bubble_by_stage", "peak_activation_bytes",
          "max_in_flight_by_stage", "activation_bytes_by_stage", "ratio_to_best_torch", "loss_first_step",
          "loss_second_step", "loss_rel_diff_to_par4d", "stage_blocks", "microbatches", "slow_stage", "slow_ms",
          "jitter_ms", "handoff_ms")


def _args(**changes) -> argparse.Namespace:
    base = dict(nproc=4, nodes=None, link="1gbit", iters=1, rounds=1, n_layer=4, n_embd=16, n_head=2, seq_len=8,
                batch_size=8, microbatches=4, slow_stage=1, slow_ms=1.0, jitter_ms=2.0)
    return argparse.Namespace(**{**base, **changes})


def test_rows_losses_bubbles_and_timeline(pool4, tmp_path):
    bench = settings(_args())
    result = pool4.run(pipeline_worker, bench, timeout=60)[0]
    rows, timelines = result["rows"], result["timelines"]
    assert [r["name"] for r in rows] == list(ROWS) == ["par4d", "torch GPipe", "torch 1F1B"]
    assert [r["framework"] for r in rows] == ["par4d", "torch", "torch"]
    for row in rows:
        assert all(field in row for field in FIELDS), row
        assert row["s_per_iter"] > 0 and row["peak_activation_bytes"] > 0
        assert row["loss_rel_diff_to_par4d"] <= 1e-5 and row["loss_second_step"] < row["loss_first_step"]
        # a message is used only after the call that produced it returned (one clock for every rank)
        assert 0.0 <= row["bubble_fraction"] <= 1.0 and row["handoff_ms"] is not None and row["handoff_ms"] > 0
        assert all(0.0 <= b <= 1.0 for b in row["bubble_by_stage"]) and len(row["bubble_by_stage"]) == 4
        assert row["stage_blocks"] == ["0-0", "1-1", "2-2", "3-3"] and row["slow_stage"] == 1
        # one forward and one backward bar per microbatch on every stage
        for stage in range(4):
            mine = [e for e in timelines[row["name"]] if e[0] == stage]
            assert sorted((kind, micro) for _, kind, micro, _, _ in mine) == sorted(
                (kind, m) for kind in "BF" for m in range(4))
            assert all(0 <= start <= end for *_, start, end in mine)
    par4d, gpipe, one_f_one_b = rows
    assert gpipe["max_in_flight_by_stage"] == [4, 4, 4, 4]                     # fill, then drain
    assert one_f_one_b["max_in_flight_by_stage"] == [4, 3, 2, 1]               # stages - stage
    assert all(1 <= held <= 4 - stage for stage, held in enumerate(par4d["max_in_flight_by_stage"]))
    best = min(r["s_per_iter"] for r in rows[1:])
    assert par4d["ratio_to_best_torch"] == pytest.approx(par4d["s_per_iter"] / best)
    assert markdown(rows).count("\n") == len(rows) + 1
    plot(timelines, rows, str(tmp_path / "timeline.png"), "test")
    assert (tmp_path / "timeline.png").stat().st_size > 5000


@pytest.mark.parametrize("changes, message", [
    (dict(nproc=1), "bench pipeline needs at least 2 ranks (pipe >= 2); got 1"),
    (dict(microbatches=2), "--microbatches 2: give 4 (the stages"),
    (dict(batch_size=10, microbatches=4), "--batch-size 10 is not divisible by --microbatches 4"),
    (dict(n_layer=3), "pipe=4: each stage needs at least one of the n_layer=3 blocks"),
    (dict(n_head=3), "n_embd=16 is not divisible by n_head=3"),
    (dict(slow_stage=4), "--slow-stage 4: give a stage 0 to 3"),
    (dict(slow_ms=0.0), "--slow-stage and --slow-ms go together"),
    (dict(iters=0), "--iters and --rounds must be >= 1 (got 0, 1)"),
    (dict(jitter_ms=-1.0), "--jitter-ms -1.0: give a sleep of at least 0 ms"),
])
def test_bad_input_is_refused_before_any_rank_starts(changes, message):
    with pytest.raises(ValueError) as error:
        settings(_args(**changes))
    assert message in str(error.value)


def test_every_row_meets_the_same_delays():
    """The n-th forward on a stage sleeps the same for every row: the slow stage's fixed sleep
    plus the n-th jitter draw, in [0, jitter_ms)."""
    bench = settings(_args(slow_stage=1, slow_ms=5.0, jitter_ms=2.0))
    draws = {stage: [bench.delay(stage) for _ in range(2)] for stage in range(4)}
    for stage, (one, other) in draws.items():
        first = [one() for _ in range(20)]
        assert first == [other() for _ in range(20)] and len(set(first)) == 20
        low = 5e-3 if stage == 1 else 0.0
        assert all(low <= s < low + 2e-3 for s in first)
    assert settings(_args(slow_stage=None, slow_ms=0.0, jitter_ms=0.0)).delay(1) is None


def test_cli_never_overwrites_the_out_file(tmp_path, capsys, monkeypatch):
    import par4d.bench.pipeline

    calls = []
    monkeypatch.setattr(par4d.bench.pipeline, "run_bench_pipeline", lambda args: calls.append(args.out) or 0)
    out = tmp_path / "rows.jsonl"
    out.write_text("mine\n")
    assert main(["bench", "pipeline", "--out", str(out)]) == 2
    assert (f"par4d bench: error: --out {out} already exists; pass --force to overwrite it, or choose another "
            f"--out" in capsys.readouterr().err)
    assert out.read_text() == "mine\n" and calls == []
    assert main(["bench", "pipeline", "--out", str(out), "--force"]) == 0
    assert calls == [str(out)]
