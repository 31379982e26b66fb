"""Compiled blocks (``--compile``, :func:`compile_blocks`): each block of a model compiled as a region.

A block is what a model repeats: par4d's GPT and U-Net blocks (their classes say ``compile_region``), and a
Hugging Face model's decoder layers (the classes its ``_no_split_modules`` names, transformers' own list of
what must not be cut). Each is compiled in place (as ``nn.Module.compile`` does, through an entry of its kind's:
:func:`_entry`): its parameters, their names and checkpoints are the eager model's, and the embeddings, the head
and the loss stay eager.

par4d's collectives are graph breaks, not traced: a layer's all-gathers, all-reduces and reduce-scatters
(Algorithm 1), the ring's transfers and a mixture's exchanges run where they run eagerly, issued and waited
for by the same Python, so the overlaps are unchanged and the ledger counts the same bytes. A block on a
grid where its layers hold whole weights (data, pipe) issues none and compiles to one graph; on x, y or z each
collective cuts it into fused regions between them (:func:`counted` counts the breaks).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from par4d.eager import skip_wrappers
from par4d.parallel import COMPILE_BACKENDS, check_compile


@dataclass
class Compiled:
    """What compiling did: the blocks compiled and with what, and dynamo's counts at the start (:func:`counted`)
    to tell what the steps since made."""

    blocks: int
    backend: str
    start: tuple[int, int] = (0, 0)

    def made(self, after_first: tuple[int, int], now: tuple[int, int], evaluating: int = 0) -> dict:
        """The run's record: graphs and graph breaks per block from the first step (``after_first``: the counts
        then), the graphs made for evaluation since (``evaluating``: a block run without gradients is a graph of
        its own, made once), and the graphs compiled again after the first step besides (``now``: the counts at
        the end; 0 unless a guard failed, as where a mixture's loads change the shapes)."""
        graphs, breaks = (after_first[i] - self.start[i] for i in range(2))
        return {"blocks": self.blocks, "backend": self.backend, "graphs": graphs,
                "graph_breaks_per_block": breaks / self.blocks, "evaluation_graphs": evaluating,
                "recompiled_graphs": now[0] - after_first[0] - evaluating}


def regions(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` a compiler takes as regions, in module order."""
    named: set[str] = set()
    for module in model.modules():
        named.update(getattr(module, "_no_split_modules", None) or ())
    # (by any class of the module's: FSDP2 makes each wrapped layer an instance of a subclass of its own)
    return [m for m in model.modules() if getattr(type(m), "compile_region", False)
            or any(c.__name__ in named for c in type(m).__mro__)]


def compile_blocks(model: nn.Module, backend: str = "inductor") -> Compiled:
    """Compile every block of ``model`` (:func:`regions`) in place with ``backend``; raises ``ValueError``
    naming the model where it has none (compiling nothing would be a silent eager run)."""
    check_compile(backend)
    if backend == "none":
        raise ValueError(f"compile_blocks(backend='none'): give one of {', '.join(COMPILE_BACKENDS)}")
    blocks = regions(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no block par4d knows to compile (par4d's GPT and U-Net, "
                         f"or a transformers model's decoder layers)")
    import torch

    skip_wrappers()
    start = counted()
    entries: dict[tuple[type, ...], Callable] = {}
    for block in blocks:
        kind = tuple(type(m) for m in block.modules())
        if kind not in entries:
            entries[kind] = _entry(len(entries))
        # (as nn.Module.compile, through this kind's entry; shapes static until one changes, then dynamic)
        block._compiled_call_impl = torch.compile(types.MethodType(entries[kind], block), backend=backend)
    return Compiled(len(blocks), backend, start)


def _entry(kind: int) -> Callable:
    """A block's way in, with a code object of its own for each kind of block (its modules' classes). dynamo keeps
    graphs per code object and looks them up by guards: where one kind breaks its graph inside a nested call (a
    mixture's eager part) and another compiles whole (DeepSeek-V3's dense first layer), the graph of the prefix
    before that call guards nothing that tells the kinds apart: the whole kind would run through it at the next
    step and compile a graph again. Blocks of one kind share their graphs."""

    def enter(block: nn.Module, *args, **kwargs):
        return block._call_impl(*args, **kwargs)

    name = f"block_kind_{kind}"     # (enter has no free variables and no defaults: its code is all it is)
    return types.FunctionType(enter.__code__.replace(co_name=name, co_qualname=name), enter.__globals__, name)


def compile_afresh(model: nn.Module, backend: str) -> Compiled | None:
    """:func:`compile_blocks` after dropping every graph this process compiled before (a benchmark builds many
    models in one process: none may inherit another's graphs, nor its count against dynamo's recompile limit);
    None, compiling nothing, for ``none``."""
    if backend == "none":
        return None
    import torch._dynamo

    torch._dynamo.reset()
    return compile_blocks(model, backend)


def counted() -> tuple[int, int]:
    """dynamo's graphs and graph breaks so far in this process (its counters, which only grow)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


__all__ = ["Compiled", "compile_afresh", "compile_blocks", "counted", "regions"]
