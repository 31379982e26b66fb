"""``par4d bench peers``: argument checks, ratios and the TP attention's math without launching ranks; par4d's step
beside DDP's on the pool's ranks."""

import copy

import pytest
import torch

from par4d.bench import common, peers, torch_peers
from par4d.bench.common import in_rounds, pooled
from par4d.bench.peers import TPAttention, add_ratios, markdown, summary, validate
from par4d.cli import main
from par4d.measure.grids import CONFIG
from par4d.models import ReferenceGPT


@pytest.mark.parametrize(("nproc", "nodes", "iters", "numbers"), [
    (0, None, 8, "got 0, 8, 1"),
    (4, None, 0, "got 4, 0, 1"),
    (4, 0, 8, "got 0"),
    (3, None, 8, "--nproc 3"),                 # HSDP's (2, nproc/2) mesh
    (8, 2, 8, "TP over 8 ranks"),               # TP inside a node of 8 ranks, 4 heads
    (6, None, 8, "32 sequences does not divide over 6 ranks"),
])
def test_bad_arguments_name_the_numbers(nproc, nodes, iters, numbers):
    with pytest.raises(ValueError, match=numbers):
        validate(nproc, nodes, iters)


def test_world_without_a_par4d_grid_is_refused(monkeypatch):
    monkeypatch.setattr(peers, "grids", lambda world, batch: [])
    with pytest.raises(ValueError, match="no par4d grid of 4 ranks"):
        validate(4, None, 1)


@pytest.mark.parametrize(("nproc", "nodes", "hsdp", "tp"), [
    (4, None, (2, 2), (2, 2)),      # 4 local ranks: HSDP 2 x 2, FSDP 2 x TP 2
    (2, 2, (2, 2), (2, 2)),         # 2 emulated nodes of 2 ranks: replicate across, shard and TP inside a node
])
def test_valid_shapes_pass_with_the_meshes_they_run_on(nproc, nodes, hsdp, tp):
    validate(nproc, nodes, 1)       # raises on a shape it refuses
    assert (torch_peers.hsdp_shape(nproc, nodes), torch_peers.tp_shape(nproc, nodes)) == (hsdp, tp)
    world = nproc * (nodes or 1)
    assert all(peers.grids(world, batch=w.sequences) for w in peers.workloads(world))


def test_cli_reports_bad_input_before_any_rank_starts(capsys):
    assert main(["bench", "peers", "--nproc", "3", "--iters", "1"]) == 2
    assert "--nproc 3" in capsys.readouterr().err


def _row(framework: str, workload: str, name: str, s: float) -> dict:
    return {"framework": framework, "workload": workload, "name": name, "grid": "x=1 y=1 z=1 data=4",
            "s_per_iter": s, "tokens_per_s": 1.0, "percent_of_peak": 1.0, "bytes_per_iter": 0, "bytes_source": "-"}


def test_ratio_is_to_the_fastest_torch_row_of_the_same_workload():
    rows = add_ratios([_row("par4d", "demo", "par4d", 0.5), _row("torch", "demo", "torch DDP", 0.4),
                       _row("torch", "demo", "torch FSDP2", 0.8), _row("par4d", "comm-bound", "par4d", 0.1),
                       _row("torch", "comm-bound", "torch FSDP2", 0.05)])
    assert [r["ratio_to_best_peer"] for r in rows] == pytest.approx([1.25, 1.0, 2.0, 2.0, 1.0])
    assert "1.25x the best peer (torch DDP" in summary(rows, "demo")
    assert "2.00x the best peer (torch FSDP2" in summary(rows, "comm-bound")
    assert markdown(rows).count("\n") == len(rows) + 1


