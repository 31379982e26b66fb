"""``par4d bench offload`` on the pool's 4 ranks with a tiny model: its rows (the worker raises
unless the first-step losses agree), the offloaded rows' device bytes against the paper's
``4 phi + 16 bsize``, and its argument checks."""

import argparse

import pytest

from par4d.bench.offload import ROWS, markdown, offload_worker, settings

FIELDS = ("framework", "name", "s_per_iter", "ratio_to_best_torch", "loss_first_step", "loss_rel_diff_to_par4d",
          "device_bytes", "params_per_rank", "bsize", "grid")


def _args(**changes) -> argparse.Namespace:
    base = dict(nproc=4, nodes=None, link="1gbit", iters=1, rounds=1, bsize=101, n_layer=2, n_embd=16, n_head=2,
                seq_len=8, batch_size=8)
    return argparse.Namespace(**{**base, **changes})


def test_rows_and_device_bytes(pool4):
    rows = pool4.run(offload_worker, settings(_args()), timeout=60)[0]
    assert [r["name"] for r in rows] == list(ROWS)
    assert [r["framework"] for r in rows] == ["par4d", "par4d", "par4d", "torch"]
    for row in rows:
        assert all(field in row for field in FIELDS), row
        assert row["s_per_iter"] > 0 and row["grid"] == "data=4"
    offload, offload_off, plain, fsdp = rows
    phi = offload["params_per_rank"]
    # Offloaded: bf16 parameters and gradients, and the four fp32 buffers of bsize elements.
    assert offload["device_bytes"] == offload_off["device_bytes"] == 4 * phi + 16 * 101
    # Not offloaded, after backward: also fp32 masters and both AdamW moments (the masters'
    # fp32 gradients come in the step).
    assert plain["device_bytes"] == 16 * phi
    assert fsdp["device_bytes"] is None
    # par4d's rows start from the same weights and compute the same first loss.
    assert offload["loss_first_step"] == offload_off["loss_first_step"] == plain["loss_first_step"]
    assert fsdp["loss_rel_diff_to_par4d"] <= 2e-2 and fsdp["ratio_to_best_torch"] == 1.0
    assert markdown(rows).count("\n") == len(rows) + 1


@pytest.mark.parametrize("changes, message", [
    (dict(nproc=1), "bench offload needs at least 2 ranks (a data-parallel all-reduce); got 1"),
    (dict(bsize=0), "--bsize 0: give a bucket of at least 1 element"),
    (dict(batch_size=6), "--batch-size 6 is not divisible by the 4 ranks (data=4)"),
    (dict(n_head=3), "n_embd=16 is not divisible by n_head=3"),
    (dict(rounds=0), "--iters and --rounds must be >= 1 (got 1, 0)"),
])
def test_bad_input_is_refused_before_any_rank_starts(changes, message):
    with pytest.raises(ValueError) as error:
        settings(_args(**changes))
    assert message in str(error.value)
