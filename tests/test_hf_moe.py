"""transformers' mixtures of experts (Mixtral, Qwen3-MoE, OLMoE) made parallel by ``par4d.parallelize``
against transformers' own unparallelized model: routes, the loss with transformers' load-balancing loss,
every gradient and the parameters after 3 AdamW steps, in float64, on grids with the expert axis folded
over data and every tensor axis."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F

import par4d
from par4d.adopt.causal_lm import CausalLM
from par4d.adopt.moe import SparseMoE
from par4d.compiled import compile_blocks
from par4d.compiled import counted as counted_graphs
from par4d.layout import shard_batch
from par4d.nn import full_state_dict
from par4d.nn.moe import update_expert_bias
from par4d.optim.data_parallel import global_mean, grad_norm, sync_gradients
from tests import cases

STEPS = 3
VOCAB = 64


# What every family's small model shares: 2 layers of width 32, 4 heads, top 2, transformers' balance loss
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
             max_position_embeddings=16, output_router_logits=True, router_aux_loss_coef=0.05)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**SMALL, intermediate_size=16, num_key_value_heads=2, num_local_experts=4))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # its second layer dense (mlp_only_layers): a Qwen3MoeMLP beside the mixtures
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, intermediate_size=32, moe_intermediate_size=16,
                                              num_key_value_heads=2, head_dim=8, num_experts=4, norm_topk_prob=True,
                                              mlp_only_layers=[1]))


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM(OlmoeConfig(**SMALL, intermediate_size=16, num_key_value_heads=4, num_experts=4))


def _deepseek_v3(layers: int = 3):
    """Its first block dense, then mixtures of 8 experts in 4 groups (2 open to a token), a shared expert,
    multi-head latent attention with low-rank queries and keys."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, max_position_embeddings=16, rope_scaling=None))


BUILD = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe, "deepseek_v3": _deepseek_v3}


def _model(family: str):
    """The family's small model in the default dtype, its weights drawn so routes are far from ties (a
    router of unit-scale weights) and norms away from one."""
    torch.manual_seed(0)
    model = BUILD[family]().to(torch.get_default_dtype())
    model.set_experts_implementation("eager")      # its loop over experts (its grouped GEMM takes no float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.2)
        for module in model.modules():           # DeepSeek-V3's score correction: a choice the scores alone differ from
            if hasattr(module, "e_score_correction_bias"):     # (float32 in any model, as transformers loads it)
                module.e_score_correction_bias = module.e_score_correction_bias.float().normal_(0, 0.1)
    return model


def _rms_norm_in_float64(self, h: torch.Tensor) -> torch.Tensor:
    return self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.variance_epsilon))


