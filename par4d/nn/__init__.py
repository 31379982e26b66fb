"""Layers of the 3D tensor-parallel grid (Algorithm 1 and its kin)."""

from par4d.nn.linear import Linear

__all__ = ["Linear"]
