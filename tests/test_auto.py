"""``par4d.parallelize`` on models nobody here wrote, against the unparallelized model on real
grids: loss, every gradient, and parameters after 3 AdamW steps (relative 1e-5): a plain
PyTorch model and Hugging Face's LlamaForCausalLM (grouped-query attention, rotary
embeddings), built tiny from code."""

import copy

import pytest
import torch
import torch.nn as nn

import par4d
from par4d.data_parallel import global_mean, sync_gradients
from par4d.layout import shard_batch
from par4d.nn import full_state_dict
from tests import cases

STEPS = 3


class _Plain(nn.Module):
    """A model of its own: a feed-forward pair inside a Sequential, a norm, a lone head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ff = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 8)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.norm(x + self.ff(x))).flatten(0, 1), y.flatten())


class _ConvNet(nn.Module):
    """Convolutions: a pair in a Sequential (the second with stride 2), a lone 1x1, a Linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1))
        self.mix = nn.Conv2d(8, 4, 1)
        self.head = nn.Linear(4 * 3 * 3, 8)

    def forward(self, x, y):
        h = self.mix(torch.tanh(self.features(x)))
        return nn.functional.cross_entropy(self.head(h.flatten(1)), y)


def _conv_batch(gen):
    return torch.randn(8, 4, 6, 6, generator=gen), torch.randint(0, 8, (8,), generator=gen)


def _plain_batch(gen):
    return torch.randn(8, 3, 12, generator=gen), torch.randint(0, 8, (8, 3), generator=gen)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(config).float()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)   # the head is tied to wte
    return GPT2LMHeadModel(config).float()


def _llama_batch(gen):
    ids = torch.randint(0, 64, (8, 6), generator=gen)
    return ids, ids


def _run(model, x, y):
    if isinstance(model, (_Plain, _ConvNet)):
        return model(x, y)
    return model(input_ids=x, labels=y).loss


def _matches(sizes: dict, which: str) -> dict:
    grid = cases.grid(**sizes)
    twin = {"plain": _Plain, "conv": _ConvNet, "llama": _llama, "gpt2": _gpt2}[which]()
    model = par4d.parallelize(copy.deepcopy(twin), grid)
    batches = {"plain": _plain_batch, "conv": _conv_batch}.get(which, _llama_batch)
    # eps 1e-4: AdamW would turn fp32 round-off in near-zero gradients into a whole step's difference
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    gen = torch.Generator().manual_seed(1)
    # The criteria of par4d's own GPT tests (torch.testing.assert_close's): gradients within
    # rtol 1e-5, atol 1e-6; parameters after the AdamW steps within rtol 1e-5, atol 1e-5.
    worst = {"loss": 0.0, "far": []}
    for step in range(STEPS):
        x, y = batches(gen)
        ref = _run(twin, x, y)
        ref.backward()
        local = _run(model, shard_batch(grid, x), shard_batch(grid, y))   # the mean over this rank's samples
        local.backward()
        loss = global_mean(local, grid)
        sync_gradients(model, grid)
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref.item()) / abs(ref.item()))
        grads = full_state_dict(model, grad=True)
        worst["far"] += [f"step {step} grad {n}" for n, p in twin.named_parameters()
                         if not torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6)]
        opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
    after = full_state_dict(model)
    worst["far"] += [f"{n} after {STEPS} steps" for n, p in twin.named_parameters()
                     if not torch.allclose(after[n], p, rtol=1e-5, atol=1e-5)]
    worst["plan"] = [(t.name, t.kind) for t in model.par4d_plan]
    worst["names"] = sorted(after) == sorted(n for n, _ in twin.named_parameters(remove_duplicate=False))
    return worst


