"""ResNet-18 (tests/resnet.py, torchvision's architecture) made parallel by ``par4d.parallelize``
against the unparallelized model, and par4d's synchronised BatchNorm against torch's: with
the batch split over z and data, batch norms' statistics must still be the whole batch's.

The ResNet is compared in float64 with par4d's usual criteria (loss, gradients, parameters
after 3 AdamW steps, running statistics, an evaluation forward): in fp32 its 20 batch norms
over few values amplify round-off far past them for any implementation, torch's included, and
by how much depends on the CPU's kernels. fp32 is held to bounds that hold on every CPU: the
ResNet's forward against the float64 truth, and par4d's BatchNorm alone against float64."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import par4d
from par4d import comm
from par4d.layout import batch_slice, shard_batch
from par4d.nn import BatchNorm, full_state_dict
from par4d.optim.data_parallel import global_mean, sync_gradients
from par4d.train.step import train_step
from tests import cases
from tests.resnet import ResNet18

STEPS = 3
GRADS, PARAMS, BUFFERS, OUTPUTS = (1e-5, 1e-6), (1e-5, 1e-5), (1e-5, 1e-6), (1e-5, 1e-5)   # (rtol, atol)


def _worst(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> float:
    """The largest |a - b| / (atol + rtol |b|): at most 1 where torch.allclose holds."""
    rtol, atol = tol
    return ((a.double() - b.double()).abs() / (atol + rtol * b.double().abs())).max().item()


def _unequal(a: torch.Tensor, b: torch.Tensor) -> float:
    """0 where equal, infinity (a failure by :func:`_worst`'s measure) where not: counters."""
    return 0.0 if torch.equal(a, b) else float("inf")


def _matches(sizes: dict, force: dict | None) -> dict:
    """3 AdamW steps of a width-8 ResNet-18 on 8 images of 32x32 in float64, parallel and not: the
    worst ratio (see :func:`_worst`) of the loss, gradients, parameters, running statistics and an
    evaluation-mode forward, each with where it is."""
    with cases.float64():
        return _train(cases.grid(**sizes), force)


def _train(grid, force: dict | None) -> dict:
    torch.manual_seed(0)
    twin = ResNet18(num_classes=8, width=8)
    model = par4d.parallelize(copy.deepcopy(twin), grid, force=force)
    # eps 1e-4: AdamW would turn round-off in near-zero gradients into a whole step's difference
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (model, twin)]
    gen = torch.Generator().manual_seed(1)
    worst = {key: (0.0, "") for key in ("loss", "grads", "params", "buffers", "eval")}

    def note(key: str, mine, ref, where: str, tol: tuple[float, float] | None = None) -> None:
        if tol is None:                        # losses
            value = abs(mine - ref) / abs(ref)
        else:
            value = _worst(mine, ref, tol) if ref.is_floating_point() else _unequal(mine, ref)
        worst[key] = max(worst[key], (value, where))

    for step in range(STEPS):
        x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 8, (8,), generator=gen)
        local = F.cross_entropy(model(shard_batch(grid, x)), shard_batch(grid, y))   # this rank's mean
        local.backward()
        sync_gradients(model, grid)
        loss = F.cross_entropy(twin(x), y)
        loss.backward()
        note("loss", global_mean(local, grid).item(), loss.item(), f"step {step}")
        grads = full_state_dict(model, grad=True)
        for n, p in twin.named_parameters():
            note("grads", grads[n], p.grad, f"step {step} {n}", GRADS)
        for opt in optimizers:
            opt.step(), opt.zero_grad()
    after, buffers = full_state_dict(model), dict(model.named_buffers())
    for n, p in twin.named_parameters():
        note("params", after[n], p, n, PARAMS)
    for n, b in twin.named_buffers():
        note("buffers", buffers[n], b, n, BUFFERS)
    x = torch.randn(8, 3, 32, 32, generator=gen)
    with torch.no_grad():
        note("eval", model.eval()(shard_batch(grid, x)), shard_batch(grid, twin.eval()(x)), "logits", OUTPUTS)
    return {"worst": worst, "names": sorted(model.state_dict()) == sorted(twin.state_dict()),
            "plan": [(t.name, t.kind) for t in par4d.state(model).plan],
            "synchronised": sorted(n for n, m in model.named_modules() if isinstance(m, BatchNorm))}


