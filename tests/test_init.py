"""``par4d.adopt.init``: a Hugging Face model made parallel on the meta device gets, shard by shard and a block
at a time, the values its own initialisation gives the whole model (``initial_state``), on every grid."""

import copy

import pytest
import torch

from par4d.adopt import parallelize
from par4d.adopt.init import initial_state, initialize
from par4d.nn.base import full_state_dict
from tests import cases


def _make(family: str):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    with torch.device("meta"):
        if family == "mixtral":
            return MixtralForCausalLM(MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=32,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    num_local_experts=4))
        if family == "gpt2":
            return GPT2LMHeadModel(GPT2Config(vocab_size=260, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              bos_token_id=0, eos_token_id=0))
        return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=family == "llama-tied"))


def _initialized(sizes: dict, family: str) -> tuple[dict, int] | None:
    grid = cases.grid(**sizes)
    twin = _make(family)
    model = parallelize(copy.deepcopy(twin), grid)
    most = initialize(model, twin, grid, seed=5)
    state = full_state_dict(model)
    return (state, most) if grid.rank == 0 else None


def _largest_block(twin) -> int:
    """Bytes of the largest decoder layer, or of the largest module outside the layers (by its own parameters)."""
    layers = twin.model.layers if hasattr(twin, "model") else twin.transformer.h
    inside = {id(p) for p in layers.parameters()}
    lone = [sum(p.numel() * 4 for p in m.parameters(recurse=False) if id(p) not in inside) for m in twin.modules()]
    return max([sum(p.numel() * 4 for p in layer.parameters()) for layer in layers] + lone)


@pytest.mark.parametrize("family", ["llama-tied", "llama", "gpt2", "mixtral"])
def test_every_grid_gets_the_whole_models_initial_values(pool8, pool4, family):
    """A mixture's experts too: each rank of the expert axis gets its own experts' values."""
    twin = _make(family)
    expected = initial_state(twin, seed=5)
    assert sorted(expected) == sorted(n for n, _ in twin.named_parameters())     # tied: once, under the first name
    spread = dict(y=2, data=2, expert=2) if family == "mixtral" else dict(y=2, data=2)
    for pool, sizes in ((pool8, dict(x=2, y=2, z=2)), (pool4, spread)):
        state, most = pool.run(_initialized, sizes, family)[0]
        for name, value in expected.items():
            assert torch.equal(state[name], value), f"{name} on {sizes}"
        assert most == _largest_block(twin)
    assert all(torch.equal(v, torch.ones_like(v)) for n, v in expected.items()
               if ("norm" in n or "ln_" in n) and n.endswith("weight"))
    assert all(not v.any() for n, v in expected.items() if n.endswith("bias"))
    weights = [v for n, v in expected.items() if v.dim() >= 2 and "c_proj" not in n]
    assert all(0.015 < float(v.std()) < 0.025 for v in weights)   # initializer_range 0.02 (GPT-2's c_proj: smaller)
    if family == "llama-tied":
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


def test_values_follow_the_seed_not_the_order_of_building():
    twin = _make("llama")
    torch.manual_seed(123)        # the global generator's state does not matter, and is left as it was
    state = torch.random.get_rng_state()
    first = initial_state(twin, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = initial_state(copy.deepcopy(twin), seed=5)
    other = initial_state(twin, seed=6)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