def _check(results: list[dict]) -> dict:
    for r in results:
        assert r["names"] and r["loss"] < 1e-5 and not r["far"], r
    return results[0]


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(x=2, y=2), dict(y=2, data=2)], ids=["x2z2", "x2y2", "y2d2"])
def test_plain_model_4_ranks(pool4, sizes):
    plan = _check(pool4.run(_matches, sizes, "plain"))["plan"]
    assert plan == [("ff.0", "normal"), ("ff.2", "transposed"), ("head", "normal")]


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(y=2, data=2)], ids=["x2z2", "y2d2"])
def test_llama_4_ranks(pool4, sizes):
    plan = dict(_check(pool4.run(_matches, sizes, "llama"))["plan"])
    assert plan["model.layers.0.mlp.gate_proj"] == plan["model.layers.0.mlp.up_proj"] == "normal"
    assert plan["model.layers.0.mlp.down_proj"] == "transposed" and plan["lm_head"] == "normal"
    assert len(plan) == 2 * 7 + 1        # q, k, v, o, gate, up, down per layer, and the head


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(x=2, y=2)], ids=["x2z2", "x2y2"])
def test_gpt2_4_ranks(pool4, sizes):
    """GPT-2's Conv1D layers (weights stored (in, out)); its head is tied to the embeddings,
    so it stays whole, and the plan says why."""
    plan = {name: kind for name, kind in _check(pool4.run(_matches, sizes, "gpt2"))["plan"]}
    assert plan["transformer.h.0.mlp.c_fc"] == "normal" and plan["transformer.h.0.mlp.c_proj"] == "transposed"
    assert plan["transformer.h.0.attn.c_attn"] == plan["transformer.h.0.attn.c_proj"] == "normal"
    assert plan["lm_head"] == "replicated"


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(y=2, data=2)], ids=["x2z2", "y2d2"])
def test_convolutions_4_ranks(pool4, sizes):
    plan = _check(pool4.run(_matches, sizes, "conv"))["plan"]
    assert plan == [("features.0", "normal"), ("features.2", "transposed"), ("mix", "normal"), ("head", "normal")]


@pytest.mark.parametrize("which", ["llama", "gpt2", "conv"])
def test_8_ranks(pool8, which):
    _check(pool8.run(_matches, dict(x=2, y=2, z=2), which))


def test_bad_input_is_named():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    with pytest.raises(ValueError, match=r"head\(in_features=12, out_features=6.*not divisible"):
        par4d.parallelize(_Head(), grid)
    with pytest.raises(ValueError, match="unknown treatment 'sharded'"):
        par4d.parallelize(_Plain(), grid, force={"head": "sharded"})


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(12, 6)


def test_gpt2_plan_keeps_conv1d_orientation():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    model = par4d.parallelize(_gpt2(), grid, force={"*.attn.c_attn": "transposed"})
    fc = model.transformer.h[0].mlp.c_fc                           # Conv1D(3072-like): weight (in=32, out=128)
    assert fc.stored_in_out and tuple(fc.weight.shape) == (32, 128 // 4)
    tied = next(t for t in model.par4d_plan if t.name == "lm_head")
    assert tied.why == "its weight is tied to transformer.wte.weight: kept whole"
    with pytest.raises(ValueError, match="lm_head is forced normal, but its weight is tied to transformer.wte.weight"):
        par4d.parallelize(_gpt2(), grid, force={"lm_head": "normal"})


def test_what_par4d_cannot_shard_is_refused():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    with pytest.raises(ValueError, match=r"features.0 is nn.Conv2d\(groups=2.*force it replicated"):
        par4d.parallelize(_Wrap(nn.Conv2d(4, 8, 3, groups=2)), grid)
    with pytest.raises(ValueError, match=r"features.1 is a batch norm.*z\*data=2"):
        par4d.parallelize(_Wrap(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8)), grid)


class _Wrap(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.features = nn.Sequential(*layers)


def test_force_keeps_a_layer_whole():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    model = par4d.parallelize(_Head(), grid, force={"h*": "replicated"})
    assert isinstance(model.head, nn.Linear) and model.par4d_plan[0].kind == "replicated"
