"""What par4d set up for one parallel model, in one object (docs/architecture.md, One state per model).

A model made parallel carries one :class:`ParallelState`, registered on the module as
``fully_shard`` registers its own, and read with :func:`state`: its overlap settings and their
runtime (``par4d.set_overlap``), the data-parallel sync (built by the first step), the dtype its
gradients are summed in (mixed precision), and ``parallelize``'s plan. Every room that needs one
of these asks the state; nothing else is stuck on the module.

No torch here and nothing above the root imported: the state only holds what other rooms made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

_KEY = "_parallel_state"     # the module's own __dict__: copied with it, gone with it

CONTEXT_FORMS = ("ring", "gather")
"""How attention runs on a context axis (par4d.nn.ring): keys and values around the ring, or gathered once."""


def check_context_form(form: str) -> None:
    """Refuse a form not in :data:`CONTEXT_FORMS`, naming the flag (no torch: the CLI checks it first)."""
    if form not in CONTEXT_FORMS:
        raise ValueError(f"--context-form {form!r}: give one of {', '.join(CONTEXT_FORMS)}")


COMPILE_BACKENDS = ("inductor", "aot_eager")
"""What ``--compile`` compiles each block with (par4d.compiled): Inductor's fused kernels, or AOTAutograd's
graphs run eagerly (no C++ compiler needed: what the tests check exactness with)."""


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (par4d.nn.float8): per-tensor scales (the fastest on Hopper), per-row scales,
per-row with the weight gradient's GEMM kept in high precision."""


TORCHAO_MISSING = "float8 training needs torchao (pip install torchao; par4d's requirements.txt pins the version)"


def check_float8(recipe: str) -> None:
    """Refuse a recipe not in :data:`FLOAT8_RECIPES` (or ``none``), and float8 without torchao, naming the flag
    (before any rank starts: torchao is looked for, not imported)."""
    from importlib.util import find_spec

    if recipe == "none":
        return
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"--float8 {recipe!r}: give one of {', '.join(FLOAT8_RECIPES)} or none")
    if find_spec("torchao") is None:
        raise ValueError(f"--float8 {recipe}: {TORCHAO_MISSING}")


def check_compile(backend: str) -> None:
    """Refuse a backend not in :data:`COMPILE_BACKENDS` (or ``none``), naming the flag (no torch, as above)."""
    if backend != "none" and backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile {backend!r}: give one of {', '.join(COMPILE_BACKENDS)} or none")


@dataclass(eq=False)
class ParallelState:
    """One parallel model's set-up.

    ``overlap``: the settings ``set_overlap`` gave (``Overlap.none()`` is synchronous); None only
    while nobody set them, when the sync takes ``Overlap()``'s defaults, as DDP does.
    ``runtime``: the :class:`~par4d.overlap.runtime.LayerRuntime` every Algorithm 1 layer shares
    (None until ``set_overlap`` gave the model's layers one; under ``Overlap.none()`` it waits where
    issued). ``sync``: the data-parallel :class:`~par4d.optim.data_parallel.GradientSync`.
    ``reduce_dtype``: the dtype gradients are summed in over data x z where it is not theirs (mixed
    precision's fp32). ``plan``, ``stream``, ``sync_messages``: ``par4d.parallelize``'s treatment of
    every layer, the residual stream's cut over y (1: whole) and the data-parallel sums it counted.
    ``observe_recompute``: a context the footprint enters around each recomputed segment."""

    # The rooms above make what the fields hold; naming their types here would import them back (the root
    # stands below them), so they are described above instead.
    overlap: Any = None          # par4d.overlap.Overlap
    runtime: Any = None          # par4d.overlap.runtime.LayerRuntime
    sync: Any = None             # par4d.optim.data_parallel.GradientSync
    reduce_dtype: torch.dtype | None = None
    plan: list = field(default_factory=list)     # par4d.adopt.parallelize.Treatment per layer
    stream: int = 1
    sync_messages: tuple = ()
    observe_recompute: Callable[[], Any] | None = None


def state(model: nn.Module) -> ParallelState:
    """``model``'s :class:`ParallelState`, registered (empty) on first use."""
    found = model.__dict__.get(_KEY)
    if found is None:
        found = ParallelState()
        model.__dict__[_KEY] = found
    return found


def has_state(model: nn.Module) -> bool:
    """Whether par4d set anything up for ``model``."""
    return _KEY in model.__dict__
