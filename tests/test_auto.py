"""``par4d.parallelize`` on models nobody here wrote, against the unparallelized model on real
grids: loss, every gradient, and parameters after 3 AdamW steps (relative 1e-5, in float64): a plain
PyTorch model and Hugging Face's LlamaForCausalLM (grouped-query attention, rotary
embeddings), built tiny from code."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn

import par4d
from par4d.adopt.parallelize import kept_whole
from par4d.layout import shard_batch
from par4d.nn import full_state_dict
from par4d.optim.data_parallel import global_mean, sync_gradients
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


class _Classifier(nn.Module):
    """Three blocks of a Linear and a GELU, and a 10-class head: on x=2, z=2 its 5 classes per x-block do
    not divide over z."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 12),
                                    nn.GELU())
        self.head = nn.Linear(12, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.blocks(x)).flatten(0, 1), y.flatten())


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
    return LlamaForCausalLM(config).to(torch.get_default_dtype())


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)   # the head is tied to wte
    return GPT2LMHeadModel(config).to(torch.get_default_dtype())


def _llama_batch(gen):
    ids = torch.randint(0, 64, (8, 6), generator=gen)
    return ids, ids


def _run(model, x, y):
    if isinstance(model, (_Plain, _Classifier, _ConvNet)):
        return model(x, y)
    return model(input_ids=x, labels=y).loss


def _matches(sizes: dict, which: str, force: dict | None = None, weights: str | None = None) -> dict:
    """In float64 (``cases.float64``). ``weights``: build the model on the meta device and load it
    from this safetensors file."""
    with cases.float64():
        return _compare(cases.grid(**sizes), which, force, weights)


def _compare(grid, which: str, force: dict | None, weights: str | None) -> dict:
    build = {"plain": _Plain, "classifier": _Classifier, "conv": _ConvNet, "llama": _llama, "gpt2": _gpt2}[which]
    twin = build()
    if weights is None:
        model = par4d.parallelize(copy.deepcopy(twin), grid, force=force)
    else:
        with torch.device("meta"):
            model = par4d.parallelize(build(), grid, force=force)
        par4d.load_safetensors(model, weights, grid)
    batches = {"plain": _plain_batch, "classifier": _plain_batch, "conv": _conv_batch}.get(which, _llama_batch)
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
    worst["plan"] = [(t.name, t.kind) for t in par4d.state(model).plan]
    worst["names"] = sorted(after) == sorted(n for n, _ in twin.named_parameters(remove_duplicate=False))
    return worst


def _check(results: list[dict]) -> dict:
    for r in results:
        assert r["names"] and r["loss"] < 1e-5 and not r["far"], r
    return results[0]


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(x=2, y=2), dict(y=2, data=2)], ids=["x2z2", "x2y2", "y2d2"])
def test_plain_model_4_ranks(pool4, sizes):
    plan = _check(pool4.run(_matches, sizes, "plain"))["plan"]
    assert plan == [("ff.0", "normal"), ("ff.2", "transposed"), ("head", "normal"), ("norm", "replicated")]


def test_a_layer_the_grid_does_not_divide_is_kept_whole(pool4):
    """A classifier of one's own on x=2, z=2: its 10-class head is kept whole (the plan says why), the rest
    is cut, and it trains as the one-process model does."""
    result = _check(pool4.run(_matches, dict(x=2, z=2), "classifier"))
    assert result["plan"] == [("blocks.0", "normal"), ("blocks.2", "transposed"), ("blocks.4", "normal"),
                              ("head", "replicated")]
    model = par4d.parallelize(_Classifier(), _X2Z2)
    why = {t.name: t.why for t in par4d.state(model).plan}["head"]
    assert why == ("kept whole: the grid does not divide its sizes: head(in_features=12, out_features=10, "
                   "transposed=False): the 5 out-features per x-block (out_features / x=2) are not divisible by z=2")
    assert kept_whole(model) == {"head": why}                  # what par4d train says before any rank starts


_X2Z2 = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})


