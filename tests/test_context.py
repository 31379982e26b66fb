"""The context axis (each sequence cut over its ranks, two chunks each) and ring attention (par4d.nn.ring):
the axis's sizes, coordinates and chunks; ring attention against torch's causal attention in float64 (the
output and the gradients of queries, keys and values) with the bytes its transfers move counted exactly;
par4d's GPT on grids with a context axis against its single-device twin in float64."""

import pytest
import torch
import torch.nn.functional as F

from par4d.grid import Grid, coords_of, describe, folded_groups, validate_sizes, within_groups
from par4d.layout import positions, sequence_chunks, shard_batch, shard_sequence
from par4d.models import GPTConfig
from tests import cases
from tests.cases import GPT_CONFIG, compare_gpt_with_twin
from tests.helpers import sizes_id


def test_the_context_axis_sits_inside_data_and_cuts_sequences_in_balanced_chunks():
    sizes = validate_sizes({"x": 2, "context": 2, "data": 2}, 8)
    assert describe(sizes) == "x=2 y=1 z=1 context=2 data=2 pipe=1"
    assert describe(validate_sizes({"data": 2}, 2)) == "x=1 y=1 z=1 data=2 pipe=1"     # at 1: not named
    assert [coords_of(r, sizes)["context"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert Grid.virtual(sizes, 2).group_ranks("context") == [0, 2]
    # 2C chunks, rank i holding i and 2C-1-i: the same causal work on each
    chunks = [sequence_chunks(Grid.virtual({"context": 4}, r), 16) for r in range(4)]
    assert [(a.start, b.start) for a, b in chunks] == [(0, 14), (2, 12), (4, 10), (6, 8)]
    grid = Grid.virtual({"context": 4}, 1)
    assert positions(grid, 4).tolist() == [2, 3, 12, 13]
    assert shard_sequence(grid, torch.arange(32).view(2, 16)).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    with pytest.raises(ValueError, match=r"a sequence of 12 tokens does not cut into 2 \* context = 8 equal chunks"):
        sequence_chunks(grid, 12)
    # with experts folded over data: an expert's gradient summed over the context and data ranks holding it
    sizes = validate_sizes({"context": 2, "data": 4, "expert": 2}, 8)
    assert describe(sizes) == "x=1 y=1 z=1 context=2 data=4 pipe=1 expert=2"
    assert folded_groups(sizes, "expert") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert within_groups(sizes, ("context", "data"), "expert") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def _ring_against_torch(sizes: dict) -> dict:
    """Ring attention's output and the gradients of q, k and v against torch's causal attention over the whole
    sequence, in float64; what the transfers moved."""
    from par4d.nn.ring import ring_attention

    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 16, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    weights = torch.randn(2, 3, 16, 4, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*full, is_causal=True) * weights).sum().backward()
    mine = [shard_sequence(grid, t, dim=2).requires_grad_() for t in (q, k, v)]
    with grid.ledger.capture() as entries:
        out = ring_attention(*mine, grid)
        (out * shard_sequence(grid, weights, dim=2)).sum().backward()
    expected = shard_sequence(grid, F.scaled_dot_product_attention(q, k, v, is_causal=True), dim=2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for name, got, whole in zip("qkv", mine, full):
        torch.testing.assert_close(got.grad, shard_sequence(grid, whole.grad, dim=2), rtol=1e-11, atol=1e-12,
                                   msg=lambda m, n=name: f"d{n}: {m}")
    return {kind: sum(e.bytes for e in entries if e.kind == kind) for kind in ("send", "recv")}


@pytest.mark.parametrize("sizes", [dict(context=4), dict(context=2, data=2)], ids=sizes_id)
def test_ring_attention_is_causal_attention_over_the_whole_sequence(pool4, sizes):
    ranks = sizes["context"]
    block = 2 * 2 * 3 * (16 // ranks) * 4 * 8          # keys and values of this rank's chunks, float64
    # forward: C - 1 blocks on; backward: C - 1 blocks on again, and C running gradient sums
    expected = (ranks - 1) * block + (ranks - 1) * block + ranks * block
    assert pool4.run(_ring_against_torch, sizes) == [{"send": expected, "recv": expected}] * 4


def _gpt_matches_twin(sizes: dict, compile: str = "none") -> tuple[int, int, int]:
    """The twin's check (how many tensors it compared), and the graphs and graph breaks compiling made."""
    from par4d.compiled import counted

    if compile != "none":
        torch._dynamo.reset()       # (the pool's ranks live on: no graph of another test's model reused)
    before = counted()
    with cases.float64():
        compared = compare_gpt_with_twin(cases.grid(**sizes), sizes, GPT_CONFIG, compile=compile)
    return compared, counted()[0] - before[0], counted()[1] - before[1]


@pytest.mark.parametrize("sizes", [dict(context=4), dict(context=2, data=2), dict(x=2, context=2),
                                   dict(y=2, context=2), dict(z=2, context=2)], ids=sizes_id)
def test_gpt_with_a_context_axis_matches_twin_4_ranks(pool4, sizes):
    """The loss, every gradient and the parameters after 3 AdamW steps, in float64; on context=2,data=2 with its
    blocks compiled (--compile aot_eager: the ring's transfers graph breaks)."""
    compile = "aot_eager" if sizes == dict(context=2, data=2) else "none"
    found = pool4.run(_gpt_matches_twin, sizes, compile)
    assert len({compared for compared, _, _ in found}) == 1
    for _, graphs, breaks in found:
        assert (graphs > 0 and breaks > 0) if compile != "none" else graphs == breaks == 0


def test_gpt_with_a_context_axis_matches_twin_8_ranks(pool8):
    """Three axes at once: heads over x, the batch over z, each sequence over context."""
    assert len({compared for compared, _, _ in pool8.run(_gpt_matches_twin, dict(x=2, z=2, context=2))}) == 1


def test_batches_read_only_a_context_ranks_chunks():
    """The run's batches: each rank reads its windows' own two chunks (and the token after each, its last
    target), exactly what cutting the whole batch gives it."""
    from par4d.layout import shard_batch
    from par4d.train.data import Batches

    batches = Batches(torch.arange(5000) % 251, seq_len=16, batch_size=4, seed=3)
    for sizes, rank in ((dict(context=4), 2), (dict(context=2, data=2), 3), (dict(x=2, context=2), 1)):
        grid = Grid.virtual(sizes, rank)
        whole = batches.train_batch(7)
        mine = batches.local_batch(grid, "train", 7)
        assert all(torch.equal(got, shard_batch(grid, t)) for got, t in zip(mine, whole))


def test_a_run_on_context_4_resumes_on_context_2_data_2_and_on_one_rank(tmp_path, pool4, pool2):
    """par4d train on context=4 for 2 steps, resumed on context=2,data=2 to 4 and on one rank to 6: it
    follows a one-rank run to fp32 rounding."""
    from tests.helpers import SMALL, checked_config, run_losses, train_alone, train_pooled

    run, alone = tmp_path / "cut", tmp_path / "alone"
    train_alone(checked_config("--nproc", "1", *SMALL, "--steps", "6", "--out", str(alone), world=1))
    train_pooled(pool4, "--grid", "context=4", *SMALL, "--steps", "2", "--out", str(run))
    train_pooled(pool4, "--resume", str(run), "--grid", "context=2,data=2", "--steps", "4")
    train_alone(checked_config("--resume", str(run), "--grid", "x=1", "--nproc", "1", "--steps", "6", world=1))
    assert run_losses(run) == pytest.approx(run_losses(alone), rel=1e-5)


def _pipeline_matches_twin(sizes: dict) -> dict:
    from tests.test_pipeline import _compare

    with cases.float64():
        return _compare(cases.grid(**sizes), sizes, batch=4, microbatches=2, recompute=0, limit=None)


def test_the_pipeline_with_a_context_axis_matches_twin(pool4):
    """pipe=2, context=2: each stage's context ranks take the pipeline's messages in one order (their layers'
    rings pair the same microbatch); loss, gradients and parameters after 3 AdamW steps, in float64."""
    results = pool4.run(_pipeline_matches_twin, dict(pipe=2, context=2))
    for stage in (0, 1):
        orders = [r["orders"] for r in results if r["stage"] == stage]
        assert len(orders) == 2 and orders[0] == orders[1]


def _hf(which: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(LlamaConfig(**shape)) if which == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape))
    return model.to(torch.get_default_dtype())


def _hf_matches(sizes: dict, which: str) -> list[str]:
    """transformers' model made parallel on a grid with a context axis against the model itself, in float64:
    the loss, every gradient and the parameters after 3 AdamW steps (what differs, named)."""
    import copy

    import par4d
    from par4d.adopt.causal_lm import CausalLM
    from par4d.adopt.stages import cut_stage, tie_across_stages
    from par4d.nn import full_state_dict
    from par4d.optim.data_parallel import global_mean, sync_gradients
    from par4d.pipeline import run_pipeline

    with cases.float64():
        grid = cases.grid(**sizes)
        twin = _hf(which)
        lm = copy.deepcopy(twin)
        stage = cut_stage(lm, grid)
        lm = par4d.parallelize(lm, grid)
        tie_across_stages(lm, stage)
        model, reference = CausalLM(lm, 0.0, 0, stage, grid), CausalLM(twin, 0.0, 0)
        mine = {n for n, _ in model.lm.named_parameters()}
        opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        far = []
        for step in range(3):
            tokens = torch.randint(0, 64, (8, 17), generator=gen)
            x, y = tokens[:, :-1], tokens[:, 1:]
            ref = reference(x, y)
            ref.backward()
            if grid.size("pipe") > 1:
                loss, _ = run_pipeline(model, grid, shard_batch(grid, x), shard_batch(grid, y), 2)
            else:
                loss = model(shard_batch(grid, x), shard_batch(grid, y))
                loss.backward()
            sync_gradients(model, grid)
            if abs(global_mean(loss, grid).item() - ref.item()) > 1e-9 * abs(ref.item()):
                far.append(f"step {step} loss {global_mean(loss, grid).item()} vs {ref.item()}")
            grads = full_state_dict(model.lm, grad=True)
            far += [f"step {step} grad {n}" for n, p in twin.named_parameters()
                    if n in mine and not torch.allclose(grads[n], p.grad, rtol=1e-8, atol=1e-10)]
            opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
        after = full_state_dict(model.lm)
        far += [f"{n} after 3 steps" for n, p in twin.named_parameters()
                if n in mine and not torch.allclose(after[n], p, rtol=1e-8, atol=1e-10)]
        return far


@pytest.mark.parametrize("sizes, which", [(dict(context=4), "llama"), (dict(x=2, context=2), "llama"),
                                          (dict(context=2, data=2), "qwen2"), (dict(pipe=2, context=2), "llama")],
                         ids=["context4-llama", "x2-context2-llama", "context2-data2-qwen2", "pipe2-context2-llama"])
def test_transformers_models_on_a_context_axis_are_the_model_itself(pool4, sizes, which):
    """Grouped-query attention (4 query heads, 2 key/value heads), rotary positions from the global index,
    through transformers' attention interface: exact in float64 against transformers' own model."""
    assert pool4.run(_hf_matches, sizes, which, timeout=240) == [[]] * 4


@pytest.mark.parametrize("args, said", [
    (["--grid", "context=2", "--seq-len", "10"], "--seq-len 10 does not cut into 2 * context = 4 equal chunks"),
    (["--grid", "context=2", "--model", "hf-gpt2"], "--grid context=2: --model hf-gpt2's attention does not run on "
                                                    "sequences cut over a context axis yet")])
def test_what_a_context_axis_cannot_run_is_refused_before_any_rank_starts(args, said):
    from tests.helpers import checked_config

    with pytest.raises(ValueError, match=said.replace("*", r"\*")):
        checked_config("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", *args,
                       "--out", "unused", world=4 if "data=2" in args[1] else 2)


def _documents_match_twin(sizes: dict, form: str, restart: bool) -> int:
    config = GPTConfig(vocab_size=36, block_size=16, n_layer=2, n_head=4, n_embd=24, seed=3)
    with cases.float64():
        return compare_gpt_with_twin(cases.grid(**sizes), sizes, config, documents=True, form=form, restart=restart)


@pytest.mark.parametrize("sizes, form, restart", [
    (dict(x=2, z=2), "ring", False), (dict(context=4), "ring", False), (dict(context=2, data=2), "ring", True),
    (dict(x=2, context=2), "ring", False), (dict(context=4), "gather", True)],
    ids=["x2-z2", "context4", "context2-data2-restart", "x2-context2", "context4-gather-restart"])
def test_document_masks_keep_attention_inside_documents_as_the_twin(pool4, sizes, form, restart):
    """Packed windows of documents: with and without a context axis (in both forms), positions from the window's
    start or restarting at each document's, the loss, every gradient and the parameters after 3 AdamW steps
    equal the twin's given the explicit block-diagonal causal mask, in float64."""
    assert len(set(pool4.run(_documents_match_twin, sizes, form, restart))) == 1


def test_a_prepared_dataset_trains_with_document_masks_on_a_context_axis_as_on_one_rank(tmp_path, pool4):
    """par4d data prepare, then par4d train --document-mask on context=2,data=2 and on one rank: the same losses
    (to fp32 rounding); each context rank's batch holds its chunks' documents, what cutting the whole gives."""
    from par4d.data.dataset import open_dataset
    from par4d.data.prepare import prepare
    from par4d.data.tokenizer import load_tokenizer
    from par4d.train.data import Batches
    from tests.helpers import PARAGRAPHS, bpe_tokenizer, checked_config, run_losses, train_alone, train_pooled

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(PARAGRAPHS) + "\n")
    prepare([str(text)], load_tokenizer(bpe_tokenizer(tmp_path / "tok")), tmp_path / "ds", progress=False)
    dataset = open_dataset(tmp_path / "ds", 32)
    batches = Batches.from_splits(dataset.splits["train"], dataset.splits["val"], 32, 8, 0, documents=True,
                                  restart=True)
    whole = batches.train_batch(3)
    assert len(whole) == 4 and whole[2].unique().numel() > 8        # several documents in each window
    first = torch.cat([torch.ones(8, 1, dtype=torch.bool), whole[2][:, 1:] != whole[2][:, :-1]], dim=1)
    assert torch.equal(whole[3] == 0, first)                        # positions restart where documents do
    grid = Grid.virtual(dict(context=2, data=2), 2)
    assert all(torch.equal(got, shard_batch(grid, t)) for got, t in zip(batches.local_batch(grid, "train", 3), whole))
    common = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "32",
              "--no-progress", "--peak-flops", "1e11", "--data", str(tmp_path / "ds"), "--document-mask",
              "--steps", "3"]
    run, alone = tmp_path / "cut", tmp_path / "alone"
    train_alone(checked_config("--nproc", "1", *common, "--restart-positions", "--out", str(alone), world=1))
    train_pooled(pool4, "--grid", "context=2,data=2", *common, "--restart-positions", "--out", str(run))
    assert run_losses(run) == pytest.approx(run_losses(alone), rel=1e-5)
    with pytest.raises(ValueError, match="--document-mask: give --data a dataset folder of par4d data prepare"):
        checked_config(*common[:-5], "--document-mask", "--data", str(text), "--out", "unused", world=1)
    with pytest.raises(ValueError, match="--document-mask: --model hf-gpt2's attention does not keep inside"):
        checked_config(*common, "--model", "hf-gpt2", "--out", "unused", world=1)
    with pytest.raises(ValueError, match="--restart-positions: positions restart at each document's start"):
        checked_config(*common[:-5], "--restart-positions", "--data", str(tmp_path / "ds"), "--out", "unused",
                       world=1)
    with pytest.raises(ValueError, match="--document-mask with --grid pipe=2: the pipeline does not carry"):
        checked_config(*common, "--grid", "pipe=2", "--out", "unused", world=2)


