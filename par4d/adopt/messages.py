"""The communication per step the planner expects of a model ``par4d.parallelize`` made.

Per layer, every collective of one training step (forward, backward, the data-parallel
sums) as ``(kind, axes, elements)``: ``elements`` is the per-rank message, as the ledger
records it (docs/architecture.md, "Collectives and the ledger"), so a test can pin the
plan against what a step moved. The messages follow from the layer's shard and from the
shapes one forward pass of the unparallelized model records (:func:`record`, on the meta
device: no arithmetic, no memory). The ring model (Eqs 1-3) turns a message into the
bytes each rank sends (:func:`bytes_sent`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.func import functional_call

from par4d.layout import placement_of
from par4d.ledger import ring_terms
from par4d.nn.embedding import Embedding
from par4d.nn.norm import LayerNorm

Message = tuple[str, tuple[str, ...], int]
"""(collective, grid axes, per-rank elements)."""


@dataclass(frozen=True)
class Seen:
    """What one forward pass showed of a layer: the whole batch's input and output
    elements, whether backward needs the gradient of its input, and whether its input is
    cut by samples (position embeddings, for one, see the positions only: every rank
    looks up all of them)."""

    in_elements: int
    out_elements: int
    input_grad: bool
    per_sample: bool


def record(model: nn.Module, names: list[str], example: tuple | dict) -> dict[str, Seen]:
    """:class:`Seen` for each module of ``model`` named in ``names``, from ``model(*example)``
    (or ``model(**example)``) run on meta tensors of the parameters' and buffers' shapes."""
    seen: dict[str, Seen] = {}
    wanted = set(names)
    samples = next(v for v in (example.values() if isinstance(example, dict) else example)
                   if isinstance(v, torch.Tensor)).shape[0]

    def hook(name):
        def note(module, inputs, output):
            inp = inputs[0]
            seen[name] = Seen(inp.numel(), output.numel(), inp.requires_grad, inp.dim() > 0 and inp.shape[0] == samples)
        return note

    hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n in wanted]
    meta = {n: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
            for n, t in [*model.named_parameters(), *model.named_buffers()]}
    example = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in
               (example.items() if isinstance(example, dict) else enumerate(example))}
    try:
        with torch.enable_grad():      # parallelize runs under no_grad: the hooks must see what needs a gradient
            if all(isinstance(k, int) for k in example):
                functional_call(model, meta, tuple(example.values()))
            else:
                functional_call(model, meta, (), example)
    finally:
        for h in hooks:
            h.remove()
    missing = wanted - set(seen)
    if missing:
        raise ValueError(f"parallelize: the example's forward pass did not run {sorted(missing)[0]}, so its "
                         f"communication cannot be counted")
    return seen


def layer_messages(layer: nn.Module, seen: Seen, sizes: dict[str, int]) -> list[Message]:
    """The collectives of one step of a par4d layer standing for a layer that ``seen``
    describes: Algorithm 1's (with the all-gathers at whole-feature boundaries) for a Linear
    or Conv2d, the table's gather and the output's all-gather for an Embedding."""
    rows = sizes["data"] * sizes["z"] if seen.per_sample else 1     # samples are split over these
    out: list[Message] = []

    def add(kind: str, axis: str, elements: float, when: bool = True) -> None:
        if when and sizes[axis] > 1:
            out.append((kind, (axis,), int(elements)))

    w = layer.weight.numel()
    grad_w = layer.weight.requires_grad
    if isinstance(layer, Embedding):
        if sizes["y"] * sizes["z"] > 1:
            add("all_gather", "z", w)
            add("all_gather", "y", seen.out_elements / (rows * sizes["y"]), layer.output_layout == "whole")
            add("reduce_scatter", "z", w * sizes["z"], grad_w)
        return out
    g_in, g_out = sizes[layer.in_axis], sizes[layer.out_axis]
    if g_in * g_out * sizes["z"] == 1:
        return out                                          # PyTorch's own layer: nothing to gather or sum
    local_in, local_out = seen.in_elements / (rows * g_in), seen.out_elements / (rows * g_out)
    add("all_gather", "z", w)                                                        # Ŵ
    add("all_reduce", layer.in_axis, local_out)                                      # O's partial sums
    add("all_gather", layer.out_axis, local_out, layer.output_layout == "whole")   # to whole features
    add("all_reduce", layer.out_axis, local_in, seen.input_grad)                    # dL/dI's partial sums
    add("all_gather", layer.in_axis, local_in, seen.input_grad and layer.input_layout == "whole")
    add("reduce_scatter", "z", w * sizes["z"], grad_w)                              # dŴ
    return out


def norm_messages(norm: nn.Module, seen: Seen, sizes: dict[str, int]) -> list[Message]:
    """The collectives of one step of a par4d norm over features split over its axis, per row of this
    rank's input: an RMSNorm all-reduces a sum of squares in forward and its gradient in backward; a
    LayerNorm all-gathers (mean, M2) in forward and all-reduces two sums in backward."""
    if sizes[norm.axis] == 1:
        return []
    rows = sizes["data"] * sizes["z"] if seen.per_sample else 1
    n = seen.in_elements // (rows * norm.dim)           # this rank's rows (tokens)
    if isinstance(norm, LayerNorm):
        return [("all_gather", (norm.axis,), 2 * n), ("all_reduce", (norm.axis,), 2 * n)]
    return [("all_reduce", (norm.axis,), n)] + ([("all_reduce", (norm.axis,), n)] if seen.input_grad else [])


def hook_messages(which: str, module: nn.Module, seen: Seen | None, sizes: dict[str, int]) -> tuple[Message, ...]:
    """Where the residual stream is sharded over y: the all-gather over y that a whole (replicated) embedding's
    output costs (``split``: in backward, if it trains) or a whole head's input (``gather``: in forward)."""
    if seen is None:
        return ()
    rows = sizes["data"] * sizes["z"] if seen.per_sample else 1
    if which == "split":
        trains = module.weight.requires_grad
        return (("all_gather", ("y",), seen.out_elements // (rows * sizes["y"])),) if trains else ()
    return (("all_gather", ("y",), seen.in_elements // (rows * sizes["y"])),)


def sync_messages(model: nn.Module, sizes: dict[str, int]) -> list[Message]:
    """The data-parallel sums after backward: per group of partial axes, one all-reduce of
    all its gradients (in buckets, which do not change the total)."""
    groups: dict[tuple[str, ...], int] = defaultdict(int)
    for param in model.parameters():
        if param.requires_grad:
            groups[tuple(a for a in placement_of(param).grad_sum if sizes.get(a, 1) > 1)] += param.numel()
    return [("all_reduce", axes, n) for axes, n in sorted(groups.items()) if axes]


def bytes_sent(message: Message, sizes: dict[str, int], bytes_per_element: int = 4) -> float:
    """Bytes one rank sends for ``message`` in a ring (Eqs 1-3)."""
    kind, axes, elements = message
    ranks = 1
    for a in axes:
        ranks *= sizes.get(a, 1)
    return ring_terms(kind, ranks)[1] * elements * bytes_per_element
