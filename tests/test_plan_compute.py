"""Compute by shape (par4d/plan/compute.py): the GEMM roofline by hand, the shape model's FLOPs are the
workload's, skinny shards and small microbatches lose, the element-wise bytes by hand, and the search
with shape-dependent compute still finds what brute force finds."""

from dataclasses import replace

import pytest

from par4d.plan import GPTSpec, Machine
from par4d.plan.compute import OFFLOAD_LINK_BYTES, OPTIMIZER_BYTES, gemm_seconds, optimizer_seconds, stage_seconds
from par4d.plan.cost import factorizations
from par4d.plan.machines import BUILTIN
from par4d.plan.search import search
from par4d.plan.workload import LOGIT_PASSES, OUTPUT_PASSES, STREAM_PASSES
from tests.helpers import TIGHT, brute_force, check_the_top_and_its_floors

SPEC = GPTSpec("t", n_layer=4, hidden=64, heads=4, seq_len=32, global_batch=16, vocab=256)
SHAPED = Machine("shaped", devices_per_node=4, peak_flops=2.0**40, memory_bytes=1e12, beta_intra=2.0**30,
                 beta_inter=2.0**26, latency=2.0**-16, efficiency=0.5, bytes_per_element=2,
                 memory_bandwidth=2.0**34, kernel_latency=2.0**-20, attention_efficiency=0.25)


def test_gemm_roofline_by_hand():
    peak, bw, b = SHAPED.peak_flops * SHAPED.efficiency, SHAPED.memory_bandwidth, 2
    # Square and large: compute-bound.
    m = n = k = 4096
    assert gemm_seconds(m, n, k, SHAPED) == 2 * m * n * k / peak + SHAPED.kernel_latency
    # One row: its weight through memory dominates.
    m, n, k = 1, 4096, 4096
    assert gemm_seconds(m, n, k, SHAPED) == (m * k + k * n + m * n) * b / bw + SHAPED.kernel_latency


@pytest.mark.parametrize("checkpointing", [False, True])
def test_without_memory_limits_the_shapes_add_up_to_the_workloads_flops(checkpointing):
    """With memory that costs nothing and no kernel latency, the GEMMs' and attention's seconds are the
    workload's matmul and attention FLOPs over peak x efficiency, on every grid and microbatch count:
    every GEMM is counted with its passes (the head's not recomputed)."""
    free = replace(SHAPED, memory_bandwidth=1e300, kernel_latency=0.0, attention_efficiency=None)
    flat = replace(free, memory_bandwidth=None)
    for sizes in factorizations(8, (1, 2)):
        if SPEC.check(sizes):
            continue
        shard = SPEC.samples // (sizes["z"] * sizes["data"])
        for micro in (1, shard):
            assert stage_seconds(SPEC, sizes, free, checkpointing, micro) == pytest.approx(
                stage_seconds(SPEC, sizes, flat, checkpointing), rel=1e-12)


def test_skinny_shards_and_small_microbatches_lose():
    """Per FLOP, x=8's shards run slower than x=1's (more of each GEMM is memory traffic), and a step
    of more microbatches never computes faster than one microbatch."""
    one, eight = dict(x=1, y=1, z=1, data=8), dict(x=8, y=1, z=1, data=1)
    assert stage_seconds(SPEC, eight, SHAPED, False) > stage_seconds(SPEC, one, SHAPED, False)
    for micro in (2, 4, 8, 16):
        assert stage_seconds(SPEC, dict(x=1, y=1, z=1, data=1), SHAPED, False, micro) > \
            stage_seconds(SPEC, dict(x=1, y=1, z=1, data=1), SHAPED, False, 1)