def _bench_rows() -> list[dict]:
    from par4d.bench.context import ContextSettings, context_worker

    return context_worker(ContextSettings(nproc=4, iters=1, n_embd=32, n_head=4, lengths=(64, 128), timed=64,
                                          budget_mb=1.0, warmup=0))


def test_bench_context_measures_each_grids_activations_and_says_what_stops_torchs(pool4):
    """Per grid (context=4, x=2,context=2, and x=4, y=4, x=2,y=2 without one) the activations a rank holds at
    each length, twice as many at twice the length; the context axis holds the fewest; each grid timed with a
    document mask too; torch's context parallel timed or its error said (on CPUs: no sharding rule for the CPU
    attention kernel)."""
    rows = pool4.run(_bench_rows, timeout=240)[0]
    ours = [r for r in rows if r["name"] == "par4d"]
    masked = [r for r in rows if r["name"] == "par4d --document-mask"]
    held = {(r["grid"], r["seq_len"]): r["activation_bytes_per_rank"] for r in ours}
    grids = sorted({g for g, _ in held})
    assert len(grids) == 5 and all((g, 64) in held and (g, 128) in held for g in grids)
    for g in grids:
        assert 1.8 < held[(g, 128)] / held[(g, 64)] < 2.2
    cut = next(g for g in grids if "context=4" in g)
    assert all(held[(cut, 128)] < held[(g, 128)] for g in grids if g != cut)
    assert all((r["s_per_iter"] is not None) == (r["seq_len"] == 64) for r in ours)
    assert sorted(r["grid"] for r in masked) == grids and all(r["s_per_iter"] > 0 for r in masked)
    theirs = rows[-1]
    assert theirs["name"] == "torch context_parallel" and (theirs["s_per_iter"] is not None or theirs["error"])


