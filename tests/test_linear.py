"""par4d.nn.Linear (Algorithm 1) against torch.nn.Linear on real grids."""

import pytest
import torch

import par4d
from par4d.layout import shard_activation
from par4d.optim.data_parallel import sync_gradients
from tests import cases
from tests.helpers import grid_id

GRIDS_4 = cases.factorizations(4)
GRIDS_8 = [dict(x=2, y=2, z=2, data=1), dict(x=2, y=2, z=1, data=2), dict(x=2, y=1, z=2, data=2),
           dict(x=1, y=2, z=2, data=2)]
# Not powers of two: 12 in, 20 out, 3 tokens; batch 4 splits over data * z <= 4.
BATCH, SEQ, K, N = 4, 3, 12, 20


def _compare_linear(sizes: dict) -> int:
    grid = cases.grid(**sizes)
    checked = 0
    for transposed in (False, True):
        for bias in (True, False):
            tag = f"{sizes} transposed={transposed} bias={bias}"

            def where(message, tag=tag):
                return f"{tag}: {message}"
            layer = par4d.nn.Linear(K, N, bias, transposed, grid=grid, seed=7)
            ref = torch.nn.Linear(K, N, bias)
            with torch.no_grad():
                ref.weight.copy_(layer.full_weight())
                if bias:
                    ref.bias.copy_(layer.full_bias())
            gen = torch.Generator().manual_seed(11)
            inp = torch.randn(BATCH, SEQ, K, generator=gen)
            target = torch.randn(BATCH, SEQ, N, generator=gen)

            ref_in = inp.clone().requires_grad_()
            ref_out = ref(ref_in)
            (ref_out * target).sum().div(BATCH).backward()

            local_in = shard_activation(grid, inp, layer.in_axis).clone().requires_grad_()
            out = layer(local_in)
            local_target = shard_activation(grid, target, layer.out_axis)
            (out * local_target).sum().div(local_in.shape[0]).backward()
            sync_gradients(layer, grid)

            torch.testing.assert_close(out, shard_activation(grid, ref_out.detach(), layer.out_axis), msg=where)
            # The local loss is the mean over this rank's samples: its input gradient is
            # G_data * G_z times that of the global mean.
            shards = grid.size("data", "z")
            torch.testing.assert_close(local_in.grad / shards, shard_activation(grid, ref_in.grad, layer.in_axis),
                                       msg=where)
            torch.testing.assert_close(layer.full_weight(grad=True), ref.weight.grad, msg=where)
            if bias:
                torch.testing.assert_close(layer.full_bias(grad=True), ref.bias.grad, msg=where)
            checked += 1
    return checked


@pytest.mark.parametrize("sizes", GRIDS_4, ids=grid_id)
def test_linear_matches_torch_4_ranks(pool4, sizes):
    assert pool4.run(_compare_linear, sizes) == [4] * 4


@pytest.mark.parametrize("sizes", GRIDS_8, ids=grid_id)
def test_linear_matches_torch_8_ranks(pool8, sizes):
    assert pool8.run(_compare_linear, sizes) == [4] * 8


def _init_is_grid_independent(sizes: dict) -> list:
    grid = cases.grid(**sizes)
    layer = par4d.nn.Linear(K, N, True, sizes.get("x", 1) > 1, grid=grid, seed=5)
    return [layer.full_weight().tolist(), layer.full_bias().tolist()]


def test_init_is_a_function_of_the_seed(pool4):
    gen = torch.Generator().manual_seed(5)
    bound = K ** -0.5
    weight = torch.empty(N, K).uniform_(-bound, bound, generator=gen)
    bias = torch.empty(N).uniform_(-bound, bound, generator=gen)
    for sizes in GRIDS_4:
        for rank, (w, b) in enumerate(pool4.run(_init_is_grid_independent, sizes)):
            assert torch.equal(torch.tensor(w), weight), (sizes, rank)
            assert torch.equal(torch.tensor(b), bias), (sizes, rank)


def _graph(out: torch.Tensor) -> list[str]:
    """The names of the autograd nodes ``out`` was made by, depth first."""
    names, stack = [], [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(node.name())
            stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _whole_on_a_grid_that_splits_nothing(sizes: dict) -> dict[str, bool]:
    """Layers between layers nobody parallelized (whole features in and out: a Linear, a Conv2d) where their axes
    are all 1: torch's layer, the same autograd graph as ``torch.nn``'s (no cut, no gather node) and the same bits,
    from an input that is not contiguous too; where an axis splits them (not ``plain``), the cut and gather run."""
    grid = cases.grid(**sizes)
    whole = dict(input_layout="whole", output_layout="whole")
    layers = [(par4d.nn.Linear(K, N, grid=grid, seed=3, **whole), torch.nn.Linear(K, N), (SEQ, BATCH, K)),
              (par4d.nn.Conv2d(K, N, 3, padding=1, grid=grid, seed=3, **whole), torch.nn.Conv2d(K, N, 3, padding=1),
               (K, BATCH, 5, 6))]
    if grid.size("x", "y", "z") > 1:
        return {f"{type(layer).__name__} not plain": not layer.plain for layer, _, _ in layers}
    checks = {}
    for layer, ref, shape in layers:
        with torch.no_grad():
            ref.weight.copy_(layer.weight)
            ref.bias.copy_(layer.bias)
        gen = torch.Generator().manual_seed(11)
        inp = torch.randn(shape, generator=gen).transpose(0, 1)    # not contiguous: cut to a contiguous copy
        outs, grads = [], []
        for module in (layer, ref):
            leaf = inp.detach().requires_grad_()
            out = module(leaf if module is layer else leaf.contiguous())
            out.square().sum().backward()
            outs.append(out)
            grads.append([leaf.grad, module.weight.grad, module.bias.grad])
        kind = type(layer).__name__
        checks.update({f"{kind} plain": layer.plain, f"{kind} graph": _graph(outs[0]) == _graph(outs[1]),
                       f"{kind} output": torch.equal(*outs),
                       f"{kind} gradients": all(torch.equal(a, b) for a, b in zip(*grads))})
    return checks


@pytest.mark.parametrize("sizes", [dict(data=4), dict(x=2, z=2)], ids=["data4", "x2-z2"])
def test_whole_layouts_on_a_grid_that_splits_nothing_are_torchs_layer(pool4, sizes):
    for checks in pool4.run(_whole_on_a_grid_that_splits_nothing, sizes):
        assert len(checks) == (8 if "data" in sizes else 2) and all(checks.values()), \
            [name for name, held in checks.items() if not held]
