"""The planner's mixtures of experts (``par4d.plan.experts``): the built-in shapes' parameters are
transformers' models' exactly, their FLOPs the count torchtitan's published MFU uses, the token exchange's
bytes are what par4d's ledger counts on real grids, and ``par4d plan`` ranks expert sizes with x, z and data."""

import pytest
import torch

from par4d.plan.experts import MOE_MODELS, MoESpec, exchange_bytes, predict, rank_grids
from par4d.plan.machines import BUILTIN
from tests import cases


def _transformers_config(name: str):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    return {"mixtral-8x7b": lambda: MixtralConfig(
                vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
            "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
                vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8),
            "qwen3-235b-a22b": lambda: Qwen3MoeConfig(
                vocab_size=151936, hidden_size=4096, moe_intermediate_size=1536, num_hidden_layers=94,
                num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8),
            "deepseek-v3-671b": DeepseekV3Config}[name]()     # (its defaults are DeepSeek-V3's shape)


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_a_built_in_mixtures_parameters_are_transformers_models(name):
    """Counted from the shape alone, exactly the parameters of transformers' model of it (built on meta)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_transformers_config(name))
    assert MOE_MODELS[name].params() == sum(p.numel() for p in model.parameters())


def test_flops_per_token_are_the_count_behind_torchtitans_published_mfu():
    """torchtitan's DeepSeek-V3 on 512 H100s: 346 tokens/s/GPU at 9.8% MFU of 989 TFLOP/s, at 4096 tokens a
    sequence: the same FLOPs per token, to the figure's 3 digits. Active weights: 37B as published."""
    spec = MOE_MODELS["deepseek-v3-671b"].with_batch(512, 4096)
    assert round(346 * spec.flops_per_token() / 989e12, 3) == 0.098
    assert round(spec.active_matmul_params() / 1e9) == 37        # the head counted, the embedding (a lookup) not


DIM, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2