def _norms_keep_float64(model) -> None:
    """transformers' RMSNorm computes in float32 even in a float64 model (par4d's keeps float64): its norms
    here keep float64, so the comparison proves exactness rather than meeting float32 round-off."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_in_float64, module)


def _deepseek_router_in_float64(self, h: torch.Tensor):
    """DeepSeek-V3's router as transformers defines it, in the model's dtype: transformers computes its logits
    in float32 even in a float64 model (and so its router's gradient), which float64 exactness cannot meet."""
    logits = h.reshape(-1, self.hidden_dim) @ self.weight.t()
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    per_group = choice.view(-1, self.num_group, self.num_experts // self.num_group)
    best = per_group.topk(2, dim=-1).values.sum(-1)
    allowed = torch.zeros_like(best).scatter(1, best.topk(self.topk_group, dim=-1).indices, 1.0).bool()
    choice = choice.masked_fill(~allowed.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
    chosen = choice.topk(self.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, chosen


def _routers_in_float64(twin, model) -> None:
    """DeepSeek-V3's routers in float64 on both sides (the parallel ones: the inputs' precision)."""
    for module in twin.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            module.forward = types.MethodType(_deepseek_router_in_float64, module)
    for module in model.modules():
        if isinstance(module, SparseMoE) and module.score == "sigmoid":
            module.precision = None


def _balance_loss(logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func (no attention mask) in the logits' dtype: it sums in float32."""
    scores = torch.cat(logits).softmax(-1)
    chosen = F.one_hot(scores.topk(top_k, dim=-1).indices, scores.shape[-1]).sum(1).to(scores.dtype)
    return scores.shape[-1] * (chosen.mean(0) * scores.mean(0)).sum()


def _routes(model) -> list[torch.Tensor]:
    """Each mixture's top-k experts at its last forward, by the model's own router (transformers') or
    par4d's counts."""
    return [m.last_routed.clone() for m in model.modules() if isinstance(m, SparseMoE)]


def _on_meta(twin, family: str, grid):
    """``twin`` made parallel as par4d train builds it: on the meta device, then filled shard by shard (its
    parameters replaced by new ones) and its buffers computed."""
    from par4d.adopt.load import compute_buffers, fill_parameters

    with torch.device("meta"):
        shell = BUILD[family]().to(torch.get_default_dtype())
    lm = par4d.parallelize(shell, grid)
    fill_parameters(lm, grid, {name: p.detach() for name, p in twin.named_parameters()})
    compute_buffers(lm, grid.device)
    held = dict(lm.named_buffers())
    for name, buffer in twin.state_dict().items():       # the persistent buffers a folder holds (DeepSeek-V3's bias)
        if name in held and name not in dict(twin.named_parameters()):
            held[name].copy_(buffer)
    return lm


def _matches(sizes: dict, family: str, recompute: bool = False, meta: bool = False, bias_rate: float = 0.0,
             compile: bool = False) -> dict:
    """par4d's model against its twin (see _check); ``compile``: its decoder layers compiled (aot_eager), the graphs
    dynamo made at each step counted."""
    with cases.float64():
        grid = cases.grid(**sizes)
        twin = _model(family)
        lm = _on_meta(twin, family, grid) if meta else par4d.parallelize(copy.deepcopy(twin), grid)
        model = CausalLM(lm, 0.0, 0, grid=grid)       # (on a context axis: the chunks' global positions)
        if compile:
            torch._dynamo.reset()
            compile_blocks(model, "aot_eager")
        if recompute:       # transformers' own checkpointing of each decoder layer (par4d's --recompute)
            model.lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        _norms_keep_float64(twin)
        _norms_keep_float64(model)
        _routers_in_float64(twin, model)
        if bias_rate:        # DeepSeek-V3's correction bias stepped by par4d's loss-free balancing
            for module in model.modules():
                if isinstance(module, SparseMoE):
                    module.step_correction(bias_rate)
        routers = [m for m in twin.modules() if hasattr(m, "e_score_correction_bias")]
        balanced = twin.config.output_router_logits          # DeepSeek-V3: balanced by its bias, no loss
        picked: list[torch.Tensor] = []                      # each router's top-k, as transformers picks them
        for module in twin.modules():
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                module.register_forward_hook(lambda _m, _a, out: picked.append(out[2].detach()))
        opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        far, norms, counted, graphs, start = [], [], [], [], counted_graphs()[0]
        for step in range(STEPS):
            tokens = torch.randint(0, VOCAB, (8, 9), generator=gen)
            x, y = tokens[:, :-1], tokens[:, 1:]
            picked.clear()
            out = twin(input_ids=x, use_cache=False, **({"output_router_logits": True} if balanced else {}))
            ref = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
            if balanced:
                aux = _balance_loss(out.router_logits, twin.config.num_experts_per_tok)
                if abs(aux.item() - out.aux_loss.item()) > 1e-6 * aux.item():     # its own sums in float32
                    far.append(f"step {step} transformers' aux loss {out.aux_loss.item()} vs {aux.item()}")
                ref = ref + twin.config.router_aux_loss_coef * aux
            ref.backward()
            experts = next(m.n_experts for m in model.modules() if isinstance(m, SparseMoE))
            theirs = [torch.bincount(chosen.flatten(), minlength=experts) for chosen in picked]
            loss = model(shard_batch(grid, x), shard_batch(grid, y))
            loss.backward()
            graphs.append(counted_graphs()[0] - start)
            sync_gradients(model, grid)
            counted.append(all(torch.equal(a, b) for a, b in zip(_routes(model), theirs)))
            mean = global_mean(loss.detach(), grid).item()
            if abs(mean - ref.item()) > 1e-10 * abs(ref.item()):
                far.append(f"step {step} loss {mean} vs {ref.item()}")
            grads = full_state_dict(model.lm, grad=True)
            far += [f"step {step} grad {n}" for n, p in twin.named_parameters()
                    if not torch.allclose(grads[n], p.grad, rtol=1e-8, atol=1e-11)]
            norms.append((grad_norm(model, grid).item(),
                          torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in twin.parameters()])).item()))
            opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
            if bias_rate:     # the twin's bias by the rule, from transformers' own routes
                update_expert_bias(model)
                for router, chosen in zip(routers, picked):
                    load = torch.bincount(chosen.flatten(), minlength=experts).to(torch.float32)
                    router.e_score_correction_bias.add_(bias_rate * torch.sign(load.mean() - load))
                mine = [m.gate.e_score_correction_bias for m in model.modules() if isinstance(m, SparseMoE)]
                if not all(torch.equal(a, b.e_score_correction_bias) for a, b in zip(mine, routers)):
                    far.append(f"step {step} correction bias")
                if not any(bool(b.any()) for b in mine):
                    far.append(f"step {step}: the correction bias did not move")
        after = full_state_dict(model.lm)
        far += [f"{n} after {STEPS} steps" for n, p in twin.named_parameters()
                if not torch.allclose(after[n], p, rtol=1e-8, atol=1e-11)]
        kinds = {row.name: row.kind for row in par4d.state(model.lm).plan}
        return {"far": far, "norms": norms, "counted": counted, "kinds": kinds, "graphs": graphs,
                "mixtures": sum(isinstance(m, SparseMoE) for m in model.modules())}


def _check(results: list[dict], layers: int) -> None:
    for r in results:
        assert not r["far"], r["far"]
        assert r["counted"] == [True] * STEPS         # every layer's routes are transformers' own
        for ours, theirs in r["norms"]:
            assert abs(ours - theirs) <= 1e-9 * theirs, r["norms"]
        assert r["mixtures"] == layers


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(x=2, data=2, expert=2), dict(y=2, data=2, expert=2),
                                   dict(z=2, data=2, expert=2), dict(context=2, data=2, expert=2)],
                         ids=["d4e4", "x2d2e2", "y2d2e2", "z2d2e2", "c2d2e2"])
