"""Overlap reorders waits, never arithmetic.

Every combination of the overlap switches (OAR, ORS, OAG, cache, data-parallel sync, xy),
with recomputation on (and off, where the cache, which keeps what recomputation gathers again, is not
among several switches), trains bit for bit as the synchronous path (with the same
row chunks: xy cuts the rows of the x/y all-reduces, which is arithmetic) does:
losses, every gradient after the data-parallel sync, every parameter after 2 AdamW
steps (``torch.equal``, no tolerance; the second steps with the first's moments). All 64
combinations of the dense switches on x=2,z=2 (ep and cp act on mixtures and context axes:
tests/test_moe.py, tests/test_context.py); every pair of switches on z=2,data=2; each switch
alone and all together on x=2,y=2,z=2 and x=2,z=2,data=2 (8 ranks). (Every collective pays
gloo's latency: the suite stays fast by covering pairs, where switches interact, on the rest.)
Each run also proves the switch did something (prefetched gathers, cache hits,
deferred reduce-scatters, buckets launched during backward), and the ledger's bytes
are exact: overlap moves the same bytes; the cache removes exactly the recomputed
gathers.
"""

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import par4d
from par4d.layout import shard_batch, shard_features
from par4d.models import GPT, GPTConfig
from par4d.models.config import recompute_spacing
from par4d.nn import Linear
from par4d.optim.data_parallel import gradient_sync
from par4d.overlap import NAMES, Overlap, set_overlap
from par4d.overlap.policy import XY_CHUNKS
from par4d.train.step import train_step
from tests import cases

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, seed=7)
BATCH, STEPS = 8, 2    # 2 steps: the second uses AdamW's moments of the first (3 cost the suite 18 s more)
DENSE = tuple(n for n in NAMES if n not in ("ep", "cp"))   # mixtures' and the ring's: test_moe, test_context
EVERY_COMBINATION = [names for r in range(len(DENSE) + 1) for names in itertools.combinations(DENSE, r)]
SINGLES = [(), *((name,) for name in NAMES), NAMES]
PAIRS = [names for names in EVERY_COMBINATION if len(names) <= 2] + [NAMES]


def _cache_among_others(combinations: list[tuple[str, ...]]) -> int:
    """The combinations run with recomputation only (the cache with other switches)."""
    return sum(1 for names in combinations if "cache" in names and len(names) > 1)


def _overlap(names: tuple[str, ...]) -> Overlap:
    return Overlap.parse(",".join(names)) if names else Overlap.none()


def _train(grid, names: tuple[str, ...], recompute: int, row_chunks: int | None = None) -> dict:
    overlap = _overlap(names) if row_chunks is None else replace(_overlap(names), row_chunks=row_chunks)
    model = GPT(CONFIG, grid=grid, overlap=overlap, recompute=recompute)
    optimizer = cases.RecordingAdamW(model.parameters(), lr=1e-2, eps=1e-4)
    gen = torch.Generator().manual_seed(0)
    losses = []
    with grid.ledger.capture() as entries:
        for _ in range(STEPS):
            tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
            x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
            losses.append(train_step(model, optimizer, grid, (x, y), grad_clip=0.5))
    runtime = par4d.state(model).runtime
    return {"losses": losses, "grads": optimizer.grads, "params": [p.detach().clone() for p in model.parameters()],
            "gather_bytes": sum(e.bytes for e in entries if e.kind == "all_gather" and e.axes == ("z",)),
            "other_bytes": sum(e.bytes for e in entries if not (e.kind == "all_gather" and e.axes == ("z",))),
            "xy_chunked": sum(1 for e in entries if e.kind == "all_reduce" and e.axes in (("x",), ("y",))),
            "xy_async": sum(1 for e in entries if e.overlapped and e.axes in (("x",), ("y",))),
            "prefetched": runtime.gathers.prefetched, "cache_hits": runtime.gathers.cache_hits,
            "deferred": runtime.deferred.deferred, "early": gradient_sync(model, grid).early_launches}


