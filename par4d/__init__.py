"""par4d: 4D hybrid parallel training (data x 3D tensor) for PyTorch."""

from par4d import nn
from par4d.data_parallel import clip_grad_norm_, sync_gradients
from par4d.grid import AXES, Grid, init

__all__ = ["AXES", "Grid", "clip_grad_norm_", "init", "nn", "sync_gradients"]
__version__ = "0.1.0"
