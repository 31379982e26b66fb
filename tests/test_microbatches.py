"""Gradient accumulation without a pipeline: ``train_step(..., microbatches=M)`` on pipe = 1.

M forward and backward passes, each microbatch's loss weighted by its share of the rows,
equal one pass over the whole batch to fp32 rounding (loss, every gradient the optimizer
steps with, parameters after AdamW steps); with the overlaps on (ORS deferring every
microbatch's reduce-scatters, OAG prefetching, the cache with recomputation, the overlapped
data-parallel buckets) they equal the synchronous microbatches bit for bit. The ledger
shows the data-parallel sync running once per step while the z all-gathers run per
microbatch.
"""

import pytest
import torch

import par4d
from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig
from par4d.nn import Linear
from par4d.optim.data_parallel import gradient_sync
from par4d.optim.precision import MixedPrecision
from par4d.overlap import Overlap
from par4d.train.step import train_step
from tests import cases

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=7)
BATCH, STEPS = 20, 2      # 10 or 5 rows per data x z shard here: M=4 cuts 3, 3, 2, 2 or 2, 1, 1, 1
OVERLAPPED = {0: "oar,ors,oag,dp,xy,ep,cp", 1: "all"}     # recompute -> the overlaps that run with it
SCALE = 2.0 ** 10   # fp16's loss scale here (its first, 2 ** 16, overflows this model's one-pass gradients)


def _batches(grid, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
              for _ in range(steps)]
    return [(shard_batch(grid, t[:, :-1]), shard_batch(grid, t[:, 1:])) for t in tokens]


def _train(grid, microbatches: int, overlap: str, recompute: int) -> dict:
    model = GPT(CONFIG, grid=grid, overlap=Overlap.parse(overlap), recompute=recompute)
    optimizer = cases.RecordingAdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses, steps = [], []
    for x, y in _batches(grid, STEPS):
        with grid.ledger.capture() as entries:
            losses.append(train_step(model, optimizer, grid, (x, y), grad_clip=0.5, microbatches=microbatches))
        steps.append(entries)
    runtime = par4d.state(model).runtime
    z_layers = sum(isinstance(m, Linear) for m in model.modules()) if grid.size("z") > 1 else 0

    def ledger(kind: str, axis: str) -> tuple[int, int]:
        chosen = [e for entries in steps for e in entries if e.kind == kind and axis in e.axes]
        return len(chosen), sum(e.bytes for e in chosen)

    return {"losses": losses, "grads": optimizer.grads, "params": [p.detach().clone() for p in model.parameters()],
            "data_all_reduces": ledger("all_reduce", "data"), "z_all_gathers": ledger("all_gather", "z"),
            "z_reduce_scatters": ledger("reduce_scatter", "z"), "z_layers": z_layers,
            "prefetched": runtime.gathers.prefetched if runtime else 0,
            "cache_hits": runtime.gathers.cache_hits if runtime else 0,
            "deferred": runtime.deferred.deferred if runtime else 0, "early": gradient_sync(model, grid).early_launches}


def _flat(run: dict) -> list[tuple[str, torch.Tensor]]:
    return ([(f"loss[{s}]", loss) for s, loss in enumerate(run["losses"])]
            + [(f"grad[{s}][{i}]", g) for s, grads in enumerate(run["grads"]) for i, g in enumerate(grads)]
            + [(f"param[{i}]", p) for i, p in enumerate(run["params"])])


def _rounding(ours: dict, base: dict) -> tuple[float, float]:
    """The largest relative difference of a loss, and of any gradient or parameter (relative to
    the largest magnitude in its tensor)."""
    rel = {name: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
           for (name, a), (_, b) in zip(_flat(ours), _flat(base))}
    return (max(v for k, v in rel.items() if k.startswith("loss")),
            max((v for k, v in rel.items() if not k.startswith("loss")), default=0.0))


def _unequal(ours: dict, base: dict) -> list[str]:
    """Which losses, gradients, parameters are not bitwise equal."""
    return [name for (name, a), (_, b) in zip(_flat(ours), _flat(base)) if not torch.equal(a, b)]


def _fp16(grid, microbatches: int) -> dict:
    """One fp16 step (loss-scaled, fp32 masters): the masters' unscaled gradients and the loss."""
    model = GPT(CONFIG, grid=grid, overlap=Overlap.parse(OVERLAPPED[0]))
    precision = MixedPrecision(model, grid, torch.float16,
                               lambda params: cases.RecordingAdamW(params, lr=1e-2, eps=1e-4))
    precision.scale = SCALE
    x, y = _batches(grid, 1)[0]
    loss = train_step(model, precision, grid, (x, y), grad_clip=0.5, microbatches=microbatches)
    return {"losses": [loss.float()], "grads": precision.optimizer.grads, "params": [],
            "stepped": len(precision.optimizer.grads)}   # 0: the step was skipped (an overflow)