def _bitwise(sizes: dict, combinations: list[tuple[str, ...]]) -> dict:
    grid = cases.grid(**sizes)
    proven = {"prefetched": 0, "cache_hits": 0, "deferred": 0, "early": 0, "runs": 0}
    no_recompute_gathers = None
    for recompute in (0, recompute_spacing(CONFIG.n_layer)):
        # The synchronous path with the combination's row chunks (xy cuts rows: policy.py, xy).
        chunked = {_overlap(n).row_chunks for n in combinations}
        bases = {chunks: _train(grid, (), recompute, chunks) for chunks in chunked}
        if recompute == 0:
            no_recompute_gathers = bases[1 if 1 in bases else XY_CHUNKS]["gather_bytes"]
        for names in combinations:
            if not recompute and "cache" in names and len(names) > 1:
                continue    # the cache keeps what recomputation gathers again: without it, a no-op (proven alone)
            base = bases[_overlap(names).row_chunks]
            run = _train(grid, names, recompute)
            where = f"{grid.describe()} overlap={','.join(names) or 'none'} recompute={recompute}"
            for key in ("losses", "grads", "params"):
                cases.assert_bitwise(f"{where} {key}", run[key], base[key])
            assert run["other_bytes"] == base["other_bytes"], f"{where}: bytes other than z all-gathers differ"
            assert run["xy_chunked"] == base["xy_chunked"], f"{where}: x/y all-reduces {run['xy_chunked']}"
            if "xy" in names and grid.size("x", "y") > 1:    # xy did something: rows cut, sums issued without a wait
                assert run["xy_async"] > 0 == base["xy_async"], f"{where}: {run['xy_async']} x/y sums overlapped"
                if 1 in bases:
                    assert run["xy_chunked"] > bases[1]["xy_chunked"], f"{where}: rows not cut"
            cached = "cache" in names and recompute
            expected = no_recompute_gathers if cached else base["gather_bytes"]
            assert run["gather_bytes"] == expected, f"{where}: z all-gather bytes {run['gather_bytes']} != {expected}"
            z, partial = grid.size("z") > 1, grid.size("z", "data") > 1
            for switch, counter, applies in (("oag", "prefetched", z), ("cache", "cache_hits", z and recompute),
                                             ("ors", "deferred", z), ("dp", "early", partial)):
                if applies:
                    assert (run[counter] > 0) == (switch in names), f"{where}: {counter}={run[counter]}"
                proven[counter] += run[counter]
            proven["runs"] += 1
    return proven


@pytest.mark.parametrize("sizes, combinations", [(dict(x=2, z=2), EVERY_COMBINATION), (dict(z=2, data=2), PAIRS)],
                         ids=["x2-z2-every", "z2-data2-pairs"])
def test_combinations_are_bitwise_synchronous_4_ranks(pool4, sizes, combinations):
    results = pool4.run(_bitwise, sizes, combinations, timeout=600)
    assert results[0]["runs"] == 2 * len(combinations) - _cache_among_others(combinations)
    assert all(results[0][k] > 0 for k in ("prefetched", "cache_hits", "deferred", "early"))


@pytest.mark.parametrize("sizes", [dict(x=2, y=2, z=2), dict(x=2, z=2, data=2)], ids=["x2-y2-z2", "x2-z2-data2"])
def test_switches_are_bitwise_synchronous_8_ranks(pool8, sizes):
    results = pool8.run(_bitwise, sizes, SINGLES, timeout=600)
    assert results[0]["runs"] == 2 * len(SINGLES) - _cache_among_others(SINGLES)
    assert all(results[0][k] > 0 for k in ("prefetched", "cache_hits", "deferred", "early"))


class _Wandering(nn.Module):
    """Pairs of Linears (normal, then transposed: features over y in and out) whose order of
    use changes from step to step, the same on every rank: the model OAG must not trust."""

    PLANS = ([0, 1, 2], [0, 1, 2], [0, 2], [0, 1, 1, 2], [2, 0])

    def __init__(self, grid, width: int):
        super().__init__()
        self.pairs = nn.ModuleList(
            nn.ModuleList([Linear(width, width, grid=grid, seed=2 * i),
                           Linear(width, width, transposed=True, grid=grid, seed=2 * i + 1)]) for i in range(3))
        self.step = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for index in self.PLANS[self.step % len(self.PLANS)]:
            normal, transposed = self.pairs[index]
            h = transposed(torch.tanh(normal(h)))
        self.step += 1
        return h.square().mean()