def test_elementwise_bytes_by_hand():
    """Forward, twice that backward (and the forward again under recomputation); where y splits the row each
    block's two norms run unfused: 12 more passes forward (once more recomputed) and 17 backward."""
    sizes = dict(x=2, y=4, z=2, data=1)
    tokens = SPEC.tokens / 2
    d, b = SPEC.hidden, 2
    logits = LOGIT_PASSES * 4 * SPEC.vocab / 2
    for checkpointing, passes in ((False, 3), (True, 4)):
        norms = 2 * (12 * (passes - 2) + 17)
        per_token = SPEC.n_layer * b * d * ((passes * STREAM_PASSES + norms) / 4 + passes * OUTPUT_PASSES / 2)
        assert SPEC.elementwise_bytes(sizes, b, checkpointing) == pytest.approx(tokens * (per_token + logits),
                                                                                rel=1e-12)
    fused = dict(sizes, y=1)                                 # the whole row: the fused kernel
    per_token = SPEC.n_layer * 3 * b * d * (STREAM_PASSES + OUTPUT_PASSES / 2)
    assert SPEC.elementwise_bytes(fused, b, False) == pytest.approx(tokens * (per_token + logits), rel=1e-12)


def test_the_search_with_shapes_finds_what_brute_force_finds():
    """The search's bound on a pipeline's microbatch counts holds when compute depends on the shapes."""
    tight = replace(TIGHT, memory_bandwidth=4e8, kernel_latency=1e-5, attention_efficiency=0.3)
    ranked, _ = search(SPEC, 8, tight)
    assert {p.microbatches for p in ranked} > {1}
    found = {tuple(p.sizes.values()): p.t_iter for p in ranked}
    fastest = brute_force(SPEC, 8, tight)
    assert found == pytest.approx(fastest, rel=1e-12)
    check_the_top_and_its_floors(SPEC, 8, tight, fastest)


def test_the_search_on_shared_cores_finds_what_brute_force_finds():
    """Where ranks share the cores the bubble is absorbed (compute no longer grows as the microbatches shrink):
    the search's bound on a pipeline's counts follows the same rule, so it still skips nothing faster (with the
    host's cost per layer pass too, which grows with the microbatches)."""
    shared = replace(TIGHT, memory_bandwidth=4e8, kernel_latency=1e-5, cores_shared=2.0, comm_cpu_share=0.5,
                     layer_overhead=2e-5)
    ranked, _ = search(SPEC, 8, shared)
    found = {tuple(p.sizes.values()): p.t_iter for p in ranked}
    fastest = brute_force(SPEC, 8, shared)
    assert found == pytest.approx(fastest, rel=1e-12)
    check_the_top_and_its_floors(SPEC, 8, shared, fastest)


def test_builtin_machines_time_gemms_by_shape():
    for machine in BUILTIN.values():
        assert machine.memory_bandwidth and 0.5 < machine.efficiency < 0.9 and machine.attention_efficiency