def _accumulate(sizes: dict, counts: tuple[int, ...], recompute: bool = False, fp16: bool = False) -> dict:
    """M=1 and each M in ``counts``, synchronous; the largest M overlapped too (and, with
    ``recompute``, synchronous and overlapped with recomputation and the cache); with ``fp16``,
    one fp16 step at M=1 and M=4. Every comparison is made here, after the last collective."""
    grid = cases.grid(**sizes)
    top = max(counts)
    plan = [(m, "none", 0) for m in (1, *counts)] + [(top, OVERLAPPED[0], 0)]
    plan += [(top, "none", 1), (top, OVERLAPPED[1], 1)] if recompute else []
    runs = {key: _train(grid, *key) for key in plan}
    one = runs[(1, "none", 0)]
    out = {"rounding": {(m, r): _rounding(run, one) for (m, o, r), run in runs.items() if o == "none" and m > 1},
           "unequal": {(m, r): _unequal(run, runs[(m, "none", r)]) for (m, o, r), run in runs.items() if o != "none"}}
    if fp16:
        half_one, half_four = _fp16(grid, 1), _fp16(grid, 4)
        out["fp16"] = {"rounding": _rounding(half_four, half_one),
                       "stepped": (half_one["stepped"], half_four["stepped"])}
    for run in runs.values():     # only the counters and the ledger go back to the test
        for key in ("losses", "grads", "params"):
            del run[key]
    return dict(out, runs=runs)


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for (m, recompute), (loss, tensors) in r["rounding"].items():
            assert loss < 1e-6 and tensors < 1e-5, \
                f"rank {rank} M={m} recompute={recompute}: loss {loss:.3g}, tensors {tensors:.3g} from one pass"
        for (m, recompute), names in r["unequal"].items():
            assert not names, f"rank {rank} M={m} recompute={recompute}: overlapped != synchronous in {names[:5]}"
        if "fp16" in r:   # the scaled gradients accumulate in fp16: equal to its rounding, scale and weights once
            loss, grads = r["fp16"]["rounding"]
            assert loss < 3e-3 and grads < 1e-2 and r["fp16"]["stepped"] == (1, 1), r["fp16"]
        for (m, overlap, recompute), run in r["runs"].items():
            if overlap == "none":
                continue
            # ORS deferred every microbatch's reduce-scatters, OAG prefetched, the cache served the
            # recomputation, and the last backward launched data-parallel buckets.
            assert run["deferred"] == STEPS * m * run["z_layers"], (m, recompute, run)
            assert (run["prefetched"] > 0) == (run["z_layers"] > 0) and run["early"] > 0, (m, recompute, run)
            assert (run["cache_hits"] > 0) == (recompute > 0 and run["z_layers"] > 0), (m, recompute, run)


def test_accumulation_equals_one_pass_on_x2_y2_z2(pool8):
    """x=2, y=2, z=2: 20 sequences, 10 per z shard, in 2 and 4 microbatches against 1 (to
    rounding); overlapped, with and without recomputation, against synchronous (bitwise)."""
    results = pool8.run(_accumulate, dict(x=2, y=2, z=2), (2, 4), recompute=True, timeout=300)
    _check(results)
    assert {(m, r) for m, r in results[0]["rounding"]} == {(2, 0), (4, 0), (4, 1)}
    assert set(results[0]["unequal"]) == {(4, 0), (4, 1)}


def test_data_parallel_sync_runs_once_per_step(pool4):
    """z=2, data=2: the data-axis all-reduces of a step are the same with 4 microbatches as
    with 1 (count and bytes: the buckets are summed once, overlapped or not), while the
    weights are gathered over z, and their gradients reduce-scattered, once per microbatch.
    fp16 (loss-scaled) accumulates to the one pass's gradients."""
    results = pool4.run(_accumulate, dict(z=2, data=2), (4,), fp16=True, timeout=300)
    _check(results)
    for r in results:
        runs = r["runs"]
        one, four, overlapped = runs[(1, "none", 0)], runs[(4, "none", 0)], runs[(4, OVERLAPPED[0], 0)]
        assert one["data_all_reduces"][0] > 0
        assert four["data_all_reduces"] == overlapped["data_all_reduces"] == one["data_all_reduces"]
        for key in ("z_all_gathers", "z_reduce_scatters"):
            count, size = one[key]
            assert count > 0 and four[key] == overlapped[key] == (4 * count, 4 * size), key


def test_microbatches_without_a_pipeline_are_checked(tmp_path, capsys):
    from par4d.cli import main
    from par4d.train.config import TrainConfig

    assert TrainConfig(grid={"z": 2, "data": 2}, out=None, batch_size=16, microbatches=4).microbatches == 4
    with pytest.raises(ValueError, match=r"--microbatches 5: a data x z shard has 4 sequences \(batch 16 over "
                                         r"z\*data=4\); give 1 to 4"):
        TrainConfig(grid={"z": 2, "data": 2}, out=None, batch_size=16, microbatches=5)
    with pytest.raises(ValueError, match=r"--microbatches 0: a data x z shard has 8 images"):
        TrainConfig(grid={"x": 2}, out=None, batch_size=8, model="unet", n_layer=2, microbatches=0)
    args = ["train", "--nproc", "4", "--grid", "y=2,data=2", "--batch-size", "8", "--microbatches", "5",
            "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "--microbatches 5: a data x z shard has 4 sequences (batch 8 over z*data=2); give 1 to 4" \
        in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
