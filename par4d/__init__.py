"""par4d: 4D hybrid parallel training (data x 3D tensor) for PyTorch.

The names below are imported on first use, so commands that need no torch (such as
``par4d plan``) start fast.
"""

from importlib import import_module

__all__ = ["AXES", "Axis", "FullPrecision", "Grid", "MixedPrecision", "Overlap", "ParallelState", "clip_grad_norm_",
           "init", "load_checkpoint", "load_safetensors", "nn", "parallelize", "save_checkpoint", "set_overlap",
           "shard_batch", "state", "sync_gradients", "train_step"]
__version__ = "0.1.0"

_LAZY = {"AXES": "par4d.grid", "Axis": "par4d.grid", "Grid": "par4d.grid", "init": "par4d.launch", "nn": "par4d.nn",
         "Overlap": "par4d.overlap", "parallelize": "par4d.auto", "load_safetensors": "par4d.auto",
         "sync_gradients": "par4d.optim.data_parallel", "clip_grad_norm_": "par4d.optim.data_parallel",
         "set_overlap": "par4d.overlap", "shard_batch": "par4d.layout", "state": "par4d.parallel",
         "ParallelState": "par4d.parallel", "FullPrecision": "par4d.optim.precision",
         "MixedPrecision": "par4d.optim.precision", "train_step": "par4d.train.step",
         "save_checkpoint": "par4d.checkpoint", "load_checkpoint": "par4d.checkpoint"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'par4d' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    value = module if name == "nn" else getattr(module, name)
    globals()[name] = value
    return value