def _grouped_ring(sizes: dict) -> dict:
    """Grouped-query attention (4 query heads, 2 key/value heads): against torch's with the heads repeated; only
    the 2 key/value heads travel."""
    from par4d.nn.ring import ring_attention

    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 16, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 16, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    wide = [full[0], *(t.repeat_interleave(2, dim=1) for t in full[1:])]
    F.scaled_dot_product_attention(*wide, is_causal=True).square().sum().backward()
    mine = [shard_sequence(grid, t, dim=2).requires_grad_() for t in (q, k, v)]
    with grid.ledger.capture() as entries:
        ring_attention(*mine, grid).square().sum().backward()
    for got, whole in zip(mine, full):
        torch.testing.assert_close(got.grad, shard_sequence(grid, whole.grad, dim=2), rtol=1e-11, atol=1e-12)
    return sum(e.bytes for e in entries if e.kind == "send")


def test_grouped_query_keys_travel_as_they_are(pool4):
    block = 2 * 2 * 2 * 4 * 4 * 8          # keys and values of 2 heads, this rank's 4 tokens, float64
    assert pool4.run(_grouped_ring, dict(context=4)) == [(3 + 3 + 4) * block] * 4


def _gathered_against_torch(sizes: dict) -> int:
    """The all-gather form against torch's attention over the whole sequence (grouped-query heads, a document
    mask too), in float64; what its collectives moved."""
    from par4d.nn.ring import ring_attention

    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 16, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 16, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    documents = torch.cumsum(torch.rand(2, 16, generator=gen) < 0.3, dim=1)
    for packed in (None, documents):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        wide = [full[0], *(t.repeat_interleave(2, dim=1) for t in full[1:])]
        mask = None if packed is None else \
            (torch.ones(16, 16, dtype=torch.bool).tril() & (packed.unsqueeze(-1) == packed.unsqueeze(-2))).unsqueeze(1)
        F.scaled_dot_product_attention(*wide, attn_mask=mask, is_causal=packed is None).square().sum().backward()
        mine = [shard_sequence(grid, t, dim=2).requires_grad_() for t in (q, k, v)]
        with grid.ledger.capture() as entries:
            ring_attention(*mine, grid, documents=packed, form="gather").square().sum().backward()
        for got, whole in zip(mine, full):
            torch.testing.assert_close(got.grad, shard_sequence(grid, whole.grad, dim=2), rtol=1e-11, atol=1e-12)
    return sum(e.bytes for e in entries if e.kind in ("all_gather", "reduce_scatter"))


