"""The expert axis and the mixture-of-experts layer (par4d.nn.moe): the axis folded over data (sizes,
coordinates, groups), the dispatcher's round trip (uneven loads, an expert without tokens, every token to
one expert), the all-to-all's bytes counted exactly, and the layer against its single-device twin in
float64 (routes, outputs, balance losses, every gradient) on expert=2 and expert=4, with replicas."""

import pytest
import torch

from par4d.grid import Grid, coords_of, describe, folded_groups, validate_sizes, world_of
from par4d.layout import shard, shard_batch, shard_features
from par4d.nn.base import full_state_dict, load_full_state_dict
from tests import cases

DIM, HIDDEN = 8, 12


def test_the_expert_axis_folds_over_data():
    sizes = validate_sizes({"x": 2, "data": 4, "expert": 2}, 8)
    assert world_of(sizes) == 8 and describe(sizes) == "x=2 y=1 z=1 data=4 pipe=1 expert=2"
    assert [coords_of(r, sizes)["expert"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # each group: consecutive data coordinates (x fixed); together they cover every rank once
    assert folded_groups(sizes, "expert") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert Grid.virtual({"data": 4, "expert": 4}, 2).group_ranks("expert") == [0, 1, 2, 3]
    assert "expert" not in validate_sizes({"data": 2}, 2) and describe({"data": 2}) == "x=1 y=1 z=1 data=2 pipe=1"
    with pytest.raises(ValueError, match=r"grid axis expert=2 folds over data=3, which it does not divide"):
        validate_sizes({"data": 3, "expert": 2}, 3)


def test_a_layer_the_grid_cannot_hold_is_named():
    from par4d.nn.moe import check_moe

    spread = Grid.virtual({"data": 4, "expert": 4})
    for experts, top_k, grid, said in [(6, 2, spread, "6 experts do not divide over expert=4 ranks"),
                                       (4, 5, spread, "top_k=5 must be from 1 to the 4 experts"),
                                       (4, 0, spread, "top_k=0 must be from 1 to the 4 experts")]:
        with pytest.raises(ValueError, match=said):
            check_moe("block.mlp", experts, top_k, grid)


def _round_trip(sizes: dict, routes: str) -> list[str]:
    """The dispatcher with an identity for experts: every (token, slot) comes back as its token, each
    expert saw exactly the tokens routed to it (from every source, source-major), and the gradient of
    every token is the sum of its slots'."""
    import torch.distributed as dist

    from par4d.nn.moe import dispatch

    grid = cases.grid(**sizes)
    n_experts, k, tokens = 4, 2, 6
    generator = torch.Generator().manual_seed(grid.coord("data"))
    x = torch.randn(tokens, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
    if routes == "uneven":                    # expert 0 most, expert 3 none
        chosen = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [1, 2]])
    else:                                     # every token to expert 3 (twice: both slots)
        chosen = torch.full((tokens, k), 3)
    seen = []

    def identity(rows, per_expert):
        seen.append((rows.detach().clone(), list(per_expert)))
        return rows * 1.0

    out, _ = dispatch(x, torch.arange(tokens).repeat_interleave(k), chosen.reshape(-1), n_experts, grid, identity)
    torch.testing.assert_close(out, x.repeat_interleave(k, 0), rtol=0, atol=0)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
    slots = torch.arange(out.numel(), dtype=out.dtype).view(tokens, k, DIM).sum(1)
    torch.testing.assert_close(x.grad, slots, rtol=0, atol=0)
    # what the experts of this rank saw: the tokens each source routed to them, source by source
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (grid.rank, x.detach(), chosen))
    group = grid.group_ranks("expert")
    rows, per_expert = seen[0]
    local = n_experts // grid.size("expert")
    start = 0
    for e in range(local):
        mine = grid.coord("expert") * local + e
        want = [xs[(ch == mine).any(1).nonzero().squeeze(1).repeat_interleave((ch == mine).sum(1)[(ch == mine).any(1)])]
                for rank, xs, ch in sorted(everyone, key=lambda r: group.index(r[0]) if r[0] in group else 99)
                if rank in group]
        want = torch.cat(want)
        assert per_expert[e] == len(want)
        torch.testing.assert_close(rows[start:start + len(want)], want, rtol=0, atol=0)
        start += len(want)
    return [f"{grid.rank}: {per_expert}"]


