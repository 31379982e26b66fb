"""Helpers that run inside the pool's ranks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import par4d
from par4d.grid import Grid, build_grid, validate_sizes
from par4d.models import GPTConfig
from par4d.plan.cost import factorizations

_current: dict[tuple, Grid] = {}


def grid(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1,
         nodes: tuple[int, ...] | None = None, hierarchical: str = "auto", expert: int = 1, context: int = 1) -> Grid:
    """The grid of this shape, reused while tests ask for the same shape (building
    groups costs); the previous shape's grid is closed, since idle groups slow the
    pool's ranks (docs/planner.md). ``nodes``: each rank's node, declared (the pool's ranks
    share one host): collectives over groups that span the declared nodes go in stages."""
    key = (x, y, z, data, pipe, nodes, hierarchical, expert, context)
    if key not in _current:
        for old in _current.values():
            old.close()
        _current.clear()
        sizes = dict(x=x, y=y, z=z, data=data, pipe=pipe, **({"context": context} if context > 1 else {}))
        if nodes is None:
            _current[key] = par4d.init(**sizes, hierarchical=hierarchical, expert=expert)
        else:
            _current[key] = build_grid(validate_sizes(sizes, dist.get_world_size()), torch.device("cpu"),
                                       nodes, hierarchical)
    return _current[key]


@contextmanager
def float64() -> Iterator[None]:
    """Models and data built inside take float64 (par4d's layers, like torch's, take the default
    dtype): where a comparison runs several optimizer steps, fp32 would hold it to round-off that
    other CPUs' kernels sum in another order and AdamW amplifies; float64 proves exactness."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of every gradient it steps with (after the sync and clipping)."""

    def __init__(self, params, **settings):
        super().__init__(params, **settings)
        self.grads: list[list[torch.Tensor | None]] = []

    def step(self, closure=None):
        self.grads.append([None if p.grad is None else p.grad.clone()
                           for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def assert_bitwise(what: str, ours, base) -> None:
    """``ours`` equals ``base`` bit for bit (tensors, or nested lists of them; None where both have none)."""
    if isinstance(base, list):
        assert len(ours) == len(base), f"{what}: {len(ours)} items, the other run {len(base)}"
        for i, (a, b) in enumerate(zip(ours, base)):
            assert_bitwise(f"{what}[{i}]", a, b)
        return
    if base is None or ours is None:
        assert ours is None and base is None, f"{what}: one side has no gradient"
        return
    if not torch.equal(ours, base):
        diff = (ours.double() - base.double()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max |diff| {diff:.3g})")


# par4d's GPT against its twin: not powers of two where the grid allows (vocabulary 36, width 24, head dim 6).
GPT_CONFIG = GPTConfig(vocab_size=36, block_size=8, n_layer=2, n_head=4, n_embd=24, seed=3)
GPT_BATCH, GPT_STEPS = 4, 3


def compare_gpt_with_twin(grid: Grid, sizes: dict, config: GPTConfig, documents: bool = False,
                          form: str = "ring", restart: bool = False, compile: str = "none") -> int:
    """par4d's GPT on ``grid`` against its single-device twin: the same initial parameters, then for each of
    GPT_STEPS AdamW steps the loss and every gradient, and the parameters after them; returns how many there are.
    ``documents``: each window packs documents of random lengths (one of them across a chunk boundary, one
    token long, ...), attention kept inside them (the twin given the explicit block-diagonal causal mask).
    ``form``: how attention runs on a context axis (``par4d.nn.ring.set_context_form``); ``restart``: with
    documents, each token's position counted from its document's start. ``compile``: a backend compiling the
    model's blocks (par4d.compiled), or none."""
    from par4d.layout import shard_batch
    from par4d.nn.ring import set_context_form
    from par4d.optim.data_parallel import global_mean, sync_gradients
    from par4d.train.recipes.gpt import build_gpt, build_reference

    twin = build_reference(config)
    model = set_context_form(build_gpt(config, grid), form)
    if compile != "none":
        from par4d.compiled import compile_blocks

        compile_blocks(model, compile)
    start = model.reference_state()
    for name, param in twin.named_parameters():
        assert torch.equal(start[name], param.detach()), f"{sizes}: initial {name} differs from the twin"
        assert param.dtype == torch.float64, f"{name} is {param.dtype}"

    # The key bias's gradient is zero in exact arithmetic (softmax is shift-invariant),
    # so both sides hold round-off there; eps=1e-4 keeps Adam from scaling round-off
    # up to a full lr-sized step, while real gradients (>= 1e-3 here) still move by ~lr.
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    gen = torch.Generator().manual_seed(0)
    for step in range(GPT_STEPS):
        tokens = torch.randint(0, config.vocab_size, (GPT_BATCH, config.block_size + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        packed = ()
        if documents:        # a document starts at a token with chance 1/3 (the first: always)
            starts = torch.rand(inputs.shape, generator=gen) < 1 / 3
            packed = (torch.cumsum(starts, dim=1) + 10 * torch.arange(inputs.shape[0]).unsqueeze(1),)
            if restart:      # a token's place: its index less its document's first token's
                index = torch.arange(inputs.shape[1]).expand(inputs.shape)
                first = torch.where(starts, index, 0).cummax(dim=1).values
                packed = (*packed, index - first)
        ref_loss = twin(inputs, targets, *packed)
        ref_loss.backward()
        loss = model(shard_batch(grid, inputs), shard_batch(grid, targets), *(shard_batch(grid, d) for d in packed))
        loss.backward()
        sync_gradients(model, grid)

        torch.testing.assert_close(global_mean(loss, grid), ref_loss.detach(),
                                   msg=lambda m, s=step: f"{sizes} step {s} loss: {m}")
        grads = model.reference_state(grad=True)
        assert set(grads) == {name for name, _ in twin.named_parameters()}
        for name, param in twin.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, s=step: f"{sizes} step {s} grad {n}: {m}")
        opt.step()
        opt_twin.step()
        opt.zero_grad()
        opt_twin.zero_grad()

    after = model.reference_state()
    for name, param in twin.named_parameters():
        # atol 1e-5 = 1/1000 of one lr step: Adam divides by sqrt(v), so tiny gradients'
        # round-off moves a weight by up to ~1e-6; a wrong gradient moves it by ~lr.
        torch.testing.assert_close(after[name], param.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{sizes} after {GPT_STEPS} AdamW steps, {n}: {m}")
    return len(after)


__all__ = ["GPT_BATCH", "GPT_CONFIG", "GPT_STEPS", "RecordingAdamW", "assert_bitwise", "compare_gpt_with_twin",
           "factorizations", "float64", "grid"]
