"""Float8 training of par4d's Linear layers (par4d.nn.float8): each local GEMM as torchao's recipe casts it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import par4d
from par4d.layout import shard_activation, shard_batch
from par4d.nn.float8 import RECIPES, Float8Gemm, float8
from tests import cases
from tests.helpers import SMALL, train_pooled


def _against_torchao() -> list[float]:
    """On data=2 every rank's Linear multiplies its own rows by the whole weight: torchao's Float8Linear on the
    same rows and weight is the reference for its forward, its input gradient and its (local) weight gradient,
    by every recipe; the gap to the fp32 product (float8 is what ran)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    grid = cases.grid(data=2)
    gen = torch.Generator().manual_seed(2)
    rows = shard_activation(grid, torch.randn(4, 8, 32, generator=gen), "y")
    grad_out = torch.randn(rows.shape[0], 8, 48, generator=gen)
    gaps = []
    for recipe in RECIPES:
        layer = float8(par4d.nn.Linear(32, 48, bias=False, grid=grid, seed=1), recipe)
        mine = rows.clone().requires_grad_()
        out = layer(mine)
        out.backward(grad_out)
        reference = Float8Linear.from_float(torch.nn.Linear(32, 48, bias=False),
                                            config=Float8LinearConfig.from_recipe_name(recipe))
        with torch.no_grad():
            reference.weight.copy_(layer.weight)
        theirs = rows.clone().requires_grad_()
        expected = reference(theirs)
        expected.backward(grad_out)
        for got, want in ((out, expected), (mine.grad, theirs.grad), (layer.weight.grad, reference.weight.grad)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        gaps.append(float((out - rows @ layer.weight.detach().t()).abs().max()))
    return gaps


def test_each_local_gemm_is_torchaos_recipe(pool2):
    assert all(gap > 0 for gaps in pool2.run(_against_torchao) for gap in gaps)


class _Float8Products(TorchDispatchMode):
    """Counts the GEMMs whose operands are torchao's float8 tensors."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        if func is torch.ops.aten.mm.default and any(isinstance(a, Float8TrainingTensor) for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _trained(sizes: dict, recipe: str | None, overlap: bool = True, steps: int = 2) -> tuple:
    """par4d's GPT on ``sizes`` for ``steps`` AdamW steps, its Linears in float8 by ``recipe`` (None: fp32), every
    overlap on or none: the mean losses, the float8 GEMMs counted on this rank, the layers converted, the
    parameters after the steps (flat)."""
    from par4d.nn.float8 import float8_layers
    from par4d.optim.data_parallel import global_mean
    from par4d.overlap import Overlap
    from par4d.train.recipes.gpt import build_gpt

    grid = cases.grid(**sizes)
    model = build_gpt(cases.GPT_CONFIG, grid, overlap=None if overlap else Overlap.none())
    if recipe is not None:
        float8(model, recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, cases.GPT_CONFIG.vocab_size, (8, cases.GPT_CONFIG.block_size + 1),
                           generator=torch.Generator().manual_seed(4))
    batch = (shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:]))
    losses, products = [], _Float8Products()
    with products:
        for _ in range(steps):
            losses.append(global_mean(par4d.train_step(model, optimizer, grid, batch), grid).item())
    return losses, products.count, float8_layers(model), torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_3d_grids_gpt_trains_in_float8(pool4):
    """On x=2,z=2 every Linear of the blocks runs its GEMMs in float8 (the head stays fp32), and the losses follow
    fp32's: within 2% over 2 steps (measured: 0.06%; float8's rounding makes the gap, on any CPU), and not equal
    to them. Tensorwise scales span a GEMM's rows, so the xy overlap's row chunks are not used in its layers:
    a block's 4 Linears make 4 GEMMs forward, 4 for the input gradients, 4 for the weights' a step."""
    float8_run = pool4.run(_trained, dict(x=2, z=2), "tensorwise")
    fp32_run = pool4.run(_trained, dict(x=2, z=2), None)
    layers = 4 * cases.GPT_CONFIG.n_layer          # qkv, proj, fc, proj of each block
    for (losses, products, converted, _), (reference, none, _, _) in zip(float8_run, fp32_run):
        assert products == 3 * layers * 2 and none == 0
        assert len(converted) == layers and not any(path.endswith("head") for path in converted)
        assert losses != reference
        for got, want in zip(losses, reference):
            assert abs(got - want) < 0.02 * want, (losses, reference)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_overlapped_float8_is_the_synchronous_bit_for_bit(pool4, recipe):
    """Every overlap on (the xy overlap's row chunks in rowwise layers: a row's scale is its own) against none."""
    overlapped = pool4.run(_trained, dict(x=2, z=2), recipe, True)
    synchronous = pool4.run(_trained, dict(x=2, z=2), recipe, False)
    for (losses, _, _, params), (reference, _, _, expected) in zip(overlapped, synchronous):
        assert losses == reference and torch.equal(params, expected)


def test_train_float8_says_what_it_converted_and_resumes_without_it(pool2, tmp_path, capsys):
    """`par4d train --float8`: the summary names the recipe and the layers (the head kept); the run's config
    records it, and a resume may turn it off (it changes no parameter, only the local GEMMs)."""
    run = tmp_path / "run"
    summary = train_pooled(pool2, *SMALL, "--grid", "data=2", "--steps", "2", "--float8", "rowwise",
                           "--out", str(run))
    assert summary["float8"] == {"recipe": "rowwise", "layers": 4, "whole_gemms": False}
    assert "float8         rowwise (torchao): the local GEMMs of 4 Linear layers" in capsys.readouterr().out
    assert 'float8 = "rowwise"' in (run / "config.toml").read_text()
    resumed = train_pooled(pool2, "--resume", str(run), "--steps", "3", "--float8", "none")
    assert "float8" not in resumed and resumed["start_step"] == 2
    assert resumed["matmul_peak_flops_per_s"] == 1e11          # SMALL's --peak-flops, kept on as many ranks


def test_float8_without_torchao_is_refused_before_any_rank_starts(monkeypatch):
    import importlib.util

    from par4d.parallel import check_float8

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"--float8 tensorwise: float8 training needs torchao \(pip install"):
        check_float8("tensorwise")


def test_an_unknown_recipe_names_the_recipes():
    with pytest.raises(ValueError, match="float8 recipe 'fp4': give one of tensorwise, rowwise, rowwise_with_gw_hp"):
        Float8Gemm("fp4")


def test_transformers_model_classes_load_without_torchao_noise():
    """transformers imports torchao with its model classes (where it is installed), which warns of its CUDA kernels'
    libraries not loading on a CPU and of torch's deprecated enum registration: par4d imports them quietly (a
    fresh process: the warnings come once, at the first import)."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    script = ("import sys; from par4d.train.recipes.hf import LlamaRecipe; LlamaRecipe.lm_class(None); "
              "assert 'torchao' in sys.modules")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
