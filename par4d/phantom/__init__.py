"""Phantom parallelism: phantom layers and the GPT MLP made of them, the tensor-parallel
baseline, the energy model, the synthetic teacher. The experiment that compares phantom
with tensor parallelism (``par4d phantom compare``) is a benchmark: :mod:`par4d.bench.phantom`."""

from par4d.phantom.baseline import TensorParallelFFN
from par4d.phantom.data import SyntheticTeacher
from par4d.phantom.energy import CPU_CORE_ESTIMATE, FRONTIER_GCD, DeviceProfile, EnergyMonitor
from par4d.phantom.layers import PhantomFFN, PhantomLinear, block_matrix, parameter_count
from par4d.phantom.mlp import PhantomMLP, PhantomMLPTwin

__all__ = ["CPU_CORE_ESTIMATE", "DeviceProfile", "EnergyMonitor", "FRONTIER_GCD", "PhantomFFN", "PhantomLinear",
           "PhantomMLP", "PhantomMLPTwin", "SyntheticTeacher", "TensorParallelFFN", "block_matrix", "parameter_count"]