def _wandering(sizes: dict, names: tuple[str, ...]) -> dict:
    grid = cases.grid(**sizes)
    width, rows = 8, 4
    results = []
    for overlap in (Overlap.none(), _overlap(names)):
        model = set_overlap(_Wandering(grid, width), overlap)
        optimizer = cases.RecordingAdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in _Wandering.PLANS:
            full = torch.randn(rows * grid.size("z", "data"), width, generator=gen)
            h = shard_features(grid, shard_batch(grid, full), "y").contiguous()
            losses.append(train_step(model, optimizer, grid, h))
        results.append({"losses": losses, "grads": optimizer.grads,
                        "params": [p.detach().clone() for p in model.parameters()],
                        "runtime": par4d.state(model).runtime})
    base, run = results
    for key in ("losses", "grads", "params"):
        cases.assert_bitwise(f"{grid.describe()} wandering {key}", run[key], base[key])
    gathers = run["runtime"].gathers
    return {"order_changes": gathers.order_changes, "prefetched": gathers.prefetched}


@pytest.mark.parametrize("sizes, world", [(dict(x=2, z=2), 4), (dict(x=2, y=2, z=2), 8)], ids=["x2-z2", "x2-y2-z2"])
def test_a_model_that_changes_its_order_trains_bitwise(sizes, world, request):
    pool = request.getfixturevalue(f"pool{world}")
    results = pool.run(_wandering, sizes, ("oar", "ors", "oag", "dp"))
    # Steps 2, 3 and 4 each change the order; a change is counted when the next forward begins.
    assert [r["order_changes"] for r in results] == [2] * world
    assert all(r["prefetched"] > 0 for r in results)   # step 1 repeats step 0's order: prefetched


def test_steps_that_leave_parameters_without_gradients_train_bitwise_on_data(pool2):
    """data=2 (z = 1: gradients go into their buckets as they arrive): steps that leave a pair of Linears unused
    (its bucket's others went in early; it then sums in a new buffer), or use one twice, train as the synchronous
    path does, bit for bit (losses, every step's gradients, parameters)."""
    pool2.run(_wandering, dict(data=2), ("dp",))


def _outside_the_step_and_after_a_failure(sizes: dict) -> dict:
    """ORS and the dp hooks act only inside the training step: ``torch.autograd.grad`` keeps
    autograd's meaning; a backward that raised mid-step leaves nothing behind."""
    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
    x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])

    overlapped, synchronous = GPT(CONFIG, grid=grid), GPT(CONFIG, grid=grid, overlap=Overlap.none())
    weights = [p for n, p in overlapped.named_parameters() if n.endswith("qkv.weight")]
    got = torch.autograd.grad(overlapped(x, y), weights)
    want = torch.autograd.grad(synchronous(x, y), [p for n, p in synchronous.named_parameters()
                                                   if n.endswith("qkv.weight")])
    cases.assert_bitwise("autograd.grad with every overlap on", list(got), list(want))
    assert all(p.grad is None for p in overlapped.parameters())

    def fail(grad):
        raise RuntimeError("injected failure in backward")

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (overlapped, synchronous)]
    hook = overlapped.wte.weight.register_hook(fail)       # runs late in backward: the layers have deferred
    try:
        train_step(overlapped, optimizers[0], grid, (x, y))
        raise AssertionError("the injected failure did not raise")
    except RuntimeError as error:
        assert "injected failure" in str(error)
    hook.remove()
    overlapped.zero_grad(set_to_none=True)
    runs = []
    for model, optimizer in zip((overlapped, synchronous), optimizers):
        losses = [train_step(model, optimizer, grid, (x, y)) for _ in range(2)]
        runs.append({"losses": losses, "params": [p.detach().clone() for p in model.parameters()]})
    for key in ("losses", "params"):
        cases.assert_bitwise(f"after a failed step, {key}", runs[0][key], runs[1][key])
    return {"deferred": par4d.state(overlapped).runtime.deferred.deferred}


def test_overlap_acts_only_inside_the_step_and_survives_a_failed_backward(pool4):
    results = pool4.run(_outside_the_step_and_after_a_failure, dict(z=2, data=2))
    assert all(r["deferred"] > 0 for r in results)