GRIDS = [dict(data=4, expert=4), dict(data=4, expert=2), dict(data=2, pipe=2, expert=2), dict(data=4),
         dict(x=2, data=2, expert=2), dict(y=2, data=2, expert=2), dict(z=2, data=2, expert=2)]


@pytest.mark.parametrize("routes", ["uneven", "one expert"])
@pytest.mark.parametrize("sizes", GRIDS[:3], ids=describe)
def test_the_dispatcher_returns_every_token_and_its_gradient(pool4, sizes, routes):
    pool4.run(_round_trip, sizes, routes)


def _exchange_bytes() -> list[int]:
    """One all-to-all of uneven rows: the ledger counts the rows sent to the other ranks, not one's own."""
    from par4d import comm

    grid = cases.grid(data=4, expert=4)
    me = grid.coord("expert")
    send = [me + i for i in range(4)]                  # rank r sends r + i rows to rank i
    receive = [i + me for i in range(4)]
    rows = torch.full((sum(send), 3), float(me))
    before = grid.ledger.total_bytes()
    out = comm.all_to_all(grid, rows, "expert", send, receive)
    assert out.tolist() == [[float(i)] * 3 for i in range(4) for _ in range(i + me)]
    return [grid.ledger.total_bytes() - before]


def test_the_all_to_all_counts_what_leaves_the_rank(pool4):
    moved = pool4.run(_exchange_bytes)
    assert moved == [[(sum(r + i for i in range(4)) - 2 * r) * 3 * 4] for r in range(4)]