def test_forcing_one_layer_of_a_block_makes_the_others_lone(pool4):
    """ff.2 forced whole: ff.0 may not leave its output sharded for it any more."""
    result = _check(pool4.run(_matches, dict(x=2, y=2), "plain", {"ff.2": "replicated"}))
    assert result["plan"][:2] == [("ff.0", "normal"), ("ff.2", "replicated")]


LLAMA_GRIDS = [dict(x=2, z=2), dict(x=2, y=2), dict(y=2, data=2)]


@pytest.mark.parametrize("sizes", LLAMA_GRIDS, ids=["x2z2", "x2y2", "y2d2"])
def test_llama_4_ranks(pool4, sizes):
    """Attention's heads split over x (4 query and 2 key/value heads: grouped-query attention),
    the gated MLP a pair, the embeddings sharded; the norms whole, or where y > 1 split over y with the
    residual stream (par4d.adopt.stream)."""
    plan = dict(_check(pool4.run(_matches, sizes, "llama"))["plan"])
    layer = "model.layers.0"
    assert {plan[f"{layer}.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj")} == {"normal"}
    assert plan[f"{layer}.self_attn.o_proj"] == "transposed"
    assert plan[f"{layer}.mlp.gate_proj"] == plan[f"{layer}.mlp.up_proj"] == "normal"
    assert plan[f"{layer}.mlp.down_proj"] == "transposed" and plan["lm_head"] == "normal"
    norms = "sharded" if sizes.get("y", 1) > 1 else "replicated"
    assert plan["model.embed_tokens"] == "normal" and plan[f"{layer}.input_layernorm"] == plan["model.norm"] == norms


@pytest.mark.parametrize("sizes", LLAMA_GRIDS, ids=["x2z2", "x2y2", "y2d2"])
def test_gpt2_4_ranks(pool4, sizes):
    """GPT-2's Conv1D layers (weights stored (in, out)), its fused q, k, v cut at head
    boundaries; its head is tied to the token embeddings, so both stay whole (the plan says
    why), while the position embeddings are sharded."""
    plan = {name: kind for name, kind in _check(pool4.run(_matches, sizes, "gpt2"))["plan"]}
    assert plan["transformer.h.0.mlp.c_fc"] == "normal" and plan["transformer.h.0.mlp.c_proj"] == "transposed"
    assert plan["transformer.h.0.attn.c_attn"] == "normal" and plan["transformer.h.0.attn.c_proj"] == "transposed"
    assert plan["lm_head"] == plan["transformer.wte"] == "replicated" and plan["transformer.wpe"] == "normal"
    norms = "sharded" if sizes.get("y", 1) > 1 else "replicated"
    assert plan["transformer.h.0.ln_1"] == plan["transformer.ln_f"] == norms


@pytest.mark.parametrize("sizes", [dict(x=2, z=2), dict(y=2, data=2)], ids=["x2z2", "y2d2"])
def test_convolutions_4_ranks(pool4, sizes):
    plan = _check(pool4.run(_matches, sizes, "conv"))["plan"]
    assert plan == [("features.0", "normal"), ("features.2", "transposed"), ("mix", "normal"), ("head", "normal")]


@pytest.mark.parametrize("which", ["llama", "gpt2", "conv"])
def test_8_ranks(pool8, which):
    _check(pool8.run(_matches, dict(x=2, y=2, z=2), which))


def test_a_model_built_on_the_meta_device_loads_shard_by_shard(pool4, tmp_path):
    """Llama built on the meta device, made parallel, then read from a safetensors file of
    the unparallelized model's weights (each rank its own slices; the rotary frequencies,
    which no file holds, computed by the model): it trains as the unparallelized model."""
    from safetensors.torch import save_model

    path = tmp_path / "model.safetensors"
    with cases.float64():
        save_model(_llama(), str(path))
    _check(pool4.run(_matches, dict(x=2, z=2), "llama", None, str(path)))


