"""The planner's pipe axis: the pipeline's bubble, hand-offs, per-microbatch collectives and
memory against hand-computed counts (no ranks: the model alone)."""

from dataclasses import asdict

import pytest

from par4d.overlap import Overlap
from par4d.plan import GPTSpec, Layer, Machine, bandwidths, predict, rank_configurations
from par4d.plan.collectives import AXES4
from par4d.plan.cost import VARIANTS

# Powers of two: the hand-computed times below are exact.
NODE8 = Machine("pipe-test", devices_per_node=8, peak_flops=2.0**40, memory_bytes=1e12, beta_intra=2.0**30,
                beta_inter=2.0**27, latency=2.0**-12, bytes_per_element=2)
NODE4 = Machine("node4", devices_per_node=4, peak_flops=100e12, memory_bytes=40e9, beta_intra=200.0,
                beta_inter=50.0, bytes_per_element=1)
# One bandwidth everywhere and no latency: collective times are linear in their bytes and counts.
FLAT = Machine("flat", devices_per_node=64, peak_flops=2.0**40, memory_bytes=1e12, beta_intra=2.0**30,
               beta_inter=2.0**30, latency=0.0, bytes_per_element=2)
SPEC = GPTSpec("t", n_layer=4, hidden=64, heads=4, seq_len=32, global_batch=16, vocab=256)
ONE = dict(x=1, y=1, z=1, data=1)


def test_pipe_of_one_is_the_4d_prediction():
    for sizes in (ONE, dict(x=2, y=1, z=2, data=2), dict(x=2, y=2, z=2, data=1), dict(x=1, y=4, z=1, data=2)):
        for variant in VARIANTS:
            for overlap in ((None, Overlap()) if variant == "full" else (None,)):
                before = asdict(predict(SPEC, sizes, NODE4, variant, True, overlap=overlap))
                assert before.pop("sizes") == sizes
                for microbatches in (None, 1):
                    after = asdict(predict(SPEC, {**sizes, "pipe": 1}, NODE4, variant, True, overlap=overlap,
                                           microbatches=microbatches))
                    assert after.pop("sizes") == {**sizes, "pipe": 1}
                    assert after["t_comm_axes"].pop("pipe") == 0.0
                    assert after == before, (sizes, variant, overlap)
                assert before["microbatches"] == 1 and before["t_p2p"] == 0.0
                assert "pipe" not in before["t_comm_axes"]                 # existing callers see the 4D axes
        for aware in (False, True):
            with_pipe = bandwidths({**sizes, "pipe": 1}, NODE4, aware)
            assert with_pipe.pop("pipe") > 0 and with_pipe == bandwidths(sizes, NODE4, aware)


def test_pipe_bandwidth_extends_eq_10_outermost():
    # Inside a node when the span fits and tiles it.
    assert bandwidths(dict(ONE, x=2, pipe=2), NODE4, True)["pipe"] == 200
    assert bandwidths(dict(ONE, pipe=4), NODE4, True)["pipe"] == 200
    # Across nodes: β_inter over min(G_node, product of the inner sizes).
    assert bandwidths(dict(ONE, pipe=8), NODE4, True)["pipe"] == 50
    assert bandwidths(dict(ONE, x=2, pipe=4), NODE4, True)["pipe"] == 25
    assert bandwidths(dict(x=2, y=1, z=1, data=2, pipe=2), NODE4, True)["pipe"] == 50 / 4
    assert bandwidths(dict(x=2, y=2, z=2, data=1, pipe=2), NODE4, True)["pipe"] == 50 / 4     # bounded by G_node
    # Stages of 3 ranks do not tile 4-device nodes.
    assert bandwidths(dict(ONE, pipe=3), NODE4, True)["pipe"] == 50
    # The inner axes are as before; agnostic: β_inter everywhere.
    assert bandwidths(dict(x=2, y=4, z=1, data=1, pipe=2), NODE4, True) == dict(x=200, y=25, z=50 / 4, data=50 / 4,
                                                                                pipe=50 / 4)
    assert bandwidths(dict(ONE, pipe=2), NODE4, False) == dict(x=50, y=50, z=50, data=50, pipe=50)