def test_mixtral_is_transformers_own(pool4, sizes):
    """On c2d2e2 each sequence is cut over the context axis too (par4d's ring attention, through transformers'
    attention interface), the balance loss counting every chunk's tokens."""
    results = pool4.run(_matches, sizes, "mixtral")
    _check(results, 2)
    assert results[0]["kinds"]["model.layers.0.mlp"] == "experts"


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("sizes", [dict(x=2, data=2, expert=2), dict(y=2, data=2, expert=2)], ids=["x2d2e2", "y2d2e2"])
def test_qwen3_moe_and_olmoe_are_transformers_own(pool4, family, sizes):
    """Built as par4d train builds them (on the meta device, then filled: Qwen3's per-head norms keep their
    gradient's sum over x); Qwen3-MoE recomputed (each decoder layer again in backward, its exchanges too).
    On y=2 their stream stays whole (their q and k norms are not over the hidden width, or span every head):
    the mixture cuts its input's features over y and gathers its output."""
    found = pool4.run(_matches, sizes, family, family == "qwen3_moe", True)
    _check(found, 1 if family == "qwen3_moe" else 2)
    if "x" in sizes and family == "qwen3_moe":
        assert found[0]["kinds"]["model.layers.0.self_attn.q_proj"] == "normal"


def test_qwen3_moe_on_a_context_axis_is_transformers_own(pool4):
    """Its q and k normalised per head before transformers' attention function: par4d's ring takes them as
    Llama's, the heads over x and each sequence over context."""
    _check(pool4.run(_matches, dict(x=2, context=2), "qwen3_moe"), 1)