def test_the_all_gather_form_is_causal_attention_over_the_whole_sequence(pool4):
    # keys and values of 2 heads, this rank's 4 tokens, float64: gathered, and their gradients reduce-scattered
    mine = 2 * 2 * 2 * 4 * 4 * 8
    assert pool4.run(_gathered_against_torch, dict(context=4)) == [mine + 4 * mine] * 4


def _gathered_gpt_matches_twin(sizes: dict) -> int:
    with cases.float64():
        return compare_gpt_with_twin(cases.grid(**sizes), sizes, GPT_CONFIG, form="gather")


def test_gpt_with_the_all_gather_form_matches_twin(pool4):
    assert len(set(pool4.run(_gathered_gpt_matches_twin, dict(x=2, context=2)))) == 1


def _overlapped_and_not(sizes: dict) -> list[bool]:
    """par4d's GPT with the ring's transfers behind attention (--overlap cp) and without (none): the same bits."""
    from par4d.layout import shard_batch as cut
    from par4d.overlap import Overlap, set_overlap
    from par4d.train.recipes.gpt import build_gpt

    grid = cases.grid(**sizes)
    tokens = torch.randint(0, 36, (4, 9), generator=torch.Generator().manual_seed(2))
    results = []
    for settings in (Overlap.parse("cp"), Overlap.none()):
        model = set_overlap(build_gpt(GPT_CONFIG, grid), settings)
        model(cut(grid, tokens[:, :-1]), cut(grid, tokens[:, 1:])).backward()
        results.append([p.grad.clone() for p in model.parameters()])
    return [torch.equal(a, b) for a, b in zip(*results)]


