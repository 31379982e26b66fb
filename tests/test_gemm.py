"""GEMM tuning: same numbers, one choice on every rank, persisted and reused."""

import json

import torch

import par4d
from par4d.layout import shard_activation
from par4d.nn.gemm import FORMS, GemmPlan, apply, environment_key
from par4d.nn.linear import tune
from tests import cases


def test_every_form_computes_the_same_product():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=gen), torch.randn(6, 5, generator=gen).t()   # b: a transposed view
    for form in range(len(FORMS)):
        torch.testing.assert_close(apply(form, a, b), a @ b)


def _tuned_linear(sizes: dict, cache: str) -> dict:
    grid = cases.grid(**sizes)
    layer = par4d.nn.Linear(12, 20, grid=grid, seed=1)
    inp = shard_activation(grid, torch.randn(4, 3, 12, generator=torch.Generator().manual_seed(2)), "y")
    results = []
    for plan in (None, GemmPlan(cache, grid=grid)):
        tune(layer, plan)
        x = inp.clone().requires_grad_()
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
        layer.bias.grad = None
    for plain, tuned in zip(*results):
        torch.testing.assert_close(tuned, plain)
    return plan.choices[environment_key(inp.device, inp.dtype)]


def test_choices_agree_across_ranks_and_persist(pool4, tmp_path):
    cache = tmp_path / "gemm.json"
    choices = pool4.run(_tuned_linear, dict(x=2, y=2), str(cache))
    assert all(c == choices[0] for c in choices)
    assert {key.split(":")[0] for key in choices[0]} == {"forward", "input-grad", "weight-grad"}
    saved = json.loads(cache.read_text())
    assert list(saved.values()) == [choices[0]]
    # A new plan on the same cache (same environment: the ranks ran 1 thread) reuses
    # every choice without timing anything, and times a key it has not seen.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reused = GemmPlan(cache)
        for key in choices[0]:
            name, shape, layout = key.split(":")
            m, k, n = map(int, shape.split("x"))
            a = torch.randn(m, k) if layout[0] == "N" else torch.randn(k, m).t()
            b = torch.randn(k, n) if layout[1] == "N" else torch.randn(n, k).t()
            reused.mm(a, b, name)
        assert reused.timings == {}
        reused.mm(torch.randn(5, 6), torch.randn(6, 7), "other")
        assert list(reused.timings) == ["other:5x6x7:NN"]
    finally:
        torch.set_num_threads(threads)
