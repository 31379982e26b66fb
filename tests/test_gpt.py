"""par4d's GPT against its single-device twin: loss, every gradient, AdamW steps."""

import pytest
import torch

from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig, ReferenceGPT
from par4d.optim.data_parallel import sync_gradients
from par4d.train.recipes.gpt import build_reference
from tests import cases
from tests.cases import GPT_BATCH, GPT_CONFIG, compare_gpt_with_twin
from tests.helpers import grid_id


def _gpt_matches_twin(sizes: dict, config: GPTConfig = GPT_CONFIG) -> int:
    """Loss, every gradient and the parameters after the AdamW steps, in float64 (``cases.float64``)."""
    with cases.float64():
        return compare_gpt_with_twin(cases.grid(**sizes), sizes, config)


@pytest.mark.parametrize("sizes", cases.factorizations(4), ids=grid_id)
def test_gpt_matches_twin_4_ranks(pool4, sizes):
    assert set(pool4.run(_gpt_matches_twin, sizes)) == {len(list(ReferenceGPT(GPT_CONFIG, init=False).parameters()))}


@pytest.mark.parametrize("sizes", [dict(x=2, y=2, z=2, data=1), dict(x=2, y=2, z=1, data=2),
                                   dict(x=2, y=1, z=2, data=2), dict(x=1, y=2, z=2, data=2)], ids=grid_id)
def test_gpt_matches_twin_8_ranks(pool8, sizes):
    assert len(set(pool8.run(_gpt_matches_twin, sizes))) == 1


def test_gpt_matches_twin_all_four_axes(pool16):
    """x, y, z and data all 2: every layer runs with all four axes active."""
    assert len(set(pool16.run(_gpt_matches_twin, dict(x=2, y=2, z=2, data=2), timeout=300))) == 1


def _layernorm_large_mean(sizes: dict) -> float:
    """A residual stream far from zero mean: the merge of per-shard statistics must
    not cancel (E[x^2] - E[x]^2 loses ~0.04 here in fp32)."""
    from par4d.layout import shard_activation
    from par4d.nn import LayerNorm

    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(2)
    x = 300 + torch.randn(4, 5, 24, generator=gen)
    grad = torch.randn(4, 5, 24, generator=gen)
    ref = torch.nn.LayerNorm(24)
    ref_x = x.clone().requires_grad_()
    (ref(ref_x) * grad).sum().backward()
    norm = LayerNorm(24, grid=grid)
    local_x = shard_activation(grid, x, "y").requires_grad_()
    out = norm(local_x)
    (out * shard_activation(grid, grad, "y")).sum().backward()
    torch.testing.assert_close(out, shard_activation(grid, ref(x).detach(), "y"), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(local_x.grad, shard_activation(grid, ref_x.grad, "y"), atol=1e-4, rtol=1e-4)
    return (out - shard_activation(grid, ref(x).detach(), "y")).abs().max().item()


def test_layernorm_statistics_are_stable(pool4):
    assert max(pool4.run(_layernorm_large_mean, dict(y=4))) < 1e-4


@pytest.mark.parametrize("sizes", [dict(x=2, data=2), dict(x=4)], ids=["x2d2", "x4"])
def test_gpt_with_phantom_mlp_matches_twin(pool4, sizes):
    """A phantom MLP standing in every block (the config setting), against a twin that
    applies the same phantom parameters as one block matrix per layer."""
    from dataclasses import replace

    config = replace(GPT_CONFIG, mlp="phantom", phantom_k=3, phantom_p=sizes["x"])
    expected = len(list(build_reference(config, init=False).parameters()))
    assert pool4.run(_gpt_matches_twin, sizes, config) == [expected] * 4
    assert config.num_params() == sum(p.numel() for p in build_reference(config, init=False).parameters())


def _clipped_like_torch(sizes: dict) -> float:
    from par4d.optim.data_parallel import clip_grad_norm_

    grid = cases.grid(**sizes)
    twin, model = ReferenceGPT(GPT_CONFIG), GPT(GPT_CONFIG, grid=grid)
    tokens = torch.randint(0, GPT_CONFIG.vocab_size, (GPT_BATCH, GPT_CONFIG.block_size + 1),
                           generator=torch.Generator().manual_seed(5))
    twin(tokens[:, :-1], tokens[:, 1:]).backward()
    model(shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])).backward()
    sync_gradients(model, grid)
    ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    norm = clip_grad_norm_(model, 0.1, grid)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    assert ref_norm > 0.1    # the clipping really scaled the gradients
    grads = model.reference_state(grad=True)
    for name, param in twin.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6)
    return norm.item()


@pytest.mark.parametrize("sizes", [dict(x=2, y=2), dict(x=1, y=2, z=2), dict(z=2, data=2)],
                         ids=["x2y2", "y2z2", "z2d2"])
def test_gradient_clipping_matches_torch(pool4, sizes):
    norms = pool4.run(_clipped_like_torch, sizes)
    assert max(norms) == min(norms)   # every rank computed the same global norm


def test_eq3_is_the_model_s_own_count_with_recomputation():
    """The async-pipeline paper's Eq 3 (Narayanan's 96 b s l h^2 (1 + s/6h + V/16lh)) equals
    par4d's FLOP count per token with recomputation times the batch's tokens, exactly."""
    for config in (GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_embd=128, n_head=4),
                   GPTConfig(vocab_size=50257, block_size=2048, n_layer=44, n_embd=6144, n_head=48)):
        assert config.narayanan_flops(16) == pytest.approx(16 * config.block_size *
                                                            config.flops_per_token(recompute=True), rel=1e-12)
