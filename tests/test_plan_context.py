"""The planner's long sequences (``par4d.plan.context``): a built-in shape's parameters are transformers' model's
exactly, the ring's bytes are what par4d's ledger counts on real grids (with and without recomputation), and
``par4d plan`` ranks context sizes with x, z and data."""

import pytest
import torch

from par4d.plan.context import LONG_MODELS, LongSpec, predict, rank_grids, ring_bytes
from par4d.plan.machines import BUILTIN
from tests import cases


def test_a_built_in_shapes_parameters_are_transformers_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = LONG_MODELS["llama3-8b"]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                                             num_hidden_layers=spec.n_layer, num_attention_heads=spec.heads,
                                             num_key_value_heads=spec.kv_heads, tie_word_embeddings=False))
    assert spec.params() == sum(p.numel() for p in model.parameters()) == 8_030_261_248


def _ring_sent(sizes: dict, recompute: int) -> int:
    """The bytes one training step of par4d's GPT sends around the context ring, from the ledger."""
    from par4d.layout import shard_batch
    from par4d.models import GPTConfig
    from par4d.train.recipes.gpt import build_gpt

    grid = cases.grid(**sizes)
    config = GPTConfig(vocab_size=36, block_size=16, n_layer=2, n_head=4, n_embd=24, seed=3)
    model = build_gpt(config, grid, recompute)
    tokens = torch.randint(0, 36, (4, 17), generator=torch.Generator().manual_seed(0))
    with grid.ledger.capture() as entries:
        model(shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])).backward()
    return sum(e.bytes for e in entries if e.kind == "send" and e.axes == ("context",))


@pytest.mark.parametrize("sizes", [dict(context=4), dict(x=2, context=2), dict(context=2, data=2)],
                         ids=["context4", "x2-context2", "context2-data2"])
@pytest.mark.parametrize("recompute", [0, 1])
def test_the_rings_bytes_are_what_the_ledger_counts(pool4, sizes, recompute):
    spec = LongSpec("gpt", n_layer=2, hidden=24, heads=4, kv_heads=4, head_dim=6, ffn=96, vocab=36, seq_len=16,
                    global_batch=4)
    full = {"x": 1, "z": 1, "data": 1, **sizes}
    assert set(pool4.run(_ring_sent, sizes, recompute)) == {ring_bytes(spec, full, 4, recompute=bool(recompute))}


def test_plan_ranks_context_sizes_with_the_other_axes(capsys):
    """Llama-3 8B, one sequence of 262,144 tokens on 8 H100s: no batch to split over z or data, and the states
    of 8B fit only with x=4 (context ranks hold whole weights): x=4,context=2 recomputed; 8 sequences of
    131,072 rank z with context; a context size whose chunks do not divide the sequence is excluded, named."""
    from par4d.cli import main

    h100 = BUILTIN["h100"]
    spec = LONG_MODELS["llama3-8b"].with_batch(1, 262144)
    ranked, excluded = rank_grids(spec, 8, h100)
    assert [p.sizes for p in ranked] == [dict(x=4, z=1, context=2, data=1)] and ranked[0].recompute
    assert all(a.t_iter <= b.t_iter for a, b in zip(ranked, ranked[1:]))
    assert predict(spec.with_batch(1, 262150), dict(context=8), h100).excluded == \
        "context=8: sequences of 262150 do not cut into 16 equal chunks"
    assert any(p.excluded.startswith("needs") for p in excluded)
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--machine", "h100", "--seq-len", "131072",
                 "--batch-tokens", str(8 * 131072), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b: 8.03B parameters" in out and " ctx " in out
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--pipe", "2"]) == 2
    assert "--pipe: the planner ranks a long sequence's x, z, context and data sizes only" in capsys.readouterr().err


def test_each_grid_takes_the_faster_of_the_ring_and_the_all_gather_form():
    """Where attention is too short to hide a block's transfer, the all-gather form's one collective each way
    (2 (C - 1) steps) beats the ring's 3C - 2 exposed steps; a long sequence hides the ring entirely."""
    h100 = BUILTIN["h100"]
    tiny = LongSpec("tiny", n_layer=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, seq_len=64,
                    global_batch=1)
    short = predict(tiny, dict(context=8), h100)
    assert short.form == "gather" and short.t_ring > 0
    long = predict(tiny.with_batch(1, 1 << 20), dict(context=8), h100)
    assert long.form == "ring" and long.t_ring == 0.0