def _check(results: list[dict]) -> dict:
    """float64: par4d within the criteria of torch.testing's (loss relative 1e-5)."""
    for r in results:
        worst = r["worst"]
        assert r["names"], r
        assert worst["loss"][0] < 1e-5 and all(worst[k][0] <= 1 for k in ("grads", "params", "buffers", "eval")), r
    return results[0]


def _summary(result: dict) -> str:
    """The worst ratios and where (pytest -s shows them)."""
    return ", ".join(f"{k} {v[0]:.3g} ({v[1]})" for k, v in result["worst"].items())


# the stem's 3 input channels: y=2 cannot split them, so it stays whole there
GRIDS = [(dict(x=2, z=2), None), (dict(x=2, y=2), {"conv1": "replicated"}),
         (dict(y=2, data=2), {"conv1": "replicated"})]


@pytest.mark.parametrize("sizes,force", GRIDS, ids=["x2z2", "x2y2", "y2d2"])
def test_resnet18_4_ranks(pool4, sizes, force):
    result = _check(pool4.run(_matches, sizes, force))
    plan = dict(result["plan"])
    assert plan["layer2.0.downsample.0"] == "normal" and plan["fc"] == "normal" and plan["layer4.1.bn2"] == "replicated"
    assert len(result["synchronised"]) == (20 if sizes.get("z", 1) * sizes.get("data", 1) > 1 else 0)
    print(f"\n{sizes}: {_summary(result)}")


def test_resnet18_8_ranks(pool8):
    result = _check(pool8.run(_matches, dict(x=2, y=2, z=2), {"conv1": "replicated"}))
    assert len(result["synchronised"]) == 20
    print(f"\nx2y2z2: {_summary(result)}")


def _forward32(sizes: dict, force: dict | None) -> dict:
    """One training-mode forward of the fp32 ResNet (its batch norms on the batch's statistics, synchronised
    where z * data splits it) against the float64 truth: the loss, this rank's logits and every running
    statistic, each as its largest error over the largest magnitude of its truth."""
    grid = cases.grid(**sizes)
    torch.manual_seed(0)
    twin = ResNet18(num_classes=8, width=8)
    model = par4d.parallelize(copy.deepcopy(twin), grid, force=force)
    truth = twin.double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 8, (8,), generator=gen)
    logits = model(shard_batch(grid, x))
    loss = global_mean(F.cross_entropy(logits, shard_batch(grid, y)), grid).item()
    with torch.no_grad():
        ref_logits = truth(x.double())
    ref_loss = F.cross_entropy(ref_logits, y).item()

    def error(mine: torch.Tensor, ref: torch.Tensor) -> float:
        return ((mine.double() - ref).abs().max() / ref.abs().max()).item()

    buffers = dict(model.named_buffers())
    errors = {n: error(buffers[n], b) for n, b in truth.named_buffers() if b.is_floating_point()}
    errors["logits"] = error(logits.detach(), shard_batch(grid, ref_logits))
    errors["loss"] = abs(loss - ref_loss) / ref_loss
    return errors


@pytest.mark.parametrize("sizes,force", GRIDS, ids=["x2z2", "x2y2", "y2d2"])
def test_resnet18_fp32_forward_is_float64s_to_fp32_rounding(pool4, sizes, force):
    """fp32 is held to what holds on every CPU: the forward (a continuous function of the weights) against
    the float64 truth. Its gradients are not: a ReLU or max-pool whose input rounds to the other side
    switches the path a gradient takes (torch's own fp32 one-step gradient is 4e-3 off its float64 one
    overall with ATen's baseline kernels, 6e-6 with AVX-512's), and AdamW steps and batch norms over few
    values amplify what differs; so exactness of gradients and steps is proven in float64 above.
    A batch norm that used its rank's own samples instead of the batch's is off by 0.8 in the logits."""
    for errors in pool4.run(_forward32, sizes, force):
        worst = max(errors, key=errors.get)
        assert errors["loss"] <= 1e-5 and errors[worst] <= 1e-4, (worst, errors[worst], errors["loss"])
    print(f"\n{sizes}: worst {errors[worst]:.3g} ({worst}), loss {errors['loss']:.3g}")