def _frozen_unfrozen_and_replaced(sizes: dict) -> dict:
    """The sync's buckets follow what trains: freezing a parameter, unfreezing it, replacing one by a new
    tensor and replacing a module by a copy each rebuild them (the buckets and their hooks), so every gradient is
    still the mean over data: bit for bit a twin's that was never changed (at a learning rate of 0, so the
    parameters stay the twin's)."""
    import copy

    from par4d.layout import place, placement_of

    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
    x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
    changed, twin = GPT(CONFIG, grid=grid), GPT(CONFIG, grid=grid)
    grads, syncs = {"changed": [], "twin": []}, []

    def step(model: GPT, name: str) -> None:
        optimizer = cases.RecordingAdamW(model.parameters(), lr=0.0)      # steps nothing: keeps the gradients
        train_step(model, optimizer, grid, (x, y))
        named = [n for n, _ in model.named_parameters()]
        grads[name].append({n: g for n, g in zip(named, optimizer.grads[0]) if g is not None})

    def bucketed(sync) -> int:
        return sum(len(b.params) for buckets in sync.groups.values() for b in buckets)

    for change in ("none", "freeze", "unfreeze", "replace", "replace module"):
        if change in ("freeze", "unfreeze"):
            changed.ln_f.weight.requires_grad_(change == "unfreeze")
        elif change == "replace":
            old = changed.ln_f.weight
            changed.ln_f.weight = place(nn.Parameter(old.detach().clone()), placement_of(old))
        elif change == "replace module":            # a new module object with new parameter tensors
            module = copy.copy(changed.ln_f)         # (a deep copy would copy the grid's process groups)
            module._parameters = {k: place(nn.Parameter(v.detach().clone()), placement_of(v))
                                  for k, v in changed.ln_f._parameters.items()}
            changed.ln_f = module
        step(changed, "changed")
        step(twin, "twin")
        syncs.append(gradient_sync(changed, grid))
    frozen = grads["changed"][1]
    assert "ln_f.weight" not in frozen and set(frozen) | {"ln_f.weight"} == set(grads["twin"][1])
    grads["twin"][1].pop("ln_f.weight")
    for i in range(5):
        assert sorted(grads["changed"][i]) == sorted(grads["twin"][i])
        cases.assert_bitwise(f"gradients after change {i}", [grads["changed"][i][n] for n in sorted(grads["twin"][i])],
                             [grads["twin"][i][n] for n in sorted(grads["twin"][i])])
    return {"distinct syncs": len({id(s) for s in syncs}), "bucketed": [bucketed(s) for s in syncs],
            "old hooks": [len(s._hooks) for s in syncs[:-1]]}


def test_the_sync_follows_frozen_unfrozen_and_replaced_parameters(pool2):
    results = pool2.run(_frozen_unfrozen_and_replaced, dict(data=2))
    n = sum(1 for _ in GPT(CONFIG, grid=par4d.Grid.virtual(dict(data=2))).parameters())
    for r in results:
        assert r["distinct syncs"] == 5
        assert r["bucketed"] == [n, n - 1, n, n, n]
        assert r["old hooks"] == [0, 0, 0, 0]   # each replaced sync's hooks removed


def _buffers_kept(sizes: dict, keep: bool) -> dict:
    """Each bucket sums in one buffer from step to step (a new one each step faulted its pages in again), and the
    gradients the sync writes are views of it (no copy out). With ``keep``, the first step's gradients are kept
    past their zeroing: the next step sums in a new buffer and those still hold their values. ``taken``: per step,
    how many gradients of each bucket its hooks copied in as they arrived (_Bucket.take); ``viewed_early``: whether
    the gradients were views of the buffers already when backward ended, the sums in flight (autograd's copies
    freed: one copy of the gradients less at the end of backward)."""
    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(5)
    model = GPT(CONFIG, grid=grid)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buffers, viewed, viewed_early, taken, kept = [], [], [], [], None
    for _ in range(3):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
        x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])

        def look(_stats) -> None:
            nonlocal kept
            sync = gradient_sync(model, grid)
            taken.append([(b.taken, len(b.params)) for buckets in sync.groups.values() for b in buckets])
            early = {g.untyped_storage().data_ptr() for g in (p.grad for p in model.parameters())}
            sync.finish()           # (the step's own finish then has nothing left to do)
            held = [b.buffer for buckets in sync.groups.values() for b in buckets]
            buffers.append([(id(b), b.data_ptr()) for b in held])
            shared = {g.untyped_storage().data_ptr() for g in (p.grad for p in model.parameters())}
            viewed.append(shared == {b.untyped_storage().data_ptr() for b in held})
            viewed_early.append(early == shared)
            if keep and kept is None:
                kept = [(p.grad, p.grad.clone()) for p in model.parameters()]

        train_step(model, optimizer, grid, (x, y), after_backward=look)
    if keep:
        cases.assert_bitwise("gradients kept from the first step", [g for g, _ in kept], [c for _, c in kept])
    return {"buffers": buffers, "viewed": viewed, "viewed_early": viewed_early, "taken": taken}


