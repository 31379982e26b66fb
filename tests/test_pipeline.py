"""The message-driven pipeline (pipe > 1) against the single-device twin: loss, every
gradient, and parameters after AdamW steps, on real grids with and without recomputation."""

import pytest
import torch

from par4d.layout import shard_batch
from par4d.models import GPTConfig
from par4d.optim.data_parallel import global_mean, sync_gradients
from par4d.pipeline import run_pipeline
from par4d.train.recipes.gpt import build_gpt, build_reference
from tests import cases

CONFIG = GPTConfig(vocab_size=36, block_size=8, n_layer=4, n_head=4, n_embd=24, seed=3)
STEPS = 3


def _pipeline_matches_twin(sizes: dict, batch: int, microbatches: int, recompute: int = 0,
                           limit: int | None = None) -> dict:
    """In float64 (``cases.float64``): loss, gradients and parameters after 3 AdamW steps."""
    with cases.float64():
        return _compare(cases.grid(**sizes), sizes, batch, microbatches, recompute, limit)


def _compare(grid, sizes: dict, batch: int, microbatches: int, recompute: int, limit: int | None) -> dict:
    twin = build_reference(CONFIG)
    model = build_gpt(CONFIG, grid, recompute)
    mine = {name for name, _ in model.named_parameters()}
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    gen = torch.Generator().manual_seed(0)
    orders, sent, held = [], [], []
    for step in range(STEPS):
        # The last step's batch is shorter: shapes change between batches.
        rows = batch if step < STEPS - 1 else batch - grid.size("z", "data")
        tokens = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.block_size + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ref_loss = twin(inputs, targets)
        ref_loss.backward()
        with grid.ledger.capture() as entries:
            loss, stats = run_pipeline(model, grid, shard_batch(grid, inputs), shard_batch(grid, targets),
                                       min(microbatches, rows // grid.size("z", "data")), limit)
        sent.append(sum(e.bytes for e in entries if e.kind == "send"))
        sync_gradients(model, grid)
        orders.append(stats.order)
        held.append(stats.max_in_flight)
        torch.testing.assert_close(global_mean(loss, grid), ref_loss.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, s=step: f"{sizes} step {s} loss: {m}")
        grads = model.reference_state(grad=True)
        assert set(grads) == mine
        for name, param in twin.named_parameters():
            if name in mine:
                torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, s=step: f"{sizes} step {s} grad {n}: {m}")
        opt.step()
        opt_twin.step()
        opt.zero_grad()
        opt_twin.zero_grad()
    after = model.reference_state()
    for name, param in twin.named_parameters():
        if name in mine:
            torch.testing.assert_close(after[name], param.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{sizes} after {STEPS} AdamW steps, {n}: {m}")
    return {"stage": grid.coord("pipe"), "data": grid.coord("data"), "params": sorted(mine), "order": orders[0],
            "orders": orders, "sent": sent, "held": max(held), "stages": grid.size("pipe")}


def _stages_cover_the_twin(results: list[dict]) -> None:
    # The ranks of a stage that share collectives (x, y, z) took their messages in one order:
    # otherwise their layers' collectives would pair different microbatches.
    orders: dict[tuple, list] = {}
    for r in results:
        orders.setdefault((r["stage"], r["data"]), []).append(r["orders"])
    assert all(all(o == group[0] for o in group) for group in orders.values())
    names = {name for name, _ in build_reference(CONFIG, init=False).named_parameters()}
    by_stage: dict[int, set] = {}
    for r in results:
        by_stage.setdefault(r["stage"], set()).update(r["params"])
    assert set().union(*by_stage.values()) == names
    assert sum(len(p) for p in by_stage.values()) == len(names)    # no parameter on two stages
    # Stage s held at most pipe - s microbatches at once (the first stage's limit is pipe).
    assert all(1 <= r["held"] <= r["stages"] - r["stage"] for r in results if r["stage"] < r["stages"] - 1)


def test_pipe_2(pool2):
    """2 stages, 6 sequences in 4 microbatches (2, 2, 1, 1 rows: weighted by their rows). The
    first stage's order is Algorithm 2's: two in flight, a new forward after each backward."""
    results = pool2.run(_pipeline_matches_twin, dict(pipe=2), 6, 4)
    _stages_cover_the_twin(results)
    assert results[0]["order"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert results[1]["order"] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # Exact point-to-point bytes: each of 4 microbatches sends its activation forward (stage 0)
    # or its gradient back (stage 1), rows x T x D fp32, and nothing else (no header).
    for steps_rows in results[0]["sent"], results[1]["sent"]:
        assert steps_rows == [6 * 8 * 24 * 8] * 2 + [5 * 8 * 24 * 8]      # float64 activations


def test_pipeline_limit_1_runs_one_microbatch_at_a_time(pool2):
    """--pipeline-limit 1: the first stage starts a microbatch only when the one before came
    back; the gradients are the same."""
    results = pool2.run(_pipeline_matches_twin, dict(pipe=2), 6, 4, 0, 1)
    _stages_cover_the_twin(results)
    assert [r["order"] for r in results] == [["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]] * 2
    assert results[0]["held"] == 1


@pytest.mark.parametrize("sizes, recompute", [(dict(pipe=4), 0), (dict(pipe=2, x=2), 1), (dict(pipe=2, z=2), 0),
                                              (dict(pipe=2, data=2), 1)],
                         ids=["pipe4", "pipe2-x2-recompute", "pipe2-z2", "pipe2-data2-recompute"])
def test_pipeline_4_ranks(pool4, sizes, recompute):
    _stages_cover_the_twin(pool4.run(_pipeline_matches_twin, sizes, 8, 4, recompute))


@pytest.mark.parametrize("sizes, recompute", [(dict(pipe=2, z=2, data=2), 0), (dict(pipe=2, z=2, data=2), 1),
                                              (dict(pipe=2, x=2, y=2), 0), (dict(pipe=4, x=2), 1)],
                         ids=["pipe2-z2-data2", "pipe2-z2-data2-recompute", "pipe2-x2-y2", "pipe4-x2-recompute"])
def test_pipeline_8_ranks(pool8, sizes, recompute):
    _stages_cover_the_twin(pool8.run(_pipeline_matches_twin, sizes, 8, 4, recompute))


def test_stages_balance_the_model_s_flops():
    demo = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_embd=128, n_head=4)
    assert demo.stage_blocks(2) == [range(0, 2), range(2, 4)]
    assert demo.stage_blocks(4) == [range(i, i + 1) for i in range(4)]
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_embd=768, n_head=12)
    assert [len(r) for r in gpt2.stage_blocks(4)] == [3, 4, 4, 1]     # the head is worth 3 blocks
    with pytest.raises(ValueError, match="pipe=5: each stage needs at least one of the n_layer=4 blocks"):
        demo.stage_blocks(5)


def test_recompute_auto_fits_every_stage():
    from par4d.train.config import TrainConfig

    # 8 blocks on 2 stages of 4: the divisor of 4 closest to sqrt(8) is 2.
    assert TrainConfig(grid={"pipe": 2}, out=None, n_layer=8, recompute="auto").recompute_every() == 2
    with pytest.raises(ValueError, match="the pipeline stages' blocks .multiples of 1. do not split"):
        TrainConfig(grid={"pipe": 4}, out=None, n_layer=4, n_embd=32, n_head=2, recompute="2")