def test_ranks_sharing_cores_absorb_the_bubble_and_hide_nothing():
    """On a machine whose ranks time-share the cores, a stage idle in the fill and drain gives its share to the
    others (the step takes the longer of the stage's work and the critical path at full speed), the share of
    communication that is CPU work takes the cores the compute needs (it never hides), and every hand-off
    counts."""
    from par4d.overlap import Overlap
    from par4d.plan.cost import predict

    sizes = dict(x=1, y=1, z=2, data=2, pipe=2)
    device = predict(SPEC, sizes, SHAPED, microbatches=2, overlap=Overlap())
    shared = replace(SHAPED, cores_shared=2.0, comm_cpu_share=1.0)
    cpu = predict(SPEC, sizes, shared, microbatches=2, overlap=Overlap())
    t_stage = stage_seconds(SPEC, sizes, SHAPED, False, 2)
    adamw = optimizer_seconds(SPEC, sizes, SHAPED)                                 # once a step, after the flush
    assert device.t_compute == pytest.approx(t_stage * 3 / 2 + adamw, rel=1e-12)
    # The 3 slots of 2 stages x 2 microbatches: one stage, both (twice the cores there are: 2 slots' time), one.
    assert cpu.t_compute == pytest.approx(t_stage * (1 + 2 + 1) / (2 * 2) + adamw, rel=1e-12)
    # s = 1.25: both stages at work need 1.25 times the cores; alone, a stage runs no faster than at full speed.
    lightly = predict(SPEC, sizes, replace(SHAPED, cores_shared=1.25), microbatches=2)
    assert lightly.t_compute == pytest.approx(t_stage * (1 + 1.25 + 1) / (1.25 * 2) + adamw, rel=1e-12)
    assert cpu.t_exposed == pytest.approx(cpu.t_comm, rel=1e-12)            # all of it CPU work: nothing hides
    assert device.t_exposed < device.t_comm
    half = predict(SPEC, sizes, replace(shared, comm_cpu_share=0.5), microbatches=2, overlap=Overlap())
    assert device.t_exposed - device.t_p2p < half.t_exposed - half.t_p2p < cpu.t_exposed - cpu.t_p2p
    # The pipe axis spans both nodes. On a device: fill and drain, 2 (P - 1) = 2 hand-offs over the link (β_inter
    # shared by the 4 rings of a node). Sharing cores: every one, 2 M = 4, at what it costs inside a node (its copies;
    # the wait on the link is absorbed as the bubble is).
    stream = 16 // 4 / 2 * SPEC.seq_len * SPEC.hidden * SHAPED.bytes_per_element
    assert device.t_p2p == pytest.approx(2 * (SHAPED.latency + stream / (SHAPED.beta_inter / 4)), rel=1e-12)
    assert cpu.t_p2p == pytest.approx(4 * (SHAPED.latency + stream / SHAPED.beta_intra), rel=1e-12)


def test_a_pipeline_on_shared_cores_takes_its_schedules_slots():
    """Where ranks share the cores, each of the M + P - 1 slots of the schedule takes max(1, a s / P) of a
    microbatch's stage at full speed, a the stages at work: summed slot by slot, the closed form is the same; on a
    device it is the bubble; it never grows with M (the search stops its counts on it)."""
    from par4d.plan.compute import with_bubble

    for shared in (1.0, 1.25, 2.0, 3.0, 4.0, 8.0):
        machine = replace(SHAPED, cores_shared=shared)
        for pipe in range(1, 13):
            previous = None
            for micro in range(1, 40):
                at_work = [sum(1 for stage in range(pipe) if 0 <= t - stage < micro) for t in range(micro + pipe - 1)]
                slots = sum(max(1.0, a * shared / pipe) for a in at_work)
                t = with_bubble(1.0, micro, pipe, machine)
                assert t == pytest.approx(slots / (shared * micro), rel=1e-12), (shared, pipe, micro)
                assert previous is None or t <= previous * (1 + 1e-12)
                previous = t
    assert with_bubble(1.0, 4, 4, replace(SHAPED, cores_shared=2.0)) == 1.125     # 4 stages, 4 ranks, 2 cores


def test_adamws_pass_is_the_ranks_state_through_memory_once_a_step():
    """AdamW reads and writes 28 bytes per parameter of the rank's stage once a step, at the memory bandwidth; it
    is in every prediction's compute but a profiled one's (the measured step has it). Offloaded, each parameter's
    master and moments also cross the host link, 24 bytes, where the machine gives its bandwidth."""
    from par4d.plan.cost import predict

    sizes = dict(x=2, y=1, z=2, data=1, pipe=2)
    shard = SPEC.params_per_rank(sizes)
    assert shard == pytest.approx(SPEC.params() / 4, rel=0.2) and OPTIMIZER_BYTES == 28
    adamw = optimizer_seconds(SPEC, sizes, SHAPED)
    assert adamw == shard / 2 * 28 / SHAPED.memory_bandwidth
    one, four = (predict(SPEC, sizes, SHAPED, microbatches=m) for m in (1, 4))
    t_stage = stage_seconds(SPEC, sizes, SHAPED, False, 1)
    assert one.t_compute == pytest.approx(t_stage * 2 + adamw, rel=1e-12)                 # not in the bubble
    assert four.t_compute - stage_seconds(SPEC, sizes, SHAPED, False, 4) * 5 / 4 == pytest.approx(adamw, rel=1e-9)
    assert SHAPED.host_bandwidth is None and OFFLOAD_LINK_BYTES == 24
    assert optimizer_seconds(SPEC, sizes, SHAPED, offload_bsize=64) == adamw      # no link given: not timed
    linked = replace(SHAPED, host_bandwidth=SHAPED.memory_bandwidth / 50)
    link = shard / 2 * 24 / linked.host_bandwidth
    assert optimizer_seconds(SPEC, sizes, linked, offload_bsize=64) == pytest.approx(adamw + link, rel=1e-12)
    assert optimizer_seconds(SPEC, sizes, linked) == adamw                       # on the device: no link
    offloaded = predict(SPEC, sizes, linked, microbatches=1, offload_bsize=64)
    assert offloaded.t_compute == pytest.approx(t_stage * 2 + adamw + link, rel=1e-12)
    assert predict(SPEC, sizes, SHAPED, microbatches=1, compute_seconds=0.5).t_compute == 0.5 * 2
    assert optimizer_seconds(SPEC, sizes, replace(SHAPED, memory_bandwidth=None)) == 0.0


