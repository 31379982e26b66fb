"""``set_overlap(model, settings)``: the one call that gives a model its overlaps.

Every Algorithm 1 layer of the model (:class:`~par4d.nn.algorithm1.Algorithm1Layer`: par4d's
Linear and Conv2d, whoever built them: par4d's GPT and U-Net, ``par4d.parallelize``, a user)
gets one :class:`~par4d.overlap.runtime.LayerRuntime`, so the model's z all-gathers share one
recorded order (OAG) and one cache, and its deferred reduce-scatters (ORS) one place where they
are waited for; every mixture of experts (:class:`~par4d.nn.moe.Mixture`) its ``ep`` switch, every attention
on a context axis its ``cp`` switch. Both go
into the model's :class:`~par4d.parallel.ParallelState`, where the data-parallel overlap (``dp``) reads
them when :func:`par4d.optim.data_parallel.gradient_sync` builds its buckets.
"""

from __future__ import annotations

import torch.nn as nn

from par4d.nn.algorithm1 import Algorithm1Layer
from par4d.nn.moe import Mixture
from par4d.overlap.policy import Overlap
from par4d.overlap.runtime import LayerRuntime
from par4d.parallel import state


def set_overlap(model: nn.Module, settings: Overlap) -> nn.Module:
    """Overlap the collectives of every Algorithm 1 layer of ``model`` as ``settings`` say
    (``Overlap.none()``: synchronous), with one runtime for the whole model: each forward of
    ``model`` begins an iteration of its recorded gather order (OAG). Calling it again replaces
    the runtime. Returns the model."""
    if not isinstance(settings, Overlap):
        raise TypeError(f"set_overlap: settings is {type(settings).__name__}, not par4d.Overlap "
                        f"(Overlap.none() is synchronous, Overlap() every overlap on)")
    parallel = state(model)
    if parallel.runtime is not None and parallel.runtime.hook is not None:
        parallel.runtime.hook.remove()
    layers = [m for m in model.modules() if isinstance(m, Algorithm1Layer)]
    grids = {id(layer.grid) for layer in layers}
    if len(grids) > 1:
        raise ValueError(f"set_overlap: the Algorithm 1 layers of {type(model).__name__} live on {len(grids)} "
                         f"different grids; one model's overlap runtime serves one grid")
    runtime = None
    if layers:
        runtime = LayerRuntime(layers[0].grid, settings)
        runtime.hook = model.register_forward_pre_hook(lambda module, args: runtime.gathers.begin())
    for layer in layers:
        layer.runtime = runtime
    for mixture in (m for m in model.modules() if isinstance(m, Mixture)):
        mixture.overlap = settings.experts
    for attention in (m for m in model.modules() if hasattr(m, "context_form")):    # par4d.nn.ring's users
        attention.context_overlap = settings.context
    parallel.runtime, parallel.overlap = runtime, settings
    return model