@pytest.mark.parametrize("sizes", [dict(data=4, expert=4), dict(x=2, data=2, expert=2), dict(y=2, data=2, expert=2)],
                         ids=["d4e4", "x2d2e2", "y2d2e2"])
def test_deepseek_v3_is_transformers_own(pool4, sizes):
    """Sigmoid scores plus the correction bias choose the experts, in the 2 best of 4 groups; the weights
    renormalised and scaled; shared experts beside; latent attention as lone layers; its first block dense.
    Both routers in float64 here (transformers' takes float32 logits whatever the model's dtype; par4d's
    DeepSeek-V3 router does too, outside this test). On data=4,expert=4 and y=2 the correction bias is
    stepped (--expert-bias-rate): as the rule steps the twin's from transformers' own routes. On data=4,expert=4
    its decoder layers are compiled: the dense one whole, the mixtures broken at their eager routed part, and no
    graph made after the first step (two kinds of block: par4d.compiled's entry per kind)."""
    compiled = sizes == dict(data=4, expert=4)
    found = pool4.run(_matches, sizes, "deepseek_v3", False, True, 0.01 if "x" not in sizes else 0.0, compiled)
    _check(found, 2)
    assert found[0]["kinds"]["model.layers.1.mlp"] == "experts"
    for r in found:
        # the dense layer whole, the mixtures before their eager part and after it
        assert r["graphs"] == ([3] if compiled else [0]) * STEPS, r["graphs"]



def _save_mixtral(folder, dtype: torch.dtype, shard: str):
    """A pretrained-shaped Mixtral folder (random weights, a router far from ties), as save_pretrained writes."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=300, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1.0)
    model.to(dtype).save_pretrained(folder, max_shard_size=shard)
    return folder


def test_a_pretrained_mixtral_fine_tunes_exports_and_loads_in_transformers(pool4, tmp_path, capsys):
    """`--init-from hf` a sharded bf16 Mixtral on x=2,data=2,expert=2: every rank computes transformers' logits;
    2 steps, then resumed on data=4,expert=4 for a third; the export loads in transformers, which computes the
    logits par4d computes from it on y=2,data=2,expert=2, and every expert's weights have moved."""
    from safetensors.torch import load_file

    from par4d.cli import main
    from tests.helpers import train_pooled
    from tests.test_pretrained import _grid_logits, _rows, _transformers_logits

    pretrained = _save_mixtral(tmp_path / "pretrained", torch.bfloat16, "20KB")
    expected = _transformers_logits(pretrained)
    sizes = dict(x=2, data=2, expert=2)
    for rank, logits in enumerate(_grid_logits(pool4, pretrained, "hf-mixtral", sizes)):
        torch.testing.assert_close(logits, expected[_rows(rank, sizes)], rtol=0, atol=1e-5)
    run, out = tmp_path / "run", tmp_path / "exported"
    common = ("--seq-len", "16", "--batch-size", "4", "--lr", "1e-2", "--no-progress", "--peak-flops", "1e11",
              "--no-tensorboard")
    train_pooled(pool4, "--model", "hf-mixtral", "--init-from", "hf", str(pretrained), "--grid", "x=2,data=2,expert=2",
                 "--steps", "2", "--out", str(run), *common)
    train_pooled(pool4, "--resume", str(run), "--grid", "data=4,expert=4", "--steps", "3")
    assert main(["export", "--run", str(run), "--to", "hf", str(out)]) == 0
    exported = _transformers_logits(out)
    sizes = dict(y=2, data=2, expert=2)
    for rank, logits in enumerate(_grid_logits(pool4, out, "hf-mixtral", sizes)):
        torch.testing.assert_close(logits, exported[_rows(rank, sizes)], rtol=0, atol=1e-5)
    before = {k: v.float() for f in pretrained.glob("*.safetensors") for k, v in load_file(f).items()}
    after = load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in (k for k in after if "experts" in k):     # every expert of every layer trained
        moved = (before[key] - after[key]).flatten(1).abs().amax(1)
        assert bool((moved > 0).all()), key