def _through_train_step(sizes: dict) -> dict:
    """3 steps of par4d's train_step, its data-parallel buckets (10 KB) all-reduced during backward
    between the batch norms' own all-reduces over the same axes, against 3 plain steps (float64)."""
    with cases.float64():
        return _compare_through_train_step(cases.grid(**sizes))


def _compare_through_train_step(grid) -> dict:
    torch.manual_seed(0)
    twin = ResNet18(num_classes=8, width=8)
    model = par4d.parallelize(copy.deepcopy(twin), grid)
    # the buckets only: set_overlap would also give fc an overlap runtime, which parallelize's layers lack
    par4d.state(model).overlap = par4d.Overlap(bucket_mb=0.01)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    gen = torch.Generator().manual_seed(1)
    worst = {"loss": 0.0}
    for _ in range(STEPS):
        x, y = torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 8, (8,), generator=gen)
        ref = F.cross_entropy(twin(x), y)
        ref.backward()
        opt_twin.step(), opt_twin.zero_grad()
        local = train_step(model, opt, grid, (shard_batch(grid, x), shard_batch(grid, y)),
                           loss=lambda a, b: F.cross_entropy(model(a), b))
        worst["loss"] = max(worst["loss"], abs(global_mean(local, grid).item() - ref.item()) / ref.item())
    after, buffers = full_state_dict(model), dict(model.named_buffers())
    worst["params"] = max(_worst(after[n], p, PARAMS) for n, p in twin.named_parameters())
    worst["buffers"] = max(_worst(buffers[n], b, BUFFERS) if b.is_floating_point() else _unequal(buffers[n], b)
                           for n, b in twin.named_buffers())
    worst["early"] = par4d.state(model).sync.early_launches     # buckets all-reduced during backward
    return worst


def test_resnet18_through_train_step(pool4):
    for worst in pool4.run(_through_train_step, dict(x=2, z=2)):
        early = worst.pop("early")
        assert early >= STEPS and worst["loss"] < 1e-5 and worst["params"] <= 1 and worst["buffers"] <= 1, worst


def test_resnet18_plan_counts_batch_norms():
    """With an example batch the plan counts each synchronised batch norm's two all-reduces (the
    shapes-only pass runs through par4d's BatchNorm on the meta device)."""
    grid = par4d.Grid.virtual({"x": 2, "y": 1, "z": 2, "data": 2})
    model = par4d.parallelize(ResNet18(num_classes=8, width=8), grid, example=(torch.randn(8, 3, 32, 32),))
    rows = {t.name: t for t in par4d.state(model).plan}
    assert rows["layer3.0.bn1"].messages == (("all_reduce", ("z", "data"), 4 * 3 * 32), ("all_reduce", ("z", "data"),
                                                                                           2 * 32))


# -- par4d.nn.BatchNorm alone -------------------------------------------------------

# name: (torch's module, global input shape, the channels' mean). par4d's BatchNorm runs in fp32, its
# twin in float64 on the same values: the truth. A mean of 1e4 and a spread of 2: fp32 inputs carry ~1e-3
# of rounding into x - mean in any implementation, so there only the statistics are compared, which
# E[x^2] - E[x]^2 would get wrong by ~1e-2. (8, 6, 1, 1): two values per channel on each rank.
CASES = {
    "2d": (lambda: nn.BatchNorm2d(6), (8, 6, 5, 5), 0.0),
    "2d_large_mean": (lambda: nn.BatchNorm2d(6), (8, 6, 5, 5), 1e4),
    "2d_two_per_rank": (lambda: nn.BatchNorm2d(6), (8, 6, 1, 1), 0.0),
    "2d_cumulative": (lambda: nn.BatchNorm2d(6, momentum=None), (8, 6, 5, 5), 0.0),
    "2d_untracked": (lambda: nn.BatchNorm2d(6, track_running_stats=False), (8, 6, 5, 5), 0.0),
    "2d_no_affine": (lambda: nn.BatchNorm2d(6, affine=False), (8, 6, 5, 5), 0.0),
    "1d_nc": (lambda: nn.BatchNorm1d(6), (8, 6), 0.0),
    "1d_ncl": (lambda: nn.BatchNorm1d(6, eps=1e-3, momentum=0.3), (8, 6, 7), 0.0),
    "3d": (lambda: nn.BatchNorm3d(6), (8, 6, 3, 4, 2), 0.0),
}