def test_ratio_is_none_without_a_torch_row():
    rows = add_ratios([_row("par4d", "demo", "par4d", 0.5)])
    assert rows[0]["ratio_to_best_peer"] is None
    assert summary(rows, "demo") == "demo: no torch row"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_attention_split_over_ranks_equals_the_twins(tp):
    """Each TP rank's slice (qkv rows as ColwiseParallel cuts them, proj columns as RowwiseParallel
    does), summed over ranks plus proj's bias once, is the twin's attention."""
    torch.manual_seed(0)
    attn = ReferenceGPT(CONFIG).blocks[0].attn
    h = torch.randn(2, 16, CONFIG.n_embd)
    expected = attn(h)
    wrapped = TPAttention(copy.deepcopy(attn), tp)
    dim, width = CONFIG.n_embd, CONFIG.n_embd // tp
    out = wrapped.proj.bias.detach().clone()
    for rank in range(tp):
        local = copy.deepcopy(wrapped)
        rows, cols = slice(rank * 3 * width, (rank + 1) * 3 * width), slice(rank * width, (rank + 1) * width)
        local.qkv = torch.nn.Linear(dim, 3 * width)
        local.qkv.weight.data, local.qkv.bias.data = wrapped.qkv.weight[rows].detach(), wrapped.qkv.bias[rows].detach()
        local.proj = torch.nn.Linear(width, dim, bias=False)
        local.proj.weight.data = wrapped.proj.weight[:, cols].detach()
        out = out + local(h, None)        # as the twin's block calls its attention
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_tp_attention_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="TP over 3 ranks does not divide 4 attention heads"):
        TPAttention(ReferenceGPT(CONFIG).blocks[0].attn, 3)


def test_ddp_with_and_without_sync_are_timed_in_turns(monkeypatch):
    """Each step's times are its own, one untimed turn first, each turn starting one step later (every step in
    every place equally often): the exposed-comm difference and par4d's ratio to DDP rely on it."""
    log: list[str] = []

    def fake_time_iterations(step, iters, warmup):
        for _ in range(warmup + iters):
            step()
        return [{"sync": 1.0, "local": 2.0, "par4d": 3.0}[name] for name in log[warmup:]]

    monkeypatch.setattr(common, "time_iterations", fake_time_iterations)
    steps = [lambda name=name: log.append(name) for name in ("sync", "local", "par4d")]
    assert common.in_turns_times(steps, 3) == [[1.0] * 3, [2.0] * 3, [3.0] * 3]
    assert log == ["sync", "local", "par4d", "local", "par4d", "sync", "par4d", "sync", "local",
                   "sync", "local", "par4d"]


@pytest.mark.parametrize("only", [False, True], ids=["every-row", "in-turns-only"])
def test_in_turns_only_runs_ddps_rows_alone(monkeypatch, only):
    """--in-turns-only: DDP's rows alone, every knob's, in rounds (each steps par4d's data=N step in turns with
    DDP's, each round's ratio kept); no par4d grid row, no other peer. Without it, all of them."""
    calls = []

    def fake_torch(kind, knob, mesh, workload, settings):
        calls.append((kind, tuple(knob), workload.name))
        return dict(_row("torch", workload.name, peers.peer_name(kind, knob), 0.2), times=[0.2], local_times=[0.1],
                    **({"par4d_in_turns_times": [0.21]} if kind == "ddp" else {}))

    for module, name, value in ((peers, "join", lambda env: None), (peers, "distributed_env", lambda: None),
                                (torch, "set_num_threads", lambda n: None),
                                (peers, "_par4d_rows", lambda w, s: calls.append(("par4d", w.name)) or []),
                                (peers, "_bench_torch", fake_torch), (peers, "peer_mesh", lambda *a: None),
                                (peers.dist, "destroy_process_group", lambda: None)):
        monkeypatch.setattr(module, name, value)
    rows = peers.peers_worker(peers.PeersSettings(4, None, 2, 1e9, rounds=3, in_turns_only=only))
    if only:
        turn = [("ddp", tuple(knob), w) for knob in peers.KNOBS["ddp"] for w in ("demo", "comm-bound")]
        assert calls == (turn + turn[::-1]) + turn
        assert sorted(r["name"] for r in rows) == sorted([peers.peer_name("ddp", k) for k in peers.KNOBS["ddp"]] * 2)
        assert all(r["par4d_in_turns_ratios"] == pytest.approx([1.05] * 3) for r in rows)
    else:
        assert {c[0] for c in calls} == {"par4d", *torch_peers.KINDS} and len(rows) > 2
        assert sum(1 for c in calls if c[:2] == ("ddp", ("bucket_cap_mb",))) == 2 * 3
        assert sum(1 for c in calls if c[:2] == ("ddp", ("gradient_as_bucket_view",))) == 2 * 3