def test_the_hosts_cost_per_layer_pass_adds_to_the_compute():
    """``layer_overhead`` per layer pass: 3 passes of each layer per microbatch (4 of a recomputed one, the head
    not recomputed), the stage's 1/P, with or without shapes; 0 leaves the compute as it was."""
    sizes = dict(x=2, y=1, z=1, data=2, pipe=2)
    layers = sum(layer.count for layer in SPEC.layers())
    head = sum(layer.count for layer in SPEC.layers() if layer.name in SPEC.NOT_RECOMPUTED)
    for machine in (SHAPED, replace(SHAPED, memory_bandwidth=None)):
        host = replace(machine, layer_overhead=2.0**-14)
        for checkpointing, micro in ((False, 1), (False, 4), (True, 2)):
            passes = 3 * layers + (layers - head if checkpointing else 0)
            added = stage_seconds(SPEC, sizes, host, checkpointing, micro) - stage_seconds(SPEC, sizes, machine,
                                                                                            checkpointing, micro)
            assert added == pytest.approx(2.0**-14 * passes * micro / 2, rel=1e-9)
    assert head == 1 and layers == 4 * SPEC.n_layer + 1


def test_the_hosts_cost_per_layer_pass_is_what_a_microbatch_adds_beyond_the_gemms():
    """calibrate's measurement runs the bench GPT's step on one rank (a fresh process) with 1 and 4 microbatches;
    the profile's ``layer_overhead`` then makes its model add what a microbatch added there (stretched by the ranks
    sharing the cores), its GEMMs' own cost per microbatch (kernel latency, weights read again) taken out."""
    from par4d.measure.calibrate import layer_overhead
    from par4d.measure.profile import profile_layer_overhead
    from par4d.plan.workload import MEASURED

    row = profile_layer_overhead(threads=1, repeats=3)
    assert row["layer_passes"] == 3 * (4 * 4 + 1) and row["step_seconds"] > 0
    host = dict(row, microbatch_seconds=1.5e-3)          # a measurement's, fixed: what follows is arithmetic
    shared = replace(SHAPED, cores_shared=2.0, memory_bandwidth=2.0**33, kernel_latency=3e-6, bytes_per_element=4)
    profile = replace(shared, layer_overhead=layer_overhead(host, shared))
    spec, alone = MEASURED.with_batch(row["batch"], row["seq_len"]), dict(x=1, y=1, z=1, data=1)
    added = (stage_seconds(spec, alone, profile, False, 4) - stage_seconds(spec, alone, profile, False, 1)) / 3
    assert added == pytest.approx(1.5e-3 * 2.0, rel=1e-9)
    assert 0 < profile.layer_overhead < 1.5e-3 * 2.0 / row["layer_passes"]     # the GEMMs took their share
    assert layer_overhead(dict(host, microbatch_seconds=0.0), shared) == 0.0    # never below nothing
