"""``par4d bench peers --model hf-llama|hf-gpt2``: its arguments checked before any rank starts, the grids it
times, and torch's peers (FSDP2, HSDP, FSDP2 + TP with the standard Llama plan) computing the model's own loss."""

import pytest

from par4d.bench import hf_peers, peers
from par4d.bench.common import pooled
from par4d.bench.peers import PeersSettings, add_ratios
from par4d.cli import main
from par4d.plan.cost import factorizations


@pytest.mark.parametrize(("model", "nproc", "nodes", "numbers"), [
    ("hf-bert", 4, None, "--model hf-bert"),
    ("hf-llama", 3, None, "--nproc 3"),
    ("hf-llama", 8, 2, "TP over 8 ranks (the ranks of a node) does not divide the model's 4 query and 2 key/value"),
    ("hf-gpt2", 6, None, "32 sequences does not divide over 6 ranks"),
])
def test_bad_arguments_name_the_numbers(model, nproc, nodes, numbers):
    with pytest.raises(ValueError, match=numbers.replace("(", r"\(").replace(")", r"\)")):
        hf_peers.validate(model, nproc, nodes, 1, 1)


def test_cli_reports_bad_input_before_any_rank_starts(capsys):
    assert main(["bench", "peers", "--model", "hf-llama", "--nproc", "3", "--iters", "1"]) == 2
    assert "--nproc 3" in capsys.readouterr().err
    assert main(["bench", "peers", "--model", "hf-mixtral", "--in-turns-only"]) == 2    # bench moe: no DDP row in turns
    assert "--in-turns-only: --model hf-mixtral runs bench moe" in capsys.readouterr().err


def test_the_grids_are_those_parallelize_can_cut():
    """4 ranks: the model divides on every (x, y, z, data); 3 sequences leave only the grids with z * data 1."""
    assert hf_peers._grids("hf-llama", 4, 32) == factorizations(4)
    assert hf_peers._grids("hf-llama", 4, 3) == [g for g in factorizations(4) if g["z"] * g["data"] == 1]
    assert {tuple(g.values()) for g in hf_peers._grids("hf-llama", 4, 4)} == {
        tuple(g.values()) for g in hf_peers._grids("hf-llama", 4, 32)}
    assert all(g["x"] * g["y"] * g["z"] * g["data"] == 4 for g in hf_peers._grids("hf-gpt2", 4, 32))


def _peer_loss(kind: str, model: str) -> tuple[float, float]:
    """(the peer's loss on its block of the batch, the unparallelized model's on the same block)."""
    from par4d.bench.torch_peers import destroy_groups, peer_mesh
    from par4d.layout import block

    settings = PeersSettings(nproc=4, nodes=None, iters=1, peak_flops=1.0)
    mesh = peer_mesh(kind, 4, 4, None)
    net, _, parts, index = hf_peers._build_peer(kind, {}, mesh, model, settings)
    x, y = hf_peers.batch(8, 16)
    rows = block(8, parts, index)
    loss = hf_peers._loss(net, x[rows], y[rows]).item()
    destroy_groups(mesh)
    return loss, hf_peers._loss(hf_peers.build_lm(model), x[rows], y[rows]).item()


@pytest.mark.parametrize(("kind", "model"), [("tp", "hf-llama"), ("fsdp", "hf-llama"), ("hsdp", "hf-gpt2")])
def test_torchs_peers_compute_the_models_own_loss(pool4, kind, model):
    for loss, reference in pool4.run(_peer_loss, kind, model):
        assert loss == pytest.approx(reference, rel=1e-6)


def _ddp_row(model: str, knob: dict) -> dict:
    from par4d.bench.peers import Workload

    settings = PeersSettings(nproc=4, nodes=None, iters=2, peak_flops=1e9)
    return hf_peers._bench_torch("ddp", knob, None, model, Workload("comm-bound", 4, 8), settings)


def test_ddps_row_times_par4ds_data_parallel_step_in_turns_with_it(pool4):
    """As bench peers' GPT rows: par4d on data=4 (parallelize, the loop's train_step) stepped in turns with DDP,
    each timed as often, summing in DDP's buckets (here 1 MB)."""
    row = pool4.run(_ddp_row, "hf-gpt2", {"bucket_cap_mb": 1}, timeout=240)[0]
    assert row["name"] == "torch DDP (1 MB buckets)" and len(row["times"]) == len(row["par4d_in_turns_times"]) == 2
    assert all(t > 0 for t in row["par4d_in_turns_times"]) and row["par4d_bucket_mb"] == 1
    [line] = peers.in_turns(add_ratios([pooled([row])]), "comm-bound")
    assert line.startswith("comm-bound: par4d data=4 (1 MB buckets) against torch DDP (1 MB buckets) stepped in turns:")