def test_throughput_is_recounted_for_the_workloads_tokens():
    from par4d.bench.common import grid_row

    row = peers._for_workload(grid_row("par4d", {}, [0.5], 0, 1e9, "ledger"), peers.Workload("comm-bound", 4, 32), 1e9)
    assert row["tokens_per_s"] == pytest.approx(4 * 32 / 0.5)
    assert (row["workload"], row["global_batch"], row["seq_len"]) == ("comm-bound", 4, 32)
    assert [w.name for w in peers.workloads(4)] == ["demo", "comm-bound"]


@pytest.mark.parametrize("command, module, function", [("grid", "par4d.bench.grid", "run_bench_grid"),
                                                       ("peers", "par4d.bench.peers", "run_bench_peers"),
                                                       ("overlap", "par4d.bench.overlap", "run_bench_overlap")])
def test_bench_never_overwrites_its_out_file(tmp_path, capsys, monkeypatch, command, module, function):
    import importlib

    from par4d.bench.common import emit

    calls = []

    def bench(args):                                   # the benchmark, without measuring or starting ranks
        calls.append(args.out)
        emit([{"row": 1}], args.out, False)
        return 0

    monkeypatch.setattr(importlib.import_module(module), function, bench)
    out = tmp_path / "rows.jsonl"
    out.write_text("mine\n")
    assert main(["bench", command, "--out", str(out)]) == 2
    assert (f"par4d bench: error: --out {out} already exists; pass --force to overwrite it, or choose another "
            f"--out (nothing is overwritten)" in capsys.readouterr().err)
    assert main(["bench", command, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err
    assert out.read_text() == "mine\n" and calls == []
    assert main(["bench", command, "--out", str(out), "--force"]) == 0
    assert out.read_text() == '{"row": 1}\n'
    fresh = tmp_path / "new" / "rows.jsonl"            # a missing folder is created
    assert main(["bench", command, "--out", str(fresh)]) == 0
    assert fresh.read_text() == '{"row": 1}\n' and calls == [str(out), str(fresh)]


def test_a_dangling_link_counts_as_an_existing_file(tmp_path):
    from par4d.cli.files import check_new_file

    link = tmp_path / "rows.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")      # writing would create the link's target
    with pytest.raises(ValueError, match="already exists; pass --force"):
        check_new_file(link, "--out", force=False)
    check_new_file(link, "--out", force=True)


def test_rounds_pool_a_rows_iterations():
    """A row timed in two rounds: the median over both rounds' iterations, throughput recounted, DDP's exposed
    all-reduce from the pooled times with and without sync."""
    first = {"s_per_iter": 2.0, "tokens_per_s": 10.0, "percent_of_peak": 4.0, "times": [1.0, 2.0, 3.0],
             "local_times": [0.5, 0.5, 0.5], "name": "torch DDP"}
    second = dict(first, s_per_iter=5.0, tokens_per_s=4.0, percent_of_peak=1.6, times=[5.0, 6.0, 4.0],
                  local_times=[1.5, 1.5, 1.5])
    row = pooled([first, second])
    assert row["s_per_iter"] == 3.5 and row["iters"] == 6 and row["rounds"] == 2
    assert row["tokens_per_s"] == pytest.approx(4.0 * 5.0 / 3.5)        # the last round's, recounted
    assert row["compute_s"] == 1.0 and row["exposed_comm_s"] == 2.5
    assert "times" not in row and "local_times" not in row
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        validate(4, None, 8, 0)


def test_rounds_alternate_the_order_and_keep_the_first_compile():
    """Rows timed in rounds (bench peers, hf peers, moe): the order of the runs reversed every other round, a row's
    parts together; compiled, the first round's compiling seconds (Inductor's cache is warm after it) and every
    round's graphs compiled again."""
    calls = []

    def run(name):
        def timed():
            calls.append(name)
            turn = calls.count(name)
            return [{"name": name, "grid": "data=4", "s_per_iter": 1.0, "times": [float(turn)],
                     "compile_s": 10.0 / turn, "recompiled_graphs": turn - 1}]
        return timed

    parts = in_rounds([run("a"), run("b"), run("c")], 3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [[p["times"] for p in part] for part in parts] == [[[1.0], [2.0], [3.0]]] * 3
    row = pooled(parts[0])
    assert (row["s_per_iter"], row["compile_s"], row["recompiled_graphs"], row["rounds"]) == (2.0, 10.0, 3, 3)


def test_par4d_stepped_in_turns_with_ddp_is_pooled_and_reported():
    """DDP's row carries par4d's data-parallel step timed in turns with it, every round's steps pooled; the line
    gives both medians and their ratio, and each round's ratio summarized (mean and standard error)."""
    parts = [dict(_row("torch", "demo", "torch DDP", 0.0), times=[0.20, 0.22], local_times=[0.18, 0.18],
                  par4d_in_turns_times=[0.19, 0.25]),
             dict(_row("torch", "demo", "torch DDP", 0.0), times=[0.21], local_times=[0.19],
                  par4d_in_turns_times=[0.23])]
    row = pooled(parts)
    assert (row["s_per_iter"], row["par4d_in_turns_s"]) == (0.21, 0.23)
    assert "par4d_in_turns_times" not in row
    assert row["par4d_in_turns_ratios"] == pytest.approx([0.22 / 0.21, 0.23 / 0.21], rel=1e-12)   # medians' ratios
    views = pooled([dict(part, name="torch DDP (gradients as bucket views)") for part in parts[1:]])
    rows = add_ratios([row, views, _row("par4d", "demo", "par4d", 0.3), _row("torch", "demo", "torch FSDP2", 0.2)])
    assert peers.in_turns(rows, "demo") == [
        "demo: par4d data=4 against torch DDP stepped in turns: 0.2300 against 0.2100 s/iter, 1.095x; per round "
        "1.071x mean, standard error 0.024 (2 rounds)",
        "demo: par4d data=4 against torch DDP (gradients as bucket views) stepped in turns: 0.2300 against "
        "0.2100 s/iter, 1.095x"]      # one round: no spread to give
    assert peers.in_turns(rows, "comm-bound") == []
    assert peers.in_turns(add_ratios([_row("torch", "demo", "torch DDP", 0.2)]), "demo") == []
    small = dict(row, name="torch DDP (1 MB buckets)", par4d_bucket_mb=1)     # beside it, par4d's buckets are 1 MB
    assert peers.in_turns([small], "demo")[0].startswith(
        "demo: par4d data=4 (1 MB buckets) against torch DDP (1 MB buckets) stepped in turns: ")


def _beside_all_reduces(bucket_mb: float) -> list[int]:
    from par4d.measure.grids import step_collectives

    settings = peers.PeersSettings(nproc=4, nodes=None, iters=1, peak_flops=1.0)
    step = peers._par4d_beside(peers.Workload("comm-bound", 4, 8), settings, bucket_mb)
    elements = [n for kind, axes, n in step_collectives(step.grid, step) if kind == "all_reduce"]
    step.grid.close()
    return elements


def test_par4d_beside_ddp_sums_in_ddps_buckets(pool4):
    """par4d's data-parallel step stepped beside a DDP row sums in that row's buckets (``bucket_cap_mb``, else DDP's
    25 MB): the same algorithm. Every gradient once a step, in 2 all-reduces with 25 MB buckets (the first at most
    1 MB, as DDP's), in at least 4 of at most 1 MB each with 1 MB buckets."""
    gradients = sum(p.numel() for p in ReferenceGPT(CONFIG).parameters())
    assert [peers.bucket_mb_of(k) for k in peers.KNOBS["ddp"]] == [25.0, 1, 25.0]
    default, small = (pool4.run(_beside_all_reduces, mb)[0] for mb in (25.0, 1))
    assert len(default) == 2 and default[0] <= 2**18 and sum(default) == gradients
    assert len(small) >= 4 and max(small) <= 2**18 and sum(small) == gradients
