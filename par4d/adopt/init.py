"""A model ``par4d.parallelize`` made on the meta device, initialised without a file and without any
rank ever holding all of it: the unparallelized model's own initialisation, a block at a time.

A copy of the unparallelized model on the meta device (no memory) is walked children before parents,
as Hugging Face's ``initialize_weights`` walks it, and every module gets what its construction and
the model's initialisation would give it: torch's own ``reset_parameters`` (where the module has one),
then the model's ``_init_weights`` (Hugging Face's: normal weights of the model's ``initializer_range``,
GPT-2's scaled residual projections, norms at one, biases at zero). Each block (a member of an
``nn.ModuleList``: a decoder layer), or each module outside such lists, is made whole on the CPU just
before its first call, and after its own call its values go into the parallel model, each rank keeping
its shards (:func:`par4d.adopt.load.fill_parameters`), and it goes back to the meta device: a rank holds
at most one block whole besides its shards.

Every module draws from torch's generator seeded by the run's seed and the module's name, so the values
depend on neither the grid nor the order of the walk: :func:`initial_state` gives the same values whole,
for the unparallelized twin. They are not those of ``Model(config)`` after ``torch.manual_seed(seed)``
(that stream also holds the draws of torch's construction-time initialisation, in construction order).
A parameter tied to one initialised earlier keeps that one's values, as Hugging Face's tying leaves
them (the input embedding's).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from par4d.adopt.load import compute_buffers, fill_parameters
from par4d.grid import Grid


@torch.no_grad()
def initialize(model: nn.Module, twin: nn.Module, grid: Grid, seed: int) -> int:
    """Fill ``model`` (``twin`` made parallel on ``grid`` by ``par4d.parallelize``, on the meta device) with
    :func:`initial_state`'s values, a block at a time; ``twin``, the unparallelized model on the meta device,
    is not changed; a pipeline stage of it (``par4d.adopt.stages``) gets the values of the parameters it
    holds, and the blocks of other stages are not made. Returns the most bytes held whole at once (a
    block's)."""
    most = 0
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    with torch.random.fork_rng(devices=[]):   # the caller's generator state is left as it was
        for values in _block_values(twin, seed, held):
            most = max(most, sum(t.numel() * t.element_size() for t in values.values()))
            fill_parameters(model, grid, {name: t for name, t in values.items() if name in held})
    compute_buffers(model, grid.device)
    return most


@torch.no_grad()
def initial_state(twin: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the unparallelized model ``twin`` (on the meta device) whole, as :func:`initialize`
    gives it to the parallel model (tied ones under their first name)."""
    state: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        for values in _block_values(twin, seed):
            state.update({name: t.clone() for name, t in values.items()})
    return state


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _block_values(twin: nn.Module, seed: int, held: set[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """{name: whole value} of each block's (or lone module's) parameters, once each is initialised; blocks
    with none of the parameters ``held`` (None: all) are skipped (each module's values depend on its name
    alone, so the others' are the same)."""
    walked = copy.deepcopy(twin)
    for item in [*walked.modules(), *walked.parameters()]:
        if hasattr(item, "_is_hf_initialized"):
            del item._is_hf_initialized        # set on the meta copy by its constructor's (empty) pass
    names = {id(m): name for name, m in walked.named_modules()}
    blocks = _blocks(walked)
    first: dict[int, str] = {}                # a tied parameter's names all map to its first one; read now,
    canonical = {name: first.setdefault(id(p), name)    # since moving a module between devices makes new
                 for name, p in walked.named_parameters(remove_duplicate=False)}    # parameter objects
    done: set[str] = set()                    # parameters given already (tied ones keep their first values)
    elsewhere = set() if held is None else {   # blocks of another pipeline stage
        id(b) for b in blocks.values()
        if not any(f"{names[id(b)]}.{n}" in held for n, _ in b.named_parameters(remove_duplicate=False))}
    entered = None
    for module, init in _post_order(walked):
        block = blocks.get(id(module))        # None: a module outside the blocks, made whole on its own
        if id(block) in elsewhere:
            continue
        if block is None:
            module.to_empty(device="cpu", recurse=False)
        elif block is not entered:
            block.to_empty(device="cpu")
            entered = block
        torch.manual_seed(_seed(seed, names[id(module)]))
        own = next(module.parameters(recurse=False), None) is not None
        if own and callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()         # what the module's construction gives it, then the model's own
        init(module)
        if block is None or module is block:  # a block's own call is the last of its subtree's
            recurse = block is not None
            prefix = names[id(module)]
            params = [(canonical[f"{prefix}.{n}" if prefix else n], p)
                      for n, p in module.named_parameters(recurse=recurse, remove_duplicate=False)]
            fresh = {name: p.detach() for name, p in params if name not in done}
            done.update(name for name, _ in params)
            if fresh:
                yield fresh
            module._apply(lambda t: torch.empty_like(t, device="meta"), recurse=recurse)


def _blocks(model: nn.Module) -> dict[int, nn.Module]:
    """{id of every module inside a member of an ``nn.ModuleList``: that member}."""
    out = {}
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for member in module:
                for inner in member.modules():
                    out[id(inner)] = member
    return out


def _post_order(model: nn.Module) -> Iterator[tuple[nn.Module, Callable[[nn.Module], None]]]:
    """(module, the call that initialises it), children before parents, each sub-model (a Hugging Face
    ``PreTrainedModel`` inside another) with its own call: the order of ``initialize_weights``."""
    def walk(module: nn.Module, init: Callable[[nn.Module], None]):
        for child in module.children():
            yield from walk(child, getattr(child, "_initialize_weights", None) if _pretrained(child) else init)
        yield module, init

    return walk(model, model._initialize_weights)


def _pretrained(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)