def _ledger_against_the_plan(sizes: dict) -> tuple[int, float]:
    """One forward and backward of a mixture on ``sizes``: (the all-to-all bytes this rank's ledger counts, less
    the per-expert counts' exchange; what exchange_bytes says, given the share of rows this rank's routes
    send away and receive, from every rank's routes)."""
    from par4d.layout import shard_batch, shard_features
    from par4d.nn.moe import MoE, route

    grid = cases.grid(**sizes)
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, TOP_K, grid, aux_weight=0, z_weight=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
        router = torch.randn(EXPERTS, DIM, generator=torch.Generator().manual_seed(1))
        layer.router.copy_(shard_features(grid, router, "y"))
    batch = torch.randn(8, 6, DIM, generator=torch.Generator().manual_seed(2))
    mine = shard_features(grid, shard_batch(grid, batch), "y").requires_grad_()
    with grid.ledger.capture() as entries:
        layer(mine).square().sum().backward()
    moved = sum(e.bytes for e in entries if e.kind == "all_to_all")
    spread, shards = grid.size("expert"), grid.size("z", "data")
    per_rank = EXPERTS // spread
    counts = (spread - 1) * per_rank * 8                        # int64 counts to each other rank, forward only
    # Every shard's routes (the router is whole here): what this rank sends away, and what the others send it
    experts = route(batch.reshape(-1, DIM), router, TOP_K, "softmax", True)[0].view(shards, -1)
    group = [(grid.coord("data") // spread) * spread + i for i in range(spread)]   # data coords of my expert group
    me, z = grid.coord("data"), grid.coord("z")
    # each member's assignments' destinations (its batch shard: blocks over data, then z inside)
    mine_at = {d: experts[d * grid.size("z") + z] // per_rank for d in group}
    sent = int((mine_at[me] != me % spread).sum())
    received = sum(int((mine_at[d] == me % spread).sum()) for d in group if d != me)
    spec = MoESpec("one mixture", n_layer=1, hidden=DIM, heads=1, kv_heads=1, head_dim=DIM, experts=EXPERTS,
                   top_k=TOP_K, expert_hidden=HIDDEN, vocab=1, seq_len=6, global_batch=8)
    rows = 8 * 6 // shards * TOP_K
    return moved - counts, exchange_bytes(spec, grid.sizes | {"expert": spread}, 4, (sent + received) / (2 * rows))


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(y=2, data=2, expert=2), dict(z=2, data=2, expert=2)],
                         ids=["d4e4", "y2d2e2", "z2d2e2"])
def test_the_exchanges_bytes_are_what_the_ledger_counts(pool4, sizes):
    """Dispatch and combine, forward and backward: each rank's bytes exactly, rows of hidden / y elements."""
    for counted, planned in pool4.run(_ledger_against_the_plan, sizes):
        assert counted == planned > 0


def test_plan_ranks_expert_sizes_with_the_other_axes():
    """Mixtral on 64 H100s: at z=2 or z=8 its states fit only with the experts spread (expert=8); x multiplies the
    exchange (every rank of x sends the same rows); an expert size that does not divide the experts, or a z
    that does not divide an expert's width, is excluded, named; the fitting grids come fastest first."""
    spec = MOE_MODELS["mixtral-8x7b"].with_batch(256, 4096)
    h100 = BUILTIN["h100"]
    ranked, excluded = rank_grids(spec, 64, h100)
    assert all(a.t_iter <= b.t_iter for a, b in zip(ranked, ranked[1:])) and all(p.fits for p in ranked)
    for z in (2, 8):
        assert predict(spec, dict(z=z, data=64 // z, expert=8), h100).fits
        assert predict(spec, dict(z=z, data=64 // z, expert=1), h100).excluded.startswith("needs")
    spread = predict(spec, dict(x=1, z=2, data=32, expert=8), h100)
    split = predict(spec, dict(x=2, z=1, data=32, expert=8), h100)
    assert split.recompute == spread.recompute and split.exchange_bytes == 2 * spread.exchange_bytes
    assert predict(spec, dict(data=64, expert=16), h100).excluded == "expert=16 does not divide the 8 experts"
    qwen = MOE_MODELS["qwen3-30b-a3b"].with_batch(1024, 4096)
    assert predict(qwen, dict(z=512, data=1), h100).excluded == "x*z=512 does not divide the experts' width 768"
    assert any(p.excluded.startswith("needs") for p in excluded)


def test_par4d_plan_prints_a_mixtures_ranking_and_refuses_what_it_does_not_price(capsys):
    from par4d.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--machine", "h100", "--seq-len", "4096",
                 "--batch-tokens", str(64 * 4096), "--top", "3", "--imbalance", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b: 30.5B parameters" in out and "imbalance 1.2" in out
    assert len([line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]) == 3
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--pipe", "2"]) == 2
    assert "--pipe: the planner ranks a mixture of experts' x, z, data and expert sizes only" in \
        capsys.readouterr().err
    assert main(["plan", "--model", "gpt-20b", "--gpus", "8", "--imbalance", "1.5"]) == 2
    assert "--imbalance: a setting of a mixture of experts" in capsys.readouterr().err


def test_the_gpts_mixture_is_counted_as_the_model_it_builds():
    """par4d's GPT with --mlp moe as the planner's mixture: its parameters those of the single-device twin (GELU
    experts, biases, LayerNorms, learned positions) and its FLOPs the model's own count."""
    from par4d.models import ReferenceGPT
    from par4d.models.config import GPTConfig
    from par4d.plan.experts import gpt_spec

    for shared in (0, 1):
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_embd=24, n_head=4, mlp="moe", experts=4,
                           top_k=2, shared_experts=shared)
        spec = gpt_spec(config, global_batch=8)
        assert spec.params() == sum(p.numel() for p in ReferenceGPT(config, init=False).parameters())
        assert spec.flops_per_token() == config.flops_per_token()
    with pytest.raises(ValueError, match="mlp='dense' is not a mixture"):
        gpt_spec(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_embd=24, n_head=4), global_batch=8)


def test_train_grid_auto_ranks_expert_sizes_for_the_gpts_mixture(tmp_path, capsys):
    """--grid auto with --mlp moe: the mixture planner's fastest grid among those the model can be built on, the
    expert axis chosen with x, z and data; recomputation where the activations do not fit, or as --recompute
    says; it names the choice and the next."""
    from par4d.cli import _parser
    from par4d.cli.configure import configure
    from par4d.measure.choose import planned_run
    from par4d.models.config import GPTConfig
    from par4d.plan.experts import gpt_spec
    from par4d.plan.machines import Machine

    # Slow links and enough memory for every grid: the exchange and the syncs decide
    local = Machine("local", devices_per_node=4, peak_flops=50e9, memory_bytes=1e9, beta_intra=1e8, beta_inter=1e8,
                    latency=5e-4, bytes_per_element=4)
    profile = tmp_path / "local.toml"
    profile.write_text(local.to_toml())
    flags = ["train", "--grid", "auto", "--machine", str(profile), "--n-layer", "2", "--n-embd", "64", "--n-head",
             "4", "--seq-len", "64", "--batch-size", "16", "--mlp", "moe", "--experts", "8", "--top-k", "2",
             "--out", str(tmp_path / "run")]
    config = configure(_parser().parse_args(flags), 4, inside=False, planner=planned_run)
    model = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_embd=64, n_head=4, mlp="moe", experts=8, top_k=2)
    ranked = [p for p in rank_grids(gpt_spec(model, 16), 4, local)[0]
              if model.grid_problem({**p.sizes, "y": 1}) is None]
    assert {**dict(x=1, z=1, data=1, expert=1), **config.grid} == ranked[0].sizes
    assert {p.sizes["expert"] for p in ranked} == {1, 2, 4}           # ranked with the other axes
    assert config.recompute == ("1" if ranked[0].recompute else "none") and config.overlap == "all"
    out = capsys.readouterr().out
    assert f"expert={ranked[0].sizes['expert']}" in out and "token exchange" in out and "next" in out
    forced = configure(_parser().parse_args([*flags, "--recompute", "1"]), 4, inside=False, planner=planned_run)
    assert forced.recompute == "1"
    with pytest.raises(ValueError, match="--grid auto plans par4d's GPT, dense or with --mlp moe; give --grid for "
                                         "--mlp phantom"):
        configure(_parser().parse_args([*flags[:-8], "--mlp", "phantom", "--out", str(tmp_path / "p")]), 4,
                  inside=False, planner=planned_run)