def _counted(sizes: dict, which: str) -> dict:
    """One training step's collectives, from the ledger and from the plan parallelize made
    for an example batch: {(kind, axes): per-rank elements}, summed."""
    grid = cases.grid(**sizes)
    twin = {"plain": _Plain, "conv": _ConvNet, "llama": _llama, "gpt2": _gpt2}[which]()
    x, y = {"plain": _plain_batch, "conv": _conv_batch}.get(which, _llama_batch)(torch.Generator().manual_seed(1))
    example = (x, y) if which in ("plain", "conv") else {"input_ids": x.to("meta"), "labels": y.to("meta")}
    model = par4d.parallelize(twin, grid, example=example)
    with grid.ledger.capture() as entries:
        _run(model, shard_batch(grid, x), shard_batch(grid, y)).backward()
        sync_gradients(model, grid)
    measured, planned = Counter(), Counter()
    for e in entries:
        measured[(e.kind, e.axes)] += e.elements
    parallel = par4d.state(model)
    for kind, axes, elements in [m for t in parallel.plan for m in t.messages] + list(parallel.sync_messages):
        planned[(kind, axes)] += elements
    return {"measured": dict(measured), "planned": dict(planned)}


@pytest.mark.parametrize("which", ["llama", "gpt2", "conv"])
def test_the_plan_counts_every_collective_of_a_step(pool8, which):
    """The communication the plan expects equals, collective kind by kind and axis by axis,
    what one training step moved on x=2,y=2,z=2 (where every collective of Algorithm 1 runs)."""
    for r in pool8.run(_counted, dict(x=2, y=2, z=2), which):
        assert r["planned"] == r["measured"] and r["measured"], r


def _gathered_over_y(sizes: dict, which: str, shard_stream: bool) -> dict:
    """Elements one step all-gathers over y on this rank, and how many parts the stream is cut in."""
    grid = cases.grid(**sizes)
    model = par4d.parallelize({"llama": _llama, "gpt2": _gpt2}[which](), grid, shard_stream=shard_stream)
    x, y = _llama_batch(torch.Generator().manual_seed(1))
    with grid.ledger.capture() as entries:
        _run(model, shard_batch(grid, x), shard_batch(grid, y)).backward()
    return {"y": sum(e.elements for e in entries if e.kind == "all_gather" and e.axes == ("y",)),
            "stream": par4d.state(model).stream}


