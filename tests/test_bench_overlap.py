"""`par4d bench overlap` without launching ranks: its rows, its errors, its table and figure."""

import argparse

import pytest

from par4d.bench.overlap import ROWS, _grid, markdown, plot, run_bench_overlap
from par4d.overlap import NAMES


def test_rows_add_one_switch_each_in_the_papers_order():
    assert [name for name, _ in ROWS] == ["none", "+oar", "+ors", "+oag", "+cache", "+dp", "all"]
    dense = tuple(n for n in NAMES if n not in ("ep", "cp"))   # the bench's GPT: no mixture, no context axis
    assert [switches for _, switches in ROWS] == [dense[:i] for i in range(len(dense) + 1)]


def _args(**changes) -> argparse.Namespace:
    base = dict(nproc=4, nodes=None, link="1gbit", grid=None, iters=1, rounds=1, n_layer=4, n_embd=256, n_head=4,
                seq_len=128, batch_size=16, prefetch=2, json=False, out=None, plot=None)
    return argparse.Namespace(**{**base, **changes})


@pytest.mark.parametrize("changes, message", [
    (dict(nproc=1), "bench overlap needs at least 2 ranks (z >= 2); got 1"),
    (dict(batch_size=6), "--batch-size 6 is not divisible by z * data = 4"),
    (dict(grid="x=2,z=2", batch_size=7), "--batch-size 7 is not divisible by z * data = 2"),
    (dict(n_head=3), "n_embd=256 is not divisible by n_head=3"),
    (dict(iters=0), "--iters and --rounds must be >= 1 (got 0, 1)"),
    (dict(grid="x=3"), "x=3 * y=1 * z=1 * data=1 * pipe=1 = 3 ranks, but the job has world size 4"),
])
def test_bad_input_is_refused_before_any_rank_starts(changes, message):
    with pytest.raises(ValueError) as error:
        run_bench_overlap(_args(**changes))
    assert message in str(error.value)


def test_default_grid_puts_every_rank_on_z():
    assert _grid(4) == {"z": 4}
    assert _grid(8) == {"z": 8}


def test_table_and_figure(tmp_path):
    rows = [{"name": name, "overlap": ",".join(s) or "none", "s_per_iter": 1.0 - 0.1 * i,
             "exposed_comm_s": 0.5 - 0.08 * i, "in_flight_s": 0.5, "speedup": 1.0 / (1.0 - 0.1 * i),
             "exposed_share": (0.5 - 0.08 * i) / (1.0 - 0.1 * i)} for i, (name, s) in enumerate(ROWS)]
    table = markdown(rows)
    assert "| +dp | oar,ors,oag,cache,dp | 0.500 | 2.00x | 0.100 | 20% | 0.500 |" in table
    assert "| all | oar,ors,oag,cache,dp,xy | 0.400 | 2.50x | 0.020 | 5% | 0.500 |" in table
    plot({"test": rows}, str(tmp_path / "fig.png"))
    assert (tmp_path / "fig.png").stat().st_size > 5000


def test_cli_never_overwrites_the_plot(tmp_path, capsys, monkeypatch):
    import par4d.bench.overlap
    from par4d.cli import main

    calls = []
    monkeypatch.setattr(par4d.bench.overlap, "run_bench_overlap", lambda args: calls.append(args.plot) or 0)
    figure = tmp_path / "fig.png"
    figure.write_bytes(b"mine")
    assert main(["bench", "overlap", "--plot", str(figure)]) == 2
    assert (f"par4d bench: error: --plot {figure} already exists; pass --force to overwrite it, or choose another "
            f"--plot" in capsys.readouterr().err)
    assert figure.read_bytes() == b"mine" and calls == []
    assert main(["bench", "overlap", "--plot", str(figure), "--force"]) == 0
    assert calls == [str(figure)]