@pytest.mark.parametrize("pipe, microbatches", [(2, 2), (2, 8), (4, 4), (4, 1), (4, 3), (3, 5)])
def test_bubble_is_fill_and_drain(pipe, microbatches):
    sizes = dict(x=2, y=1, z=1, data=1, pipe=pipe)
    profiled = predict(SPEC, sizes, NODE8, compute_seconds=1.0, microbatches=microbatches)
    assert profiled.t_compute == (microbatches + pipe - 1) / microbatches        # one stage's 1 s, plus the bubble
    analytic = predict(SPEC, sizes, NODE8, microbatches=microbatches)
    whole = predict(SPEC, dict(x=2, y=1, z=1, data=1), NODE8)                     # the same grid, one stage
    assert analytic.t_compute == pytest.approx(whole.t_compute / pipe * (microbatches + pipe - 1) / microbatches,
                                               rel=1e-12)
    assert analytic.t_iter == analytic.t_compute + analytic.t_comm
    # % of peak counts every device, the stages' included.
    flops = SPEC.flops_per_iteration(False)
    assert analytic.percent_of_peak == pytest.approx(100 * flops / (analytic.t_iter * 2 * pipe * NODE8.peak_flops),
                                                     rel=1e-12)


def test_p2p_is_two_hand_offs_per_stage_boundary():
    # 16 sequences over z*data=2: 8 per shard, 4 microbatches of 2; y=2 halves the stream's width.
    sizes = dict(x=2, y=2, z=1, data=2, pipe=2)
    pred = predict(SPEC, sizes, NODE8, microbatches=4)
    message = 2 * 32 * (64 // 2) * 2                                 # rows x seq x n_embd/G_y x bytes
    beta = NODE8.beta_inter / 8                                      # 16 ranks over 8-device nodes, 8 inner ranks
    assert bandwidths(sizes, NODE8, True)["pipe"] == beta
    assert pred.t_p2p == 2 * 1 * (NODE8.latency + message / beta)
    assert pred.t_comm_axes["pipe"] == pred.t_p2p and pred.row()["t_p2p"] == pred.t_p2p
    assert pred.t_comm == pytest.approx(sum(pred.t_comm_axes[a] for a in AXES4) + pred.t_p2p, rel=1e-12)
    # Inside a node, 4 stages, 2 microbatches of 8: 6 hand-offs at β_intra.
    inside = predict(SPEC, dict(ONE, pipe=4), NODE8, microbatches=2)
    assert inside.t_p2p == 2 * 3 * (NODE8.latency + 8 * 32 * 64 * 2 / NODE8.beta_intra)
    # Nothing else communicates on a grid of stages alone: all of it is the hand-offs, and none hides.
    assert inside.t_comm == inside.t_p2p
    assert predict(SPEC, dict(ONE, pipe=4), NODE8, overlap=Overlap(), microbatches=2).t_exposed == inside.t_p2p
    # The paper's model (aware) has no latency.
    aware = predict(SPEC, dict(ONE, pipe=4), NODE8, "aware", microbatches=2)
    assert aware.t_p2p == 2 * 3 * (8 * 32 * 64 * 2 / NODE8.beta_intra)


def test_weight_collectives_once_per_microbatch_activations_once_per_step():
    sizes = dict(x=2, y=2, z=2, data=2)
    # full: par4d's collectives (one bucketed data sync); aware: the paper's Eqs 4-8 (one per layer).
    for variant in ("full", "aware"):
        one = predict(SPEC, sizes, FLAT, variant).t_comm_axes
        assert all(one[a] > 0 for a in AXES4)
        for microbatches in (1, 2, 4):
            t = predict(SPEC, {**sizes, "pipe": 2}, FLAT, variant, microbatches=microbatches).t_comm_axes
            # z: the weights' gathers and gradient reduce-scatters, the stage's half, once per microbatch.
            assert t["z"] == pytest.approx(one["z"] / 2 * microbatches, rel=1e-12)
            # x, y: activations (the layers', norm statistics, loss): the stage's half of the step's bytes.
            assert t["x"] == pytest.approx(one["x"] / 2, rel=1e-12)
            assert t["y"] == pytest.approx(one["y"] / 2, rel=1e-12)
            # data: the stage's half of the parameters, synced once per step.
            assert t["data"] == pytest.approx(one["data"] / 2, rel=1e-12)
    # With a latency per ring step, activation collectives pay it once per microbatch.
    slow = Machine("slow", devices_per_node=64, peak_flops=2.0**40, memory_bytes=1e12, beta_intra=2.0**30,
                   beta_inter=2.0**30, latency=2.0**-10, bytes_per_element=2)
    x2 = predict(SPEC, {**sizes, "pipe": 2}, slow, microbatches=2).t_comm_axes["x"]
    x4 = predict(SPEC, {**sizes, "pipe": 2}, slow, microbatches=4).t_comm_axes["x"]
    # Over x, 2 ring steps each on x=2: per block qkv's and fc's input-gradient all-reduce and the
    # projections' forward one; the head's input-gradient one; the loss's two. The stage's half of them.
    calls = (4 * 4 + 1 + 2) / 2
    assert x4 - x2 == pytest.approx((4 - 2) * calls * 2 * slow.latency, rel=1e-9)
    # The overlap model's exposed share is computed over the stage's work, and never exceeds all of it.
    hidden = predict(SPEC, {**sizes, "pipe": 2}, FLAT, overlap=Overlap(), microbatches=4)
    assert hidden.t_p2p <= hidden.t_exposed <= hidden.t_comm
    assert hidden.t_iter == hidden.t_compute + hidden.t_exposed


@pytest.mark.parametrize("pipe, microbatches, held", [(4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 8, 1 / 2), (2, 8, 1 / 4),
                                                       (4, 3, 1)])
def test_memory_holds_min_p_m_microbatches_of_the_stage(pipe, microbatches, held):
    sizes = dict(x=2, y=1, z=2, data=1)
    for checkpointing in (False, True):
        fixed = SPEC.with_batch(0).memory_per_device(sizes, 2, checkpointing)     # parameters, gathered weights
        activations = SPEC.memory_per_device(sizes, 2, checkpointing) - fixed   # the whole shard's, linear in it
        pred = predict(SPEC, {**sizes, "pipe": pipe}, NODE8, checkpointing=checkpointing, microbatches=microbatches)
        assert min(pipe, microbatches) / microbatches == held
        assert pred.mem_bytes == pytest.approx((fixed + activations * held) / pipe, rel=1e-12)


def test_bad_pipelines_are_refused_with_the_numbers():
    sizes = dict(x=1, y=1, z=1, data=2, pipe=2)                    # 8 sequences per data shard
    with pytest.raises(ValueError, match=r"microbatches=9: a data x z shard has 8 sequences \(global batch 16 over "
                                         r"z\*data=2\); give 1 to 8"):
        predict(SPEC, sizes, NODE8, microbatches=9)
    assert predict(SPEC, sizes, NODE8, microbatches=8).microbatches == 8
    with pytest.raises(ValueError, match="pipe=2, microbatches=0: both must be >= 1"):
        predict(SPEC, sizes, NODE8, microbatches=0)
    # Without a pipeline, microbatches are gradient accumulation, bounded by the shard alike.
    with pytest.raises(ValueError, match=r"microbatches=17: a data x z shard has 16 sequences"):
        predict(SPEC, ONE, NODE8, microbatches=17)
    with pytest.raises(ValueError, match="pipe=0"):
        predict(SPEC, dict(ONE, pipe=0), NODE8)
    # More stages than blocks: excluded, as GPTConfig.stage_blocks refuses it.
    pred = predict(SPEC, dict(ONE, pipe=5), NODE8)
    assert not pred.fits and pred.excluded == "pipe=5: each stage needs at least one of the n_layer=4 blocks"
    assert predict(SPEC, dict(ONE, pipe=4), NODE8).fits
    # Only par4d's GPT has stages that hand on a residual stream.
    from par4d.plan.workload import ModuleWorkload

    module = ModuleWorkload("mlp", (Layer("l", 8, 4, 4),), samples=8)
    with pytest.raises(ValueError, match="pipe=2: the pipeline is modelled for par4d's GPT"):
        predict(module, dict(ONE, pipe=2), NODE8)


def test_rows_and_ranking():
    pred = predict(SPEC, dict(x=2, y=1, z=1, data=1, pipe=2), NODE8, microbatches=4)
    row = pred.row()
    assert (row["pipe"], row["microbatches"], row["t_p2p"]) == (2, 4, pred.t_p2p) and row["t_p2p"] > 0
    old_keys = {"x", "y", "z", "data", "fits", "excluded", "t_comm", "t_comm_x", "t_comm_y", "t_comm_z", "t_comm_data",
                "t_compute", "t_exposed", "t_iter", "mem_bytes", "percent_of_peak"}
    assert old_keys | {"pipe", "microbatches", "t_p2p", "checkpointing", "overlap", "t_sync", "collectives"} == set(row)
    plain = predict(SPEC, dict(x=2, y=1, z=1, data=1), NODE8).row()
    assert (plain["pipe"], plain["microbatches"], plain["t_p2p"]) == (1, 1, 0.0)
    # The search stays over x, y, z, data.
    ranked, excluded = rank_configurations(SPEC, 4, NODE8)
    assert ranked and all(set(p.sizes) == set(AXES4) and p.t_p2p == 0.0 for p in ranked + excluded)
