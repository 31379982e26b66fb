"""``par4d bench checkpoint`` on the pool's 4 ranks with a tiny model: its rows, the bytes par4d's
resharding load reads (exactly its shards), and its argument checks."""

import argparse

import pytest

from par4d.bench.checkpoint import checkpoint_worker, markdown, settings
from par4d.cli import main
from par4d.grid import Grid
from par4d.models import GPT

FIELDS = ("framework", "name", "op", "sharding", "s_per_iter", "seconds", "peak_added_bytes", "resident_added_bytes",
          "anon_peak_added_bytes", "file_peak_added_bytes", "rchar_bytes_max_rank", "ratio_to_torch",
          "model")


def _args(**changes) -> argparse.Namespace:
    base = dict(nproc=4, grid_from="x=2,z=2", grid_to="z=2,data=2", n_layer=1, n_embd=16, n_head=2, repeats=1)
    return argparse.Namespace(**{**base, **changes})


def test_resharding_loads_measured_and_exact(pool4, tmp_path):
    """The worker itself checks that each load reproduced every saved parameter and AdamW tensor
    bit for bit (it raises otherwise); here: the rows, and par4d's bytes read on grid B."""
    bench = settings(_args(), str(tmp_path))
    rows = pool4.run(checkpoint_worker, bench, timeout=60)[0]
    assert [r["name"] for r in rows] == ["par4d save", "par4d load (A->B)", "torch DCP save",
                                         "torch DCP load (FSDP2 -> HSDP)"]
    for row in rows:
        assert all(field in row for field in FIELDS), row
        # the peak is the kernel's high-water mark since the block began: never below what stayed resident
        assert row["s_per_iter"] > 0 and row["peak_added_bytes"] >= row["resident_added_bytes"]
    par4d_save, par4d_load, torch_save, torch_load = rows
    assert (par4d_save["sharding"], par4d_load["sharding"]) == ("x=2,z=2", "z=2,data=2")
    assert torch_load["sharding"] == "HSDP 2 x 2 (replicate x shard)"
    assert par4d_load["ratio_to_torch"] == pytest.approx(par4d_load["s_per_iter"] / torch_load["s_per_iter"])

    # Each element of a rank's shards lies in exactly one saved piece and is read once: per rank its
    # parameters, exp_avg and exp_avg_sq shards (fp32), and each parameter's AdamW step (one fp32 scalar).
    shards = list(GPT(bench.config, grid=Grid.virtual(bench.grid_to)).parameters())
    expected = 3 * sum(4 * p.numel() for p in shards) + 4 * len(shards)
    assert par4d_load["read_bytes_per_rank"] == [expected] * 4
    state = 3 * 4 * bench.config.num_params()
    assert par4d_save["written_bytes"] > state and torch_save["written_bytes"] > state
    assert min(torch_load["read_bytes_per_rank"]) >= state / 2          # HSDP: half of every tensor per rank
    assert markdown(rows).count("\n") == len(rows) + 1
    assert not list(tmp_path.iterdir())                                 # every checkpoint removed


@pytest.mark.parametrize("changes, message", [
    (dict(nproc=3), "--nproc 3: HSDP's (2, nproc/2) mesh needs an even --nproc"),
    (dict(grid_to="x=2,z=2"), "--from and --to are the same grid (x=2,z=2)"),
    (dict(grid_to="z=8"), "--to z=8: "),
    (dict(grid_from="x=4", n_embd=18, n_head=2), "--from x=4: "),
    (dict(repeats=0), "--repeats must be >= 1"),
])
def test_bad_input_is_refused_before_any_rank_starts(changes, message):
    with pytest.raises(ValueError) as error:
        settings(_args(**changes), "")
    assert message in str(error.value)


def test_out_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    out.write_text("mine\n")
    assert main(["bench", "checkpoint", "--out", str(out)]) == 2 and "already exists" in capsys.readouterr().err
    assert out.read_text() == "mine\n"