def _mine(grid: Grid, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a residual-stream tensor: its samples (data, z), its features (y)."""
    return shard_features(grid, shard_batch(grid, tensor), "y")


def _squared_error(out: torch.Tensor, target: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each rank's share of the mean squared error over every feature: its features' sum over all of them."""
    return ((out - target) ** 2).sum() / (tokens * DIM)


def _against_the_twin(sizes: dict, score: str, seed: int, capacity: float | None = None, shared: int = 0,
                      groups: tuple[int, int] = (1, 1)) -> dict:
    """The parallel layer and its twin on the same global batch: routes, outputs, losses and every
    gradient (the router's averaged over the batch shards, each expert's summed over its replicas)."""
    from par4d import comm
    from par4d.nn.moe import MoE, ReferenceMoE, route, within_capacity
    from par4d.nn.moe import capacity as capacity_of

    grid = cases.grid(**sizes)
    shards = grid.size("z", "data")
    with cases.float64():
        torch.manual_seed(seed)
        twin = ReferenceMoE(DIM, HIDDEN, 4, 2, score=score, capacity_factor=capacity, shards=shards, shared=shared,
                            groups=groups)
        layer = MoE(DIM, HIDDEN, 4, 2, grid, score=score, capacity_factor=capacity, shared=shared, groups=groups)
        load_full_state_dict(layer, {name: p.detach() for name, p in twin.named_parameters()})
        batch = torch.randn(8, 3, DIM, generator=torch.Generator().manual_seed(seed + 1))
        target = torch.randn(8, 3, DIM, generator=torch.Generator().manual_seed(seed + 2))
        x = batch.clone().requires_grad_()
        (_squared_error(twin(x), target, 8 * 3) + twin.aux_loss).backward()
        mine = _mine(grid, batch).clone().requires_grad_()
        out = layer(mine)
        (_squared_error(out, _mine(grid, target), 8 * 3 // shards) + layer.aux_loss).backward()
    torch.testing.assert_close(out, _mine(grid, twin(batch)), rtol=0, atol=1e-13)
    chosen, _, scores, _ = route(batch.reshape(-1, DIM), twin.router.detach(), 2, score, True,   # the twin's routes
                                 groups=groups)
    if groups[0] > 1:        # every token's experts in the groups it was allowed
        assert all(len({int(e) // (4 // groups[0]) for e in row}) <= groups[1] for row in chosen)
    tokens = chosen.shape[0] // shards
    limit = capacity_of(capacity, tokens, 2, 4)
    kept = torch.cat([within_capacity(e, s, limit) for e, s in zip(chosen.split(tokens), scores.split(tokens))])
    assert layer.last_counts.tolist() == torch.bincount(chosen.reshape(-1)[kept.reshape(-1)], minlength=4).tolist()
    assert int(layer.last_dropped) == int((~kept).sum())
    aux = comm.all_reduce(grid, layer.aux_loss.detach().clone(), "z", "data") / shards   # each shard's share
    torch.testing.assert_close(aux, twin.aux_loss.detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(mine.grad, _mine(grid, x.grad) * shards, rtol=0, atol=1e-13)
    router = comm.all_reduce(grid, layer.router.grad.clone(), "z", "data") / shards
    torch.testing.assert_close(router, shard(grid, twin.router.grad, layer.router._par4d_placement), rtol=0,
                               atol=1e-13)
    for name in ("fc", "proj"):     # each expert's gradient (summed over z by Algorithm 1), over its replicas
        held = shard(grid, getattr(twin, name).grad, getattr(layer, name)._par4d_placement)
        torch.testing.assert_close(_replica_sum(grid, getattr(layer, name).grad) / shards, held, rtol=0, atol=1e-13)
    if shared:      # the shared experts: Linears, their gradients summed over the batch shards (data)
        grads = full_state_dict(layer.shared, grad=True)
        for name, param in twin.shared.named_parameters():
            total = comm.all_reduce(grid, grads[name].clone(), "data") / shards
            torch.testing.assert_close(total, param.grad, rtol=0, atol=1e-13)
    return {"counts": layer.last_counts.tolist(), "dropped": int(layer.last_dropped)}


def _replica_sum(grid: Grid, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` summed over the data ranks that hold the same experts (what the data-parallel sync will do)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    mine = tuple(grid.coord(a) for a in ("expert", "pipe", "x", "y", "z"))   # the same shard (a second pipeline
                                                                               # stage runs its own copy here)
    dist.all_gather_object(every, (mine, grad))
    return sum(g for held, g in every if held == mine)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("sizes", GRIDS, ids=describe)
def test_the_layer_is_its_single_device_twin(pool4, sizes, score):
    counts = pool4.run(_against_the_twin, sizes, score, 3)
    assert all(c == counts[0] for c in counts) and sum(counts[0]["counts"]) == 8 * 3 * 2


@pytest.mark.parametrize("sizes", GRIDS[:2], ids=describe)
def test_a_capacity_drops_the_twins_tokens(pool4, sizes):
    """capacity_factor 0.5: each expert takes ceil(0.5 * tokens * k / E) of a rank's assignments, those of
    the highest scores; the same are dropped as by the twin (which counts capacity per batch shard), and the
    outputs and gradients still equal its."""
    found = pool4.run(_against_the_twin, sizes, "softmax", 3, 0.5)
    assert found[0]["dropped"] > 0 and sum(found[0]["counts"]) + found[0]["dropped"] == 8 * 3 * 2


def test_an_expert_keeps_its_best_scored_assignments_up_to_capacity():
    from par4d.nn.moe import capacity, within_capacity

    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2]])
    scores = torch.tensor([[.5, .2, .3], [.6, .1, .3], [.3, .4, .3], [.5, .1, .4]], dtype=torch.float64)
    assert capacity(0.75, 4, 2, 3) == 2 and capacity(None, 4, 2, 3) is None
    # expert 0: tokens 0 (.5), 1 (.6), 2 (.3), 3 (.5): keeps 1 and 0 (ties go to the earlier token); expert 1:
    # 0 (.2), 1 (.1), 2 (.4): keeps 2 and 0; expert 2: token 3 only
    assert within_capacity(experts, scores, 2).tolist() == [[True, True], [True, False], [True, False],
                                                            [False, True]]
    assert within_capacity(experts, scores, None).all()


def _trained(sizes: dict, folder: str | None, saved: dict | None, bias_rate: float = 0.0) -> dict:
    """3 AdamW steps of the layer (its gradients synced over data, experts' over their replicas; the global
    norm of its gradients) against the twin's on the whole batch; then saved (its full state returned), or,
    given what another grid saved, that checkpoint loaded here: this grid's shards of it, bit for bit."""
    from pathlib import Path

    from par4d import checkpoint
    from par4d.nn.moe import MoE, ReferenceMoE, update_expert_bias
    from par4d.optim.data_parallel import grad_norm, sync_gradients

    grid = cases.grid(**sizes)
    norms = []
    with cases.float64():
        torch.manual_seed(5)
        twin = ReferenceMoE(DIM, HIDDEN, 4, 2, bias_rate=bias_rate)
        layer = MoE(DIM, HIDDEN, 4, 2, grid, bias_rate=bias_rate)
        layer.load_full_state({name: p.detach() for name, p in twin.named_parameters()})
        biases = []
        # eps 1e-4: AdamW's update divides by sqrt(v) + eps, so at the default 1e-8 round-off in a near-zero
        # gradient (1e-17 here) would come out of it 1e6 times larger: a bound on the amplification, not on the sum
        ours = torch.optim.AdamW(layer.parameters(), lr=0.05, eps=1e-4)
        theirs = torch.optim.AdamW(twin.parameters(), lr=0.05, eps=1e-4)
        for step in range(3):
            batch = torch.randn(8, 3, DIM, generator=torch.Generator().manual_seed(step))
            target = batch.flip(-1)
            for model, x, t, tokens, opt in ((twin, batch, target, 8 * 3, theirs),
                                             (layer, _mine(grid, batch), _mine(grid, target),
                                              8 * 3 // grid.size("z", "data"), ours)):
                opt.zero_grad()
                _squared_error(model(x), t, tokens).add(model.aux_loss).backward()
            sync_gradients(layer, grid)
            # the global norm counts each expert once (the expert group's ranks hold different ones)
            norms.append((grad_norm(layer, grid).item(),
                          torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in twin.parameters()])).item()))
            ours.step()
            theirs.step()
            update_expert_bias(layer)
            update_expert_bias(twin)
            assert torch.equal(layer.expert_bias, twin.expert_bias)    # signs of integer loads: exact
            biases.append(layer.expert_bias.tolist())
    for name, value in layer.full_state().items():
        torch.testing.assert_close(value, getattr(twin, name).detach(), rtol=0, atol=1e-11)
    found = {"norms": norms, "biases": biases}
    if folder is not None:
        checkpoint.save(Path(folder), 3, grid, layer, ours, {})
        found["state"] = layer.full_state()
    if saved is not None:
        with cases.float64():
            fresh = MoE(DIM, HIDDEN, 4, 2, grid)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05, eps=1e-4)
        assert checkpoint.load(Path(saved["folder"]), grid, fresh, fresh_opt)["step"] == 3
        for name, param in fresh.named_parameters():
            assert torch.equal(param, shard(grid, saved["state"][name], param._par4d_placement)), name
            assert fresh_opt.state[param]["exp_avg_sq"].shape == param.shape
    return found


def test_loss_free_balancing_moves_the_bias_as_the_twins(pool4):
    """DeepSeek-V3's bias (bias_rate 0.1): after each step every expert's bias moved by the rate towards the
    mean load, the same on every rank and as the twin's, and the routes it biases keep the layer the twin's."""
    biases = pool4.run(_trained, dict(data=4, expert=2), None, None, 0.1)[0]["biases"]
    assert all(abs(b) in (0.0, 0.1) for b in biases[0]) and biases[0] != [0.0] * 4
    assert all(round(abs(b - a), 9) in (0.0, 0.1) for before, after in zip(biases, biases[1:])
               for a, b in zip(before, after))


def test_three_adamw_steps_equal_the_twins_and_the_checkpoint_loads_at_any_expert_size(pool4, tmp_path):
    folder = str(tmp_path / "expert4")
    first = pool4.run(_trained, dict(data=4, expert=4), folder, None)[0]
    saved = {"folder": folder, "state": first["state"]}
    # (a pipe=2 grid would hold the layer on both stages)
    for sizes in (dict(data=4, expert=2), dict(data=4), dict(x=2, data=2, expert=2), dict(z=2, data=2, expert=2)):
        norms = pool4.run(_trained, sizes, None, saved)[0]["norms"]
        assert all(abs(ours - theirs) <= 1e-12 * theirs for ours, theirs in first["norms"] + norms), norms


def _gpt_with_experts(sizes: dict, shared: int = 0) -> int:
    from dataclasses import replace

    from tests.cases import GPT_CONFIG, compare_gpt_with_twin

    config = replace(GPT_CONFIG, mlp="moe", experts=4, top_k=2, shared_experts=shared)
    with cases.float64():
        return compare_gpt_with_twin(cases.grid(**sizes), sizes, config)


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(data=4, expert=2), dict(x=2, data=2, expert=2),
                                   dict(y=2, data=2, expert=2), dict(z=2, data=2, expert=2),
                                   dict(context=2, data=2, expert=2)], ids=describe)
def test_the_gpt_with_experts_is_its_twin(pool4, sizes):
    """par4d's GPT with a mixture in every block (--mlp moe): its loss (the balance losses in it), every
    gradient and the parameters after AdamW steps, against the single-device twin, in float64; and the
    count of its parameters from the config alone."""
    from dataclasses import replace

    from par4d.train.recipes.gpt import build_reference
    from tests.cases import GPT_CONFIG

    shared = 1 if "x" in sizes else 0          # (one grid with a shared expert: its Linears on x)
    config = replace(GPT_CONFIG, mlp="moe", experts=4, top_k=2, shared_experts=shared)
    twin = build_reference(config, init=False)
    assert pool4.run(_gpt_with_experts, sizes, shared) == [len(list(twin.parameters()))] * 4
    assert config.num_params() == sum(p.numel() for p in twin.parameters())


SHAPE = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8", "--no-progress",
         "--peak-flops", "1e11", "--no-tensorboard"]
SMALL_MOE = ["--mlp", "moe", "--experts", "4", "--top-k", "2", "--expert-bias-rate", "0.01", *SHAPE]


def test_par4d_train_spreads_the_experts_and_resumes_on_another_expert_grid(tmp_path, capsys, pool2, pool4):
    """`par4d train --mlp moe --grid data=4,expert=4` (with loss-free balancing): the run records each layer's
    load per step, the summary names the worst layer's; resumed on data=2,expert=2 (experts two to a rank,
    compiled: nothing compiled again as the loads change) and on one rank (every expert there) it goes on from
    its checkpoint (the bias included) and follows a one-rank run. Loosely: in fp32 a route may flip on round-off
    between grids (exactness is proven in float64 above), which moves a loss by far less than 1%, while a lost
    bias or expert shard moves it more."""
    import json

    from tests.helpers import checked_config, run_losses, train_alone, train_pooled

    run, alone = tmp_path / "moe", tmp_path / "alone"
    train_alone(checked_config("--nproc", "1", *SMALL_MOE, "--steps", "7", "--out", str(alone), world=1))
    train_pooled(pool4, "--grid", "data=4,expert=4", *SMALL_MOE, "--steps", "3", "--out", str(run))
    said = capsys.readouterr().out
    assert "a mixture of 4 experts in every block (top 2)" in said
    assert "(par4d's count: the top-k experts a token meets)" in said and "Eq 3" not in said   # Eq 3 is dense
    resolved = (run / "config.toml").read_text()      # what --config reads to train the same run again
    assert all(line in resolved.splitlines()
               for line in ("expert = 4", "experts = 4", "top_k = 2", 'mlp = "moe"', "expert_bias_rate = 0.01"))
    pool2.run(torch._dynamo.reset)
    made = train_pooled(pool2, "--resume", str(run), "--grid", "data=2,expert=2", "--steps", "6",
                        "--compile", "aot_eager")["compiled"]
    assert made["graphs"] > 0 and made["recompiled_graphs"] == 0    # the mixture eager: its loads change each step
    train_alone(checked_config("--resume", str(run), "--grid", "x=1", "--steps", "7", world=1))
    assert run_losses(run) == pytest.approx(run_losses(alone), rel=1e-2)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert len(row["expert_tokens_max"]) == 2 and row["expert_tokens_mean"] == [8 * 16 * 2 / 4] * 2
    assert row["expert_imbalance"] == max(m / 64 for m in row["expert_tokens_max"])
    assert "busiest expert of the worst layer" in capsys.readouterr().out


@pytest.mark.parametrize("flags,said", [
    (["--grid", "data=3,expert=2", "--nproc", "3"], "expert=2 folds over data=3"),
    (["--grid", "data=2,expert=2", "--experts", "3"], "3 experts do not divide over expert=2"),
    (["--grid", "data=2,expert=2", "--top-k", "5"], "experts >= 2 and top_k from 1 to experts"),
    (["--grid", "data=2,expert=2", "--mlp", "dense"], "--mlp dense has none (give --mlp moe)"),
    (["--experts", "4", "--mlp", "dense", "--grid", "data=2"], "--experts 4: a setting of a mixture of experts"),
    (["--shared-experts", "1", "--mlp", "dense"], "--shared-experts 1: a setting of a mixture of experts"),
    (["--capacity-factor", "-1"], "GPTConfig.capacity_factor=-1.0 must be a finite number >= 0"),
])
def test_a_grid_the_experts_cannot_take_is_refused_before_any_rank_starts(tmp_path, capsys, flags, said):
    from par4d.cli import main

    args = SHAPE if "--mlp" in flags else SMALL_MOE
    assert main(["train", *args, *flags, "--out", str(tmp_path / "refused")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_the_gpt_with_experts_is_its_twin_on_every_axis(pool16):
    """x, y, z, data all 2 and the experts spread over data: every tensor axis splits each expert's GEMMs
    while expert spreads them (16 ranks: the expert axis folds over data, which needs 2 of them)."""
    sizes = dict(x=2, y=2, z=2, data=2, expert=2)
    assert len(set(pool16.run(_gpt_with_experts, sizes, timeout=300))) == 1


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(x=2, data=2, expert=2), dict(y=2, data=2, expert=2),
                                   dict(z=2, data=2, expert=2)], ids=describe)
def test_shared_experts_join_every_token_as_the_twins(pool4, sizes):
    """shared=1: a dense MLP of an expert's width that every token goes through, beside the routed ones."""
    found = pool4.run(_against_the_twin, sizes, "softmax", 4, None, 1)
    assert sum(found[0]["counts"]) == 8 * 3 * 2


def _overlapped_and_not(sizes: dict) -> dict:
    """The same layer with the shared experts' GEMMs run while the rows travel (``--overlap ep``), and without
    (``--overlap none``, through set_overlap, as par4d train sets it): the same bits, and the rows' all-to-all
    issued before them (in flight over them) and waited for after."""
    from par4d.nn.moe import MoE
    from par4d.overlap import Overlap, set_overlap

    grid = cases.grid(**sizes)
    results = []
    for settings in (Overlap.parse("ep"), Overlap.none()):
        torch.manual_seed(6)
        layer = set_overlap(MoE(DIM, HIDDEN, 4, 2, grid, shared=1, overlap=not settings.experts), settings)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        x = _mine(grid, torch.randn(8, 3, DIM, generator=torch.Generator().manual_seed(7))).requires_grad_()
        with grid.ledger.capture() as entries:
            out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, [p.grad for p in layer.parameters()],
                        [e.overlapped for e in entries if e.kind == "all_to_all"]))
    (out, grad, grads, overlapped), (out_sync, grad_sync, grads_sync, sync) = results
    assert torch.equal(out, out_sync) and torch.equal(grad, grad_sync)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_sync))
    return {"overlapped": overlapped, "sync": sync}


def test_the_exchange_is_hidden_behind_the_shared_experts_bit_for_bit(pool4):
    found = pool4.run(_overlapped_and_not, dict(x=2, data=2, expert=2))[0]
    # the counts, then the rows (issued before the shared experts, waited after), then the way back
    assert found == {"overlapped": [False, True, False], "sync": [False, False, False]}


def _bench_rows() -> list[dict]:
    from par4d.bench.moe import MoESettings, moe_worker

    return moe_worker(MoESettings(nproc=4, iters=1, warmup=0))


def test_bench_moe_rows_count_what_each_rank_holds(pool4):
    """`par4d bench moe`'s rows: par4d's expert grids beside DDP and FSDP2 of the same model; the expert bytes
    a rank holds are exact: all of them under DDP and on a grid without experts, a quarter with them spread
    over 4 ranks or sharded by FSDP2, a half over 2 (and a quarter again when x=2 splits each of those)."""
    rows = {(r["name"], r["grid"]): r for r in pool4.run(_bench_rows, timeout=240)[0]}
    whole = rows[("torch DDP", "data=4")]["expert_bytes_per_rank"]
    held = {grid: r["expert_bytes_per_rank"] for (name, grid), r in rows.items() if name == "par4d"}
    assert held == {"x=1 y=1 z=1 data=4 pipe=1 expert=4": whole // 4, "x=1 y=1 z=1 data=4 pipe=1 expert=2": whole // 2,
                    "x=2 y=1 z=1 data=2 pipe=1 expert=2": whole // 4, "x=1 y=1 z=1 data=4 pipe=1": whole}
    assert rows[("torch FSDP2", "data=4")]["expert_bytes_per_rank"] == whole // 4
    assert min(r["ratio_to_best_peer"] for r in rows.values() if r["framework"] == "torch") == 1.0
    assert all({"framework", "name", "s_per_iter"} <= set(r) for r in rows.values())


def _compiled_twin_rows() -> dict:
    from dataclasses import replace

    from par4d.bench.moe import MoESettings, _timed
    from par4d.train.recipes.gpt import build_reference
    from tests.cases import GPT_CONFIG

    config = replace(GPT_CONFIG, mlp="moe", experts=4, top_k=2)
    model = build_reference(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    batches = iter(torch.randint(0, config.vocab_size, (16, 4, config.block_size + 1), generator=gen))

    def step() -> None:         # a new batch every step: each expert's load changes
        tokens = next(batches)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(model, step, MoESettings(nproc=2, iters=4, warmup=1, compile="aot_eager"))[1]


def test_bench_moe_compiles_a_peers_blocks_once(pool2):
    """`par4d bench moe --compile`: a row's blocks compiled (here the peers' twin, its routed part eager), the
    compiling step timed apart, and no graph compiled again over steps whose expert loads differ."""
    for found in pool2.run(_compiled_twin_rows):
        assert found["graphs"] > 0 and found["compile_s"] > 0       # compiled, in its first step
        assert found["recompiled_graphs"] == 0


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(y=2, data=2, expert=2)], ids=describe)
def test_group_limited_routing_is_the_twins(pool4, sizes):
    """groups=(2, 1): the 4 experts in 2 groups, each token's 2 chosen inside the one group whose two best
    scores sum highest (DeepSeek-V3's group-limited routing)."""
    found = pool4.run(_against_the_twin, sizes, "sigmoid", 5, None, 0, (2, 1))
    assert sum(found[0]["counts"]) == 8 * 3 * 2


def test_group_limits_the_grid_cannot_hold_are_named():
    from par4d.nn.moe import check_moe

    for groups in ((3, 1), (2, 3), (4, 1)):       # 3 does not divide 4; 3 of 2 groups; one expert a group < top_k
        with pytest.raises(ValueError, match=rf"groups=\({groups[0]}, {groups[1]}\): give G groups dividing"):
            check_moe("block.mlp", 4, 2, Grid.virtual({"data": 2}), groups=groups)


def _with_and_without_recomputation(sizes: dict) -> dict:
    """Two steps of par4d's GPT with experts and loss-free balancing, recomputed every block and not: per step
    the loss, every gradient, each mixture's load as counted for the bias (after backward, which recomputes)
    and the biases after the step."""
    from dataclasses import replace

    from par4d.nn.moe import update_expert_bias
    from par4d.optim.data_parallel import sync_gradients
    from par4d.train.recipes.gpt import build_gpt
    from tests.cases import GPT_CONFIG

    config = replace(GPT_CONFIG, mlp="moe", experts=4, top_k=2, expert_bias_rate=0.1)
    grid = cases.grid(**sizes)
    found = {}
    for every in (0, 1):
        model = build_gpt(config, grid, recompute=every)
        mixtures = [m for m in model.modules() if hasattr(m, "expert_bias")]
        gen = torch.Generator().manual_seed(0)
        steps = []
        for _ in range(2):
            tokens = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=gen)
            loss = model(shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:]))
            loss.backward()
            sync_gradients(model, grid)
            seen = [loss.detach(), *(p.grad.clone() for p in model.parameters()),
                    *(m.pending_load.clone() for m in mixtures)]
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
            update_expert_bias(model)
            steps.append(seen + [m.expert_bias.clone() for m in mixtures])
        found[every] = steps
    same = all(torch.equal(a, b) for plain, recomputed in zip(found[0], found[1]) for a, b in zip(plain, recomputed))
    load = [int(m.sum()) for m in found[1][0][-2 * 2:-2]]           # the first step's load, each mixture
    return {"same": same, "load": load, "moved": bool(found[1][0][-1].abs().sum() > 0)}


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(x=2, data=2, expert=2)], ids=describe)
def test_recomputed_experts_give_the_same_bits_and_count_their_load_once(pool4, sizes):
    """--recompute with experts: every block recomputed in backward, its exchanges run again; the losses,
    gradients, the load counted for loss-free balancing (once: a recomputed forward does not count it again)
    and the biases after two steps are bit for bit those without."""
    from tests.cases import GPT_CONFIG

    found = pool4.run(_with_and_without_recomputation, sizes)
    assignments = 8 * GPT_CONFIG.block_size * 2           # the batch's tokens, top 2: counted once
    assert all(r == {"same": True, "load": [assignments] * 2, "moved": True} for r in found), found


def _pipelined_experts(sizes: dict, microbatches: int) -> dict:
    """par4d's GPT with experts through the pipeline against the twin, in float64: each microbatch's balance
    losses are the m-th pieces' of every batch shard together (the experts' counts are summed over the
    batch's ranks per microbatch), so the twin runs microbatch by microbatch; loss, every gradient of this
    stage, and the parameters after 3 AdamW steps."""
    from dataclasses import replace

    from par4d.optim.data_parallel import global_mean, sync_gradients
    from par4d.pipeline import run_pipeline
    from par4d.train.recipes.gpt import build_gpt, build_reference
    from tests.cases import GPT_CONFIG

    config = replace(GPT_CONFIG, mlp="moe", experts=4, top_k=2)
    far = []
    with cases.float64():
        grid = cases.grid(**sizes)
        twin, model = build_reference(config), build_gpt(config, grid)
        mine = {name for name, _ in model.named_parameters()}
        opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
        gen = torch.Generator().manual_seed(0)
        shards = grid.size("z", "data")
        for step in range(3):
            tokens = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=gen)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            ref = 0.0
            pieces = [[t.tensor_split(microbatches) for t in pair.tensor_split(shards)] for pair in (inputs, targets)]
            for m in range(microbatches):
                x, y = (torch.cat([shard[m] for shard in part]) for part in pieces)
                loss_m = twin(x, y) / microbatches
                loss_m.backward()
                ref += loss_m.item()
            loss, _ = run_pipeline(model, grid, shard_batch(grid, inputs), shard_batch(grid, targets), microbatches)
            sync_gradients(model, grid)
            if abs(global_mean(loss, grid).item() - ref) > 1e-10 * abs(ref):
                far.append(f"step {step} loss {global_mean(loss, grid).item()} vs {ref}")
            grads = model.reference_state(grad=True)
            far += [f"step {step} grad {n}" for n, p in twin.named_parameters()
                    if n in mine and not torch.allclose(grads[n], p.grad, rtol=1e-8, atol=1e-11)]
            opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
        after = model.reference_state()
        far += [f"{n} after 3 steps" for n, p in twin.named_parameters()
                if n in mine and not torch.allclose(after[n], p, rtol=1e-8, atol=1e-11)]
    return {"far": far, "stage": grid.coord("pipe"), "params": sorted(mine)}


@pytest.mark.parametrize("sizes", [dict(pipe=2, data=2, expert=2), dict(pipe=2, y=2)], ids=describe)
def test_the_gpt_with_experts_through_the_pipeline_is_its_twin(pool4, sizes):
    """pipe=2 with the experts spread over data (and, on y=2, every expert on each rank but each GEMM split):
    every rank of a stage takes the pipeline's messages in the leader's order (the experts' exchanges and
    counts span data), a stage before the last starts each microbatch's backward from its own balance losses
    too, and the loss returned counts them."""
    from dataclasses import replace

    from par4d.train.recipes.gpt import build_reference
    from tests.cases import GPT_CONFIG

    found = pool4.run(_pipelined_experts, sizes, 2)
    assert all(not r["far"] for r in found), [r["far"] for r in found]
    names = {n for n, _ in build_reference(replace(GPT_CONFIG, mlp="moe", experts=4, top_k=2)).named_parameters()}
    assert set().union(*(r["params"] for r in found)) == names