def test_the_residual_stream_is_sharded_over_y(pool4):
    """On x=2,y=2 the stream between blocks is features over y, as par4d's GPT's: the Llama never
    all-gathers over y in a step (RMSNorm all-reduces its sums of squares); GPT-2's whole (tied) embedding
    and head gather its 8 x 6 x 32 / 2 stream blocks once each (the embedding's gradient, the head's
    input), and each of its 5 LayerNorms gathers (mean, M2) of 48 rows. Kept whole, both gather more."""
    for which, gathered in (("llama", 0), ("gpt2", 2 * 8 * 6 * 32 // 2 + 5 * 2 * 48)):
        for r in pool4.run(_gathered_over_y, dict(x=2, y=2), which, True):
            assert r == {"y": gathered, "stream": 2}, (which, r)
        for r in pool4.run(_gathered_over_y, dict(x=2, y=2), which, False):
            assert r["stream"] == 1 and r["y"] > gathered, (which, r)


def test_the_stream_stays_whole_where_par4d_does_not_know_every_use_of_it():
    from par4d.adopt.stream import stream_problem

    grid = par4d.Grid.virtual({"x": 2, "y": 2, "z": 1})

    def built(**kwargs):
        with torch.device("meta"):
            return par4d.parallelize(_llama(), grid, **kwargs)

    kinds = {t.name: t.kind for t in par4d.state(built()).plan}
    assert par4d.state(built()).stream == 2
    assert kinds["model.norm"] == kinds["model.layers.1.input_layernorm"] == "sharded"
    forced = built(force={"model.layers.0.mlp.down_proj": "replicated"})
    assert par4d.state(forced).stream == 1
    assert {t.name: t.kind for t in par4d.state(forced).plan}["model.norm"] == "replicated"
    assert par4d.state(built(shard_stream=False)).stream == 1
    assert par4d.state(par4d.parallelize(_Plain(), grid)).stream == 1           # not a model par4d knows the stream of
    with torch.device("meta"):
        lm = _llama()
    layers = [(n, m) for n, m in lm.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    assert stream_problem(lm, par4d.Grid.virtual({"x": 2, "y": 1, "z": 1}), layers, set(), False).startswith("y=1")
    assert stream_problem(lm, grid, layers, set(), False) == ("model.layers.0.self_attn.q_proj is a lone layer "
                                                              "inside a block (whole features in and out)")


def test_bad_input_is_named():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    with pytest.raises(ValueError, match=r"head is forced normal, but head\(in_features=12, out_features=6.*not "
                                         r"divisible by z=2 \(force=\{'head': 'replicated'\} keeps it whole\)"):
        par4d.parallelize(_Head(), grid, force={"head": "normal"})
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
    assert fc.weight_layout == "in_out" and tuple(fc.weight.shape) == (32, 128 // 4)
    proj = next(t for t in par4d.state(model).plan if t.name == "transformer.h.0.attn.c_proj")
    assert proj.why == "a lone layer: transformer.h.0.attn.c_attn of its block is transposed"
    tied = next(t for t in par4d.state(model).plan if t.name == "lm_head")
    assert tied.why == "its weight is tied to transformer.wte.weight: kept whole"
    with pytest.raises(ValueError, match="lm_head is forced normal, but its weight is tied to transformer.wte.weight"):
        par4d.parallelize(_gpt2(), grid, force={"lm_head": "normal"})


def test_what_par4d_cannot_shard_is_refused():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    with pytest.raises(ValueError, match=r"features.0 is nn.Conv2d\(groups=2.*force it replicated"):
        par4d.parallelize(_Wrap(nn.Conv2d(4, 8, 3, groups=2)), grid)
    with pytest.raises(ValueError, match=r"features.1 is a lazy batch norm whose num_features is not known yet"):
        par4d.parallelize(_Wrap(nn.Conv2d(4, 8, 3), nn.LazyBatchNorm2d()), grid)


def test_batch_norms_are_synchronised_where_samples_are_split():
    """z*data=2: a batch norm becomes par4d's BatchNorm with the same tensors (state_dict keys
    and values unchanged); with every sample on each rank it stays torch's."""
    model = _Wrap(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    par4d.parallelize(model, par4d.Grid.virtual({"x": 2, "y": 1, "z": 2}))
    assert isinstance(model.features[1], par4d.nn.BatchNorm)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items() if not k.startswith("features.0"))
    row = par4d.state(model).plan[-1]
    assert (row.name, row.kind) == ("features.1", "replicated") and "synchronised over z and data" in row.why
    kept = par4d.parallelize(_Wrap(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8)), par4d.Grid.virtual({"x": 2, "y": 2}))
    assert type(kept.features[1]) is nn.BatchNorm2d and par4d.state(kept).plan[-1].name == "features.1"


class _Wrap(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.features = nn.Sequential(*layers)


def test_force_keeps_a_layer_whole():
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2})
    model = par4d.parallelize(_Head(), grid, force={"h*": "replicated"})
    assert isinstance(model.head, nn.Linear) and par4d.state(model).plan[0].kind == "replicated"


def test_heads_the_grid_does_not_divide_are_named():
    """4 query and 2 key/value heads on x=4: attention's layers are lone, and the plan says why."""
    model = par4d.parallelize(_llama(), par4d.Grid.virtual({"x": 4, "y": 1, "z": 1}))
    why = {t.name: t.why for t in par4d.state(model).plan}["model.layers.1.self_attn.k_proj"]
    assert why == ("attention with 4 query and 2 key/value heads, which x=4 does not divide: "
                   "a lone layer (whole features in and out)")
