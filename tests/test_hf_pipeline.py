"""Hugging Face models on the pipe axis (``par4d.adopt.stages``) against the unparallelized model: loss,
every gradient and parameters after 3 AdamW steps (float64), on pipe=2,x=2,z=2 and other real grids;
a head tied to the embeddings on the first and last stage; stages balanced by FLOPs."""

import copy

import pytest
import torch

import par4d
from par4d.adopt.causal_lm import CausalLM
from par4d.adopt.stages import Absent, Elsewhere, cut_stage, stage_layers, tie_across_stages
from par4d.grid import Grid
from par4d.layout import placement_of, shard_batch
from par4d.nn import full_state_dict
from par4d.optim.data_parallel import global_mean, grad_norm, sync_gradients
from par4d.pipeline import run_pipeline
from tests import cases

STEPS = 3


def _llama(tied: bool = False, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(torch.get_default_dtype())


def _gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)   # the head is tied to wte
    return GPT2LMHeadModel(config).to(torch.get_default_dtype())


def _mixtral(layers: int = 4):
    """Without its load-balancing loss (a folder's usual config): a mixture cut into stages; its router far from
    ties, its experts by transformers' loop (its grouped GEMM takes no float64)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=16, output_router_logits=False)
    model = MixtralForCausalLM(config).to(torch.get_default_dtype())
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1.0)
    return model


BUILD = {"llama": _llama, "llama-tied": lambda: _llama(tied=True), "gpt2": _gpt2, "mixtral": _mixtral}


def _stage(twin, grid) -> CausalLM:
    lm = copy.deepcopy(twin)
    stage = cut_stage(lm, grid)
    lm = par4d.parallelize(lm, grid)
    tie_across_stages(lm, stage)
    return CausalLM(lm, 0.0, 0, stage)


def _matches(sizes: dict, which: str, microbatches: int) -> dict:
    with cases.float64():
        grid = cases.grid(**sizes)
        twin = BUILD[which]()
        model = _stage(twin, grid)
        reference = CausalLM(twin, 0.0, 0)
        mine = {n for n, _ in model.lm.named_parameters(remove_duplicate=False)}
        opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        far, norms = [], []
        for step in range(STEPS):
            tokens = torch.randint(0, 64, (8, 7), generator=gen)
            x, y = tokens[:, :-1], tokens[:, 1:]
            ref = reference(x, y)
            ref.backward()
            loss, stats = run_pipeline(model, grid, shard_batch(grid, x), shard_batch(grid, y), microbatches)
            sync_gradients(model, grid)
            if abs(global_mean(loss, grid).item() - ref.item()) > 1e-5 * abs(ref.item()):
                far.append(f"step {step} loss {global_mean(loss, grid).item()} vs {ref.item()}")
            grads = full_state_dict(model.lm, grad=True)
            far += [f"step {step} grad {n}" for n, p in twin.named_parameters(remove_duplicate=False)
                    if n in mine and not torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6)]
            norms.append((grad_norm(model, grid).item(),
                          torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in twin.parameters()])).item()))
            opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
        after = full_state_dict(model.lm)
        far += [f"{n} after {STEPS} steps" for n, p in twin.named_parameters(remove_duplicate=False)
                if n in mine and not torch.allclose(after[n], p, rtol=1e-5, atol=1e-5)]
        peers = {n: placement_of(p).pipe_peer for n, p in model.lm.named_parameters() if placement_of(p).pipe_peer}
        return {"stage": grid.coord("pipe"), "mine": sorted(mine), "far": far, "norms": norms,
                "layers": list(model.stage.layers), "order": stats.order, "peers": peers,
                "width": model.stream_shape(1, 1)[0][-1]}


def _check(results: list[dict], which: str) -> None:
    for r in results:
        assert not r["far"], r["far"]
        for ours, theirs in r["norms"]:       # the tied weight counted once, on the first stage
            assert abs(ours - theirs) <= 1e-9 * theirs, r["norms"]
    names = {n for n, _ in BUILD[which]().named_parameters(remove_duplicate=False)}
    assert set().union(*(set(r["mine"]) for r in results)) == names     # every parameter on some stage


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_pipe2_x2_z2(pool8, which):
    results = pool8.run(_matches, dict(pipe=2, x=2, z=2), which, 2)
    _check(results, which)
    layers = {r["stage"]: r["layers"] for r in results}
    assert layers == {0: [0, 1], 1: [2, 3]}, layers
    for r in results:                     # each parameter on one stage, but a tied head on the first and last
        tied = {"transformer.wte.weight": 1 if r["stage"] == 0 else -1} if which == "gpt2" else {}
        assert r["peers"] == tied


@pytest.mark.parametrize("sizes, which", [(dict(pipe=4), "llama-tied"), (dict(pipe=2, y=2), "gpt2"),
                                          (dict(pipe=2, data=2), "llama"), (dict(pipe=2, data=2, expert=2), "mixtral")],
                         ids=["pipe4-tied", "pipe2-y2", "pipe2-d2", "pipe2-d2-e2-mixtral"])
def test_4_ranks(pool4, sizes, which):
    results = pool4.run(_matches, sizes, which, 2)
    _check(results, "llama" if which == "llama-tied" else which)
    assert {r["width"] for r in results} == {32 // sizes.get("y", 1)}    # the stream between stages: over y
    if which == "llama-tied":             # the middle stages hold neither the embedding nor the head
        held = {r["stage"]: r["mine"] for r in results}
        assert not any("embed" in n or "lm_head" in n for s in (1, 2) for n in held[s])
        assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" in held[3]


def test_stages_are_balanced_by_flops():
    with torch.device("meta"):
        lm = _llama(layers=8)
    assert stage_layers(lm, 1) == [range(0, 8)]
    # the head (64 x 32) weighs about a third of a layer here: the last stage gets fewer layers only when
    # that evens out the largest stage
    runs = stage_layers(lm, 4)
    assert [len(r) for r in runs] == [2, 2, 2, 2] and runs[-1].stop == 8
    assert stage_layers(lm, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    with pytest.raises(ValueError, match="pipe=9: each stage needs at least one of the n_layer=8 blocks"):
        stage_layers(lm, 9)


def test_a_stage_keeps_names_and_replaces_what_lives_elsewhere():
    with torch.device("meta"):
        lm = _llama()
    grid = Grid.virtual({"pipe": 2}, 1)
    stage = cut_stage(lm, grid)
    assert (stage.first, stage.last, stage.layers) == (False, True, range(2, 4))
    assert all(isinstance(lm.model.layers[i], Elsewhere) for i in range(2))
    assert isinstance(lm.model.embed_tokens, Absent)
    with pytest.raises(RuntimeError, match="model.embed_tokens lives on pipeline stage 0"):
        lm.model.embed_tokens(torch.zeros(1, dtype=torch.long))
    layers = sorted(n.split(".")[2] for n, _ in lm.named_parameters() if n.startswith("model.layers"))
    assert layers == ["2"] * 9 + ["3"] * 9
