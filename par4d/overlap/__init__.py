"""The 4D paper's overlaps (Section IV) and par4d's data-parallel one: the policy and its runtime.

* :mod:`par4d.overlap.policy`: :class:`Overlap`, which switches a run uses (no torch: the CLI
  and the planner read it before any rank starts).
* :mod:`par4d.overlap.runtime`: what serves them while a model trains: the z all-gathers
  prefetched in recorded order and cached across recomputation (OAG, cache), and the
  weight-gradient reduce-scatters waited for after backward (ORS).
* :mod:`par4d.overlap.apply`: :func:`set_overlap`, the one call that gives a model's Algorithm 1
  layers (par4d's GPT and U-Net, and every layer ``par4d.parallelize`` makes) one runtime. OAR
  acts inside :class:`par4d.nn.algorithm1.Algorithm1`; the data-parallel overlap in
  :mod:`par4d.optim.data_parallel`, which reads the settings ``set_overlap`` put in the model's
  :class:`~par4d.parallel.ParallelState`.

``set_overlap`` and ``LayerRuntime`` are imported on first use, so importing the policy needs no torch.
"""

from importlib import import_module

from par4d.overlap.policy import BUCKET_MB, NAMES, Overlap, check_bucket_mb

__all__ = ["BUCKET_MB", "NAMES", "LayerRuntime", "Overlap", "check_bucket_mb", "set_overlap"]

_LAZY = {"set_overlap": "par4d.overlap.apply", "LayerRuntime": "par4d.overlap.runtime"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'par4d.overlap' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