def test_the_rings_overlap_changes_no_bit(pool4):
    found = pool4.run(_overlapped_and_not, dict(context=4))
    assert all(all(r) and len(r) > 10 for r in found)


def _hf_documents_match(sizes: dict) -> list[str]:
    """transformers' Llama made parallel, with packed documents (positions restarting at each), against the model
    itself given the explicit block-diagonal causal mask (a 4-D mask) and those position_ids, in float64: the
    loss and every gradient (what differs, named)."""
    import copy

    import par4d
    from par4d.adopt.causal_lm import CausalLM
    from par4d.nn import full_state_dict
    from par4d.optim.data_parallel import global_mean, sync_gradients

    with cases.float64():
        grid = cases.grid(**sizes)
        twin = _hf("llama")
        model = CausalLM(par4d.parallelize(copy.deepcopy(twin), grid), 0.0, 0, grid=grid)
        gen = torch.Generator().manual_seed(4)
        tokens = torch.randint(0, 64, (8, 17), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        starts = torch.rand(x.shape, generator=gen) < 0.25
        documents = torch.cumsum(starts, dim=1)
        index = torch.arange(16).expand(x.shape)
        places = index - torch.where(starts, index, 0).cummax(dim=1).values
        mask = torch.zeros(8, 1, 16, 16, dtype=torch.bool)
        for row in range(8):
            for i in range(16):
                for j in range(i + 1):
                    mask[row, 0, i, j] = bool(documents[row, i] == documents[row, j])
        logits = twin(input_ids=x, attention_mask=mask, position_ids=places, use_cache=False).logits
        ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        ref.backward()
        loss = model(*(shard_batch(grid, t) for t in (x, y, documents, places)))
        loss.backward()
        sync_gradients(model, grid)
        far = [] if abs(global_mean(loss, grid).item() - ref.item()) <= 1e-9 * ref.item() else ["loss"]
        grads = full_state_dict(model.lm, grad=True)
        return far + [n for n, p in twin.named_parameters() if not torch.allclose(grads[n], p.grad, rtol=1e-8,
                                                                                   atol=1e-10)]


@pytest.mark.parametrize("sizes", [dict(context=2, data=2), dict(x=2, z=2)], ids=sizes_id)
def test_transformers_models_keep_attention_inside_documents(pool4, sizes):
    assert pool4.run(_hf_documents_match, sizes, timeout=240) == [[]] * 4
