"""par4d: 4D hybrid parallel training (data x 3D tensor) for PyTorch.

The public API (docs/api.md; examples/quickstart.py uses it end to end):

* a grid: ``init`` (join the job, build the grid), ``Grid``, ``Axis``/``AXES``;
* a model on it: ``parallelize`` (any ``nn.Module``), ``nn`` (par4d's layers), ``load_safetensors``;
* training: ``train_step``, ``shard_batch``, ``set_overlap`` with ``Overlap``, the precision policies
  ``FullPrecision``/``MixedPrecision``; ``sync_gradients`` and ``clip_grad_norm_`` for a loop of one's own;
* what par4d set up for a model: ``state`` (a ``ParallelState``);
* checkpoints that load on any grid: ``save_checkpoint``, ``load_checkpoint``, ``has_checkpoint``.

The names are imported on first use, so commands that need no torch (such as ``par4d plan``) start fast.
"""

from importlib import import_module

_LAZY = {
    "AXES": "par4d.grid", "Axis": "par4d.grid", "Grid": "par4d.grid", "init": "par4d.launch",
    "nn": "par4d.nn", "parallelize": "par4d.adopt", "load_safetensors": "par4d.adopt",
    "train_step": "par4d.train.step", "shard_batch": "par4d.layout",
    "Overlap": "par4d.overlap", "set_overlap": "par4d.overlap",
    "FullPrecision": "par4d.optim.precision", "MixedPrecision": "par4d.optim.precision",
    "sync_gradients": "par4d.optim.data_parallel", "clip_grad_norm_": "par4d.optim.data_parallel",
    "state": "par4d.parallel", "ParallelState": "par4d.parallel",
    "save_checkpoint": "par4d.checkpoint", "load_checkpoint": "par4d.checkpoint",
    "has_checkpoint": "par4d.checkpoint",
}
__all__ = sorted(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'par4d' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    value = module if name == "nn" else getattr(module, name)
    globals()[name] = value
    return value