@pytest.mark.parametrize("flags,said", [
    (["--grid", "data=2,expert=2", "--capacity-factor", "1"], "--capacity-factor 1.0: --model hf-mixtral routes as"),
    (["--grid", "data=2,pipe=2,expert=2", "--nproc", "4"], "pools every layer's counts, which no stage holds"),
    (["--grid", "data=2,expert=2", "--mlp", "dense"], "--model hf-mixtral is a mixture of experts: --mlp dense"),
    (["--grid", "data=2,expert=2", "--experts", "3"], "3 experts do not divide over expert=2"),
    (["--grid", "data=2,expert=2", "--top-k", "5"], "--top-k 5: give 1 to the 4 experts"),
])
def test_what_a_transformers_mixture_cannot_take_is_refused_before_any_rank_starts(tmp_path, capsys, flags, said):
    from par4d.cli import main

    shape = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "4",
             "--experts", "4"]
    assert main(["train", "--model", "hf-mixtral", "--nproc", "2", *shape, *flags, "--out", str(tmp_path / "no")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_a_folder_keeps_experts_apart_and_par4d_reads_and_writes_them_so(tmp_path, family):
    """save_pretrained writes each expert's matrices apart (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2, the
    others' mlp.experts.{e}.gate_proj/up_proj/down_proj): read as the stacked tensors they are in memory, whole
    and sliced; per_expert writes the stacked state back under exactly the folder's names and values."""
    from safetensors.torch import load_file

    from par4d.adopt.expert_files import per_expert, stacked_view
    from par4d.adopt.pretrained import opened, weight_files

    model = _model(family).float()
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert any(".experts.0." in k for k in stored)      # apart, one matrix per expert
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in stored)
    with opened(weight_files(tmp_path)) as handles:
        view, shapes = stacked_view(handles, {k: tuple(h.get_slice(k).get_shape()) for k, h in handles.items()})
        for name, param in model.named_parameters():
            assert shapes[name] == tuple(param.shape), name
            assert torch.equal(view[name].get_tensor(name), param.detach()), name
            if param.dim() == 3:                           # a rank's block: experts 1..3, rows across gate and up
                cut = (slice(1, 3), slice(3, param.shape[1] - 2), slice(4, 9))
                assert torch.equal(view[name].get_slice(name)[cut], param.detach()[cut]), name
                empty = view[name].get_slice(name)[(slice(2, 2), slice(None), slice(0, 3))]
                assert empty.shape == (0, param.shape[1], 3) and empty.dtype == param.dtype
        stacked = next(n for n in shapes if n.endswith("experts.gate_up_proj"))
        one = next(k for k in handles if k.endswith("experts.0.down_proj.weight") or k.endswith("experts.0.w2.weight"))
        with pytest.raises(ValueError, match="another layout: keep one"):     # both layouts: not par4d's guess
            stacked_view({**handles, stacked: handles[one]}, {**shapes, stacked: shapes[stacked]})
        odd = {k: v for k, v in shapes.items() if k in handles}
        odd[one] = (odd[one][0], odd[one][1] + 1)
        with pytest.raises(ValueError, match=f"{one} has shape"):            # every expert of a block alike
            stacked_view(handles, odd)
    written = per_expert(model.state_dict(), model.config.model_type)    # (DeepSeek-V3's score bias: a buffer)
    assert sorted(written) == sorted(stored)
    assert all(torch.equal(written[k], stored[k]) for k in stored)
