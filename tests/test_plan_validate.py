"""Scoring a ranking (Kendall τ-b, top-1 ranks) and the calibration fits."""

import math
from dataclasses import replace

import pytest

from par4d.measure.calibrate import fit
from par4d.measure.grids import BATCH, CONFIG
from par4d.measure.validate import SPEC, _ranks, kendall_tau, score
from par4d.plan.machines import Machine


def test_kendall_tau_b():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1
    # One discordant pair of six: (5 - 1) / 6.
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # Ties in one list: tau-b = (C - D) / sqrt((n0 - n1)(n0 - n2)) = 5 / sqrt(5 * 6).
    assert kendall_tau([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(5 * 6))


def test_ranks_count_from_one():
    assert _ranks([0.3, 0.1, 0.2]) == [3, 1, 2]


def test_score_against_measurements_in_and_out_of_order():
    from par4d.plan.cost import predict

    machine = Machine("m", devices_per_node=4, peak_flops=1e10, memory_bytes=1e10, beta_intra=1e9,
                      beta_inter=1e9, latency=1e-4, bytes_per_element=4)
    grids = [dict(x=1, y=1, z=1, data=4), dict(x=1, y=4, z=1, data=1), dict(x=2, y=1, z=2, data=1),
             dict(x=4, y=1, z=1, data=1)]
    full = [predict(SPEC, g, machine, "full", checkpointing=False).t_iter for g in grids]
    assert len(set(full)) == len(full)
    # Measurements in exactly the full model's order: tau 1, both bests rank 1.
    agreeing = [{"sizes": g, "s_per_iter": t} for g, t in zip(grids, full)]
    best = next(s for s in score(agreeing, machine) if s.model == "full")
    assert (best.kendall_tau, best.measured_rank_of_predicted_best, best.predicted_rank_of_measured_best) == (1, 1, 1)
    # Reversed: tau -1, and each best is last in the other's order.
    reversed_ = [{"sizes": g, "s_per_iter": -t} for g, t in zip(grids, full)]
    worst = next(s for s in score(reversed_, machine) if s.model == "full")
    assert (worst.kendall_tau, worst.measured_rank_of_predicted_best, worst.predicted_rank_of_measured_best) == (
        -1, 4, 4)


def test_choices_beyond_the_grids_are_scored_by_the_full_models_only():
    """plan validate measures pipelines, microbatches and recomputation too: the full model ranks them all, the
    paper's models only the plain grids; predicted memory is set beside the measured."""
    from par4d.measure.grids import choices, grids
    from par4d.measure.validate import choice_prediction, memory_check, plain, report
    from par4d.plan.cost import predict

    four = choices(4)
    assert [c["sizes"] for c in four if plain(c)] == grids(4)
    extra = [c for c in four if not plain(c)]
    assert {(c["sizes"].get("pipe", 1), c["microbatches"], c["recompute"]) for c in extra} == {
        (2, 2, False), (2, 4, False), (4, 4, False), (4, 8, False), (1, 2, False), (1, 1, True)}
    machine = Machine("m", devices_per_node=4, peak_flops=1e10, memory_bytes=1e10, beta_intra=1e9,
                      beta_inter=1e9, latency=1e-4, bytes_per_element=4)
    rows = [dict(c, s_per_iter=predict(SPEC, c["sizes"], machine, "full", c["recompute"],
                                       microbatches=c["microbatches"]).t_iter) for c in four]
    scores = {s.model: s for s in score(rows, machine)}
    assert scores["full"].kendall_tau == 1 and all(v is not None for v in scores["full"].predicted)
    assert [v is None for v in scores["aware"].predicted] == [not plain(c) for c in four]
    for row in rows:
        row["memory"] = {"total": choice_prediction(row, machine, "full", None).mem_bytes * 1.25}
    ratios = memory_check(rows, machine, None)
    assert ratios == pytest.approx([0.8] * len(rows))
    text = report(rows, list(scores.values()), as_json=False, memory=ratios)
    assert "| 1 1 1 2 | 2 | 4 | off |" in text and "Memory: predicted over measured 0.80-0.80" in text


def test_validation_workload_is_the_bench_model():
    assert SPEC.params() == CONFIG.num_params()
    assert SPEC.tokens == BATCH * CONFIG.block_size


def test_calibration_fits_recover_known_parameters():
    """One latency per ring step for every kind (the link's), a bandwidth per kind; and the phantom paper's
    c1 log2 p + c2 m + c3 of a kind measured alone."""
    alpha, beta, beta_rs = 2e-4, 1e9, 4e8
    rows = []
    for p in (2, 4, 8):
        for size in (4096, 1 << 20, 4 << 20):
            rows.append({"kind": "all_reduce", "p": p, "bytes": size,
                         "seconds": alpha * 2 * (p - 1) + size * 2 * (p - 1) / p / beta})
            rows.append({"kind": "reduce_scatter", "p": p, "bytes": size,
                         "seconds": alpha * (p - 1) + size * (p - 1) / p / beta_rs})
    fits = fit(rows)
    assert fits["all_reduce"]["alpha"] == pytest.approx(alpha, rel=1e-6) == fits["reduce_scatter"]["alpha"]
    assert fits["all_reduce"]["beta"] == pytest.approx(beta, rel=1e-6)
    assert fits["reduce_scatter"]["beta"] == pytest.approx(beta_rs, rel=1e-6)
    c1, c2, c3 = 3e-4, 2e-9, 1e-4
    gathers = [{"kind": "all_gather", "p": p, "bytes": size, "seconds": c1 * math.log2(p) + c2 * size + c3}
               for p in (2, 4, 8) for size in (4096, 1 << 20, 4 << 20)]
    assert (fit(gathers)["all_gather"]["c1"], fit(gathers)["all_gather"]["c2"], fit(gathers)["all_gather"]["c3"]
            ) == pytest.approx((c1, c2, c3), rel=1e-6)
    # One group size: log2 p and the constant are the same column, so c1..c3 are not fitted.
    single = fit([r for r in rows if r["p"] == 4])
    assert "c1" not in single["all_reduce"] and single["all_reduce"]["beta"] == pytest.approx(beta, rel=1e-6)
    noisy = [{"kind": "all_reduce", "p": 2, "bytes": b, "seconds": 1e-3 - b * 1e-12} for b in (1e3, 1e6, 4e6)]
    with pytest.raises(ValueError, match="too noisy to fit a bandwidth"):
        fit(noisy)


def test_calibration_fits_nodes_jointly_as_the_planner_prices_them():
    """On an emulated cluster one fit of every group size recovers the latency and bandwidth inside a node and
    across, with the share of a ring's steps that cross nodes the planner uses; latencies never come out
    negative (the inverted 489 us across / 904 us inside of one group size's fit)."""
    from par4d.plan.collectives import ring_time

    machine = Machine("c", devices_per_node=2, peak_flops=1e10, memory_bytes=1e10, beta_intra=2e9, beta_inter=5e8,
                      latency=1e-4, latency_inter=6e-4, bytes_per_element=4)
    from par4d.plan.collectives import latencies

    rows = []
    for p in (2, 4, 8):
        alpha = latencies(dict(x=p, y=1, z=1, data=8 // p), machine)["x"]
        beta = machine.beta_intra if p <= 2 else machine.beta_inter
        for size in (4096, 65536, 1 << 20, 4 << 20):
            rows.append({"kind": "all_reduce", "p": p, "bytes": size, "seconds": ring_time("all_reduce", p, size,
                                                                                           beta, alpha),
                         "cpu_seconds": 0.0})
    fitted = fit(rows, per_node=2)["all_reduce"]
    assert (fitted["alpha"], fitted["alpha_inter"], fitted["beta"], fitted["beta_inter"]) == pytest.approx(
        (1e-4, 6e-4, 2e9, 5e8), rel=1e-6)
    # Groups that span part of a node: 6 ranks on 4-rank nodes cross once in 5 steps, as the planner prices them.
    wide = replace(machine, devices_per_node=4)
    uneven = []
    for p in (2, 4, 6, 12):
        alpha = latencies(dict(x=p, y=1, z=1, data=12 // p), wide)["x"]
        beta = wide.beta_intra if p <= 4 else wide.beta_inter
        uneven += [{"kind": "all_reduce", "p": p, "bytes": size, "seconds": ring_time("all_reduce", p, size, beta,
                                                                                      alpha)}
                   for size in (4096, 65536, 1 << 20, 4 << 20)]
    spanning = fit(uneven, per_node=4)["all_reduce"]
    assert (spanning["alpha"], spanning["alpha_inter"], spanning["beta"], spanning["beta_inter"]) == pytest.approx(
        (1e-4, 6e-4, 2e9, 5e8), rel=1e-6)
    assert fitted["cpu"] == 0 and fitted["median_error"] < 1e-9
    # Times a line through a negative intercept would fit need a negative latency: it is held at 0 instead.
    steep = [{"kind": "all_reduce", "p": 2, "bytes": b, "seconds": b / 1e9 - 3e-6} for b in (4096, 65536, 1 << 20)]
    import numpy as np
    a, t = np.array([[2.0, r["bytes"]] for r in steep]), np.array([r["seconds"] for r in steep])
    assert np.linalg.lstsq(a / t[:, None], np.ones(3), rcond=None)[0][0] < 0      # unconstrained: -1.5 us
    assert fit(steep)["all_reduce"]["alpha"] == 0 and fit(steep)["all_reduce"]["beta"] > 0


def test_repeatability_and_report_of_several_passes():
    from par4d.measure.validate import repeatability, report

    grids = [dict(x=1, y=1, z=1, data=4), dict(x=1, y=4, z=1, data=1), dict(x=4, y=1, z=1, data=1)]
    # Pass 1 and 2 agree, pass 3 swaps the last two: τ 1, 1/3, 1/3 between the three pairs.
    passes = [[0.1, 0.2, 0.3], [0.11, 0.21, 0.31], [0.1, 0.3, 0.2]]
    measured = [{"sizes": g, "s_per_iter": sorted(t)[1], "passes": list(t)} for g, t in zip(grids, zip(*passes))]
    assert repeatability(measured) == pytest.approx((1 + 1 / 3 + 1 / 3) / 3)
    assert repeatability([{**row, "passes": row["passes"][:1]} for row in measured]) is None
    machine = Machine("m", devices_per_node=4, peak_flops=1e10, memory_bytes=1e10, beta_intra=1e9,
                      beta_inter=1e9, latency=1e-4, bytes_per_element=4)
    text = report(measured, score(measured, machine), as_json=False)
    assert "| 1 1 1 4 | 1 | 1 | off | 0.100 | 0.100 0.110 0.100 |" in text and "Pass against pass: mean τ 0.56" in text
    import json
    lines = [json.loads(line) for line in report(measured, score(measured, machine), as_json=True).splitlines()]
    grid_rows, rows = [r for r in lines if "grid" in r], [r for r in lines if "model" in r]
    assert [r["grid"] for r in grid_rows] == grids and set(grid_rows[0]["predicted_s"]) == {"agnostic", "aware", "full"}
    assert [r["model"] for r in rows] == ["agnostic", "aware", "full"]
    assert all(r["passes"] == 3 and r["kendall_tau_between_passes"] == pytest.approx(5 / 9) for r in rows)


def _real_step_collectives(sizes):
    """Every collective a rank issues in one training step of the bench GPT on a real grid."""
    import torch.distributed as dist

    from par4d.measure.grids import WARMUP, step_collectives, training_step
    from tests import cases

    grid = cases.grid(**sizes)
    step = training_step(grid)
    for _ in range(WARMUP):
        step()
    return dist.get_rank(), step_collectives(grid, step)


def test_profiled_compute_runs_rank_0s_real_step(pool4):
    """The fake-backend profile runs the same step as a real job: rank 0 issues the same
    collectives, entry for entry, on grids that communicate over every axis."""
    from par4d.measure.profile import profile_compute

    shapes = [dict(x=2, y=1, z=2, data=1), dict(x=1, y=2, z=1, data=2)]
    profiled = profile_compute(shapes, threads=1, iters=1)
    for sizes, row, axes in zip(shapes, profiled, [{("x",), ("z",)}, {("y",), ("data",)}]):
        real = dict(pool4.run(_real_step_collectives, sizes))
        assert [tuple(e) for e in row["collectives"]] == real[0]
        assert axes <= {entry[1] for entry in real[0]}           # the step communicates over both axes
    with pytest.raises(ValueError, match="one world size"):
        profile_compute([dict(x=2, y=1, z=1, data=1), dict(x=4, y=1, z=1, data=1)], threads=1)


def test_ranks_sharing_cores():
    from par4d.measure.profile import cores_shared

    assert cores_shared(world=8, threads=1, cores=2, cuda=False) == 4      # 8 ranks time-share 2 cores
    assert cores_shared(world=4, threads=1, cores=2, cuda=False) == 2
    assert cores_shared(world=2, threads=1, cores=2, cuda=False) == 1
    assert cores_shared(world=2, threads=4, cores=16, cuda=False) == 1     # cores to spare: no slowdown
    assert cores_shared(world=8, threads=1, cores=2, cuda=True) == 1       # a GPU rank has its own device


def test_full_model_takes_profiled_compute():
    from par4d.plan.cost import predict

    machine = Machine("m", devices_per_node=4, peak_flops=1e10, memory_bytes=1e10, beta_intra=1e9,
                      beta_inter=1e9, latency=1e-4, bytes_per_element=4)
    sizes = dict(x=2, y=1, z=2, data=1)
    analytic = predict(SPEC, sizes, machine, "full", checkpointing=False)
    profiled = predict(SPEC, sizes, machine, "full", checkpointing=False, compute_seconds=0.125)
    assert profiled.t_compute == 0.125 and profiled.t_comm == analytic.t_comm
    assert profiled.t_iter == 0.125 + analytic.t_comm != analytic.t_iter
    measured = [{"sizes": g, "s_per_iter": 1.0 + i, "compute_s": 1.0 + i} for i, g in
                enumerate([dict(x=1, y=1, z=1, data=4), dict(x=1, y=1, z=4, data=1), dict(x=4, y=1, z=1, data=1)])]
    scores = score(measured, machine)
    assert [s.model for s in scores] == ["agnostic", "aware", "full", "full-profiled"]
    comm = [predict(SPEC, row["sizes"], machine, "full", checkpointing=False).t_comm for row in measured]
    assert scores[3].predicted == [row["compute_s"] + t for row, t in zip(measured, comm)]
    with pytest.raises(ValueError, match="compute_seconds is for the 'full' model"):
        predict(SPEC, sizes, machine, "aware", compute_seconds=0.1)
    assert "full-profiled" not in [s.model for s in score([{k: v for k, v in row.items() if k != "compute_s"}
                                                            for row in measured], machine)]


SYNC_CHOICES = [
    dict(sizes=dict(x=1, y=1, z=1, data=2, pipe=2), microbatches=2, recompute=False),
    dict(sizes=dict(x=1, y=1, z=1, data=1, pipe=4), microbatches=8, recompute=False),
    dict(sizes=dict(x=1, y=1, z=1, data=4, pipe=1), microbatches=1, recompute=False),
    dict(sizes=dict(x=1, y=1, z=4, data=1, pipe=1), microbatches=2, recompute=False),
    dict(sizes=dict(x=1, y=1, z=2, data=2, pipe=1), microbatches=1, recompute=True),
    dict(sizes=dict(x=2, y=1, z=2, data=1, pipe=1), microbatches=1, recompute=False),
    dict(sizes=dict(x=1, y=2, z=1, data=2, pipe=1), microbatches=1, recompute=False),
    dict(sizes=dict(x=2, y=2, z=1, data=1, pipe=1), microbatches=1, recompute=True),
]


def test_the_model_counts_every_collective_a_step_issues():
    """The full model's count of collectives per step is rank 0's ledger, exactly: the layers' (the x/y ones in
    two row chunks under xy), the norms' and the loss's, the embeddings' over z, the sync's buckets, the
    recomputed gathers, and a pipeline's hand-offs and loss sum (a pipeline's stage is the model's average
    one: exact for rank 0 where the layers the stages hold differently, the head's and the loss's, do not
    communicate). Each costs the machine's ``sync_cost``."""
    from par4d.measure.profile import profile_compute
    from par4d.measure.validate import choice_prediction
    from par4d.overlap import Overlap

    shared = Machine("shared", devices_per_node=4, peak_flops=1e10, memory_bytes=1e10, beta_intra=1e9,
                     beta_inter=1e9, latency=1e-4, bytes_per_element=4, cores_shared=2.0)   # every hand-off counts
    profiled = profile_compute(SYNC_CHOICES, threads=1, iters=1)
    for choice, row in zip(SYNC_CHOICES, profiled):
        counted = choice_prediction(choice, shared, "full", Overlap())
        assert counted.collectives == len(row["collectives"]), (choice, row["collectives"])
        assert counted.t_sync == 0.0
        costly = choice_prediction(choice, replace(shared, sync_cost=1e-3), "full", Overlap())
        assert costly.t_sync == pytest.approx(1e-3 * len(row["collectives"]), rel=1e-12)
        assert costly.t_iter == pytest.approx(counted.t_iter + costly.t_sync, rel=1e-12)
    with pytest.raises(ValueError, match="sync_cost"):
        replace(shared, sync_cost=-1e-3)


def _sync_on_every_rank():
    import par4d
    from par4d.measure.calibrate import _sync_row

    grid = par4d.init(x=4, hierarchical="off")
    try:
        return _sync_row(grid)
    finally:
        grid.close()


def test_calibration_measures_what_a_collective_between_compute_costs(pool4):
    """A round of compute and a collective, timed on all 4 ranks (the mean over them), takes at least as long as
    either alone; the sync cost is the median excess over the two apart (an odd count of repeats: the middle
    one), never below 0."""
    from par4d.measure.calibrate import sync_excess

    row = pool4.run(_sync_on_every_rank)[0]
    assert (row["kind"], row["p"]) == ("sync", 4)
    assert row["both_seconds"] >= max(row["compute_seconds"], row["collective_seconds"]) > 0
    assert sync_excess([[3.0, 1.0, 4.5], [3.0, 1.0, 4.1], [2.0, 1.0, 3.0], [3.0, 2.0, 6.0], [3.0, 1.0, 4.2]]) \
        == pytest.approx(0.2)                 # excesses 0.5, 0.1, 0.0, 1.0, 0.2
    assert sync_excess([[3.0, 1.0, 3.5], [3.0, 1.0, 3.9], [3.0, 1.0, 4.0]]) == 0.0       # -0.5, -0.1, 0.0