def _none_taken(taken: list[tuple[int, int]]) -> bool:
    return all(t == 0 for t, _ in taken)


def _all_taken(taken: list[tuple[int, int]]) -> bool:
    return all(t == n for t, n in taken)


def test_the_sync_sums_in_buffers_kept_from_step_to_step(pool2):
    for r in pool2.run(_buffers_kept, dict(data=2), False):
        assert r["viewed"] == [True] * 3          # every gradient a view of a bucket's buffer, every buffer lent
        assert r["viewed_early"] == [True] * 3
        assert r["buffers"][0] and r["buffers"][0] == r["buffers"][1] == r["buffers"][2]
        # The first step cuts the buffers (its gradients copied in at the launch); the later ones copy each
        # gradient in as it arrives, every gradient of every bucket.
        first, *later = r["taken"]
        assert _none_taken(first) and all(_all_taken(step) for step in later), r["taken"]


def test_a_gradient_kept_past_its_step_keeps_its_values(pool2):
    for r in pool2.run(_buffers_kept, dict(data=2), True):
        assert r["viewed"] == [True] * 3
        first, second, third = r["buffers"]
        assert not {p for _, p in first} & {p for _, p in second}, "the kept gradients' buffers summed in again"
        assert second == third                    # the buffers nobody kept: summed in again
        # The second step's buffers are lent to the kept gradients: nothing goes in early; the third's are free.
        assert [_none_taken(r["taken"][1]), _all_taken(r["taken"][2])] == [True, True], r["taken"]


def test_on_a_z_grid_gradients_go_in_at_the_launch_and_the_buffers_are_kept(pool4):
    """z = 2: ORS writes the weights' gradients after backward, so no hook copies a gradient in early (a bucket
    holding one would find its buffer lent to the views made before it); the buffers are still kept."""
    for r in pool4.run(_buffers_kept, dict(z=2, data=2), False):
        assert r["viewed"] == r["viewed_early"] == [True] * 3
        assert r["buffers"][0] and r["buffers"][0] == r["buffers"][1] == r["buffers"][2]
        assert all(_none_taken(step) for step in r["taken"]), r["taken"]


def _zeroed_in_place(sizes: dict) -> dict:
    """A caller's own loop that zeroes the gradients in place (``set_to_none=False``): they stay views of the
    buckets' buffers, autograd accumulates into them, and the sum runs where they lie (the same buffers every
    step, nothing copied in); every step's gradients and the parameters after it bit for bit the loop's that
    sets them to None."""
    grid = cases.grid(**sizes)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen) for _ in range(3)]
    runs = {}
    for to_none in (True, False):
        model = GPT(CONFIG, grid=grid)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads, params, buffers = [], [], []
        for tokens in batches:
            x, y = shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])
            sync = gradient_sync(model, grid)
            with sync.backward():
                model(x, y).backward()
            sync.finish()
            grads.append([p.grad.clone() for p in model.parameters()])
            buffers.append([b.buffer.data_ptr() for buckets in sync.groups.values() for b in buckets])
            optimizer.step()
            optimizer.zero_grad(set_to_none=to_none)
            params.append([p.detach().clone() for p in model.parameters()])
        runs[to_none] = grads, params, buffers
    for k, what in enumerate(("gradients", "parameters")):
        cases.assert_bitwise(f"{what}, zeroed in place", runs[False][k], runs[True][k])
    return {"buffers": runs[False][2], "early": gradient_sync(model, grid).early_launches}


def test_gradients_zeroed_in_place_are_summed_where_they_lie(pool2):
    for r in pool2.run(_zeroed_in_place, dict(data=2)):
        assert r["buffers"][0] and r["buffers"][0] == r["buffers"][1] == r["buffers"][2]
        assert r["early"] > 0       # the overlap's hooks launched buckets during backward