def _worst32(mine: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest |mine - truth| / (1e-5 (|truth| + max |truth|)): at most 1 where fp32 is within 1e-5 of
    float64's truth relative to the tensor's own magnitude, which round-off meets with 60x to spare on any
    CPU (whatever order its kernels sum in), and a wrong statistic misses by orders of magnitude."""
    scale = 1e-5 * (truth.abs() + truth.abs().max())
    return ((mine.double() - truth).abs() / scale).max().item()


def _batchnorm(case: str) -> dict:
    """2 training steps (the sum of out x a fixed weight, so its gradients sum over ranks) and an
    evaluation-mode forward of par4d's BatchNorm in fp32 on z=2, data=2 against torch's on the whole
    batch in float64, the truth."""
    grid = cases.grid(z=2, data=2)
    make, shape, offset = CASES[case]
    torch.manual_seed(0)
    twin = make()
    if twin.affine:
        with torch.no_grad():
            twin.weight.uniform_(0.5, 1.5), twin.bias.uniform_(-1, 1)
    layer = BatchNorm.from_module(copy.deepcopy(twin), grid=grid, name=case)
    twin = twin.double()
    gen = torch.Generator().manual_seed(1)
    rows = batch_slice(grid, shape[0])
    worst = {}
    for step in range(2):
        x = (torch.randn(shape, generator=gen) * 2 + offset + torch.arange(6.0).view(1, 6, *[1] * (len(shape) - 2)))
        w = torch.randn(shape, generator=gen)
        ref_x = x.double().requires_grad_()
        x_local = x[rows].clone().requires_grad_()
        ref = twin(ref_x)
        out = layer(x_local)
        (ref * w.double()).sum().backward()
        (out * w[rows]).sum().backward()
        if offset:                          # the statistics only (above)
            continue
        worst[f"out {step}"] = _worst32(out.detach(), ref.detach()[rows])
        worst[f"grad x {step}"] = _worst32(x_local.grad, ref_x.grad[rows])
        for n, p in twin.named_parameters():
            grad = comm.all_reduce(grid, layer.get_parameter(n).grad.clone(), "z", "data")
            worst[f"grad {n} {step}"] = _worst32(grad, p.grad)
            p.grad = layer.get_parameter(n).grad = None
    for n, b in twin.named_buffers():
        mine = layer.get_buffer(n)
        worst[n] = _worst32(mine, b) if b.is_floating_point() else _unequal(mine, b)
    twin.eval(), layer.eval()
    x = torch.randn(shape, generator=gen) + offset
    with torch.no_grad():
        worst["eval"] = 0.0 if offset else _worst32(layer(x[rows]), twin(x.double())[rows])
    worst["keys"] = list(layer.state_dict()) == list(twin.state_dict())
    return worst


def test_batchnorm_matches_torch_on_the_whole_batch(pool4):
    """z=2, data=2: outputs, input and parameter gradients, running statistics (momentum,
    cumulative, untracked), evaluation; BatchNorm1d (N, C) and (N, C, L), 2d, 3d."""
    for case in CASES:
        for rank, worst in enumerate(pool4.run(_batchnorm, case)):
            assert worst.pop("keys") and all(v <= 1 for v in worst.values()), (case, rank, worst)
        print(f"\n{case}: worst {max(worst.values()):.3g} ({max(worst, key=worst.get)})")


def test_batchnorm_names_a_wrong_input():
    layer = BatchNorm(6, grid=par4d.Grid.virtual({"x": 1, "z": 2}), name="stem.bn")
    with pytest.raises(ValueError, match=r"stem.bn: expected input \(N, 6, \.\.\.\) .* got \(4, 5, 3\)"):
        layer(torch.randn(4, 5, 3))
