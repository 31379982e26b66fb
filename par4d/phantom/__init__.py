"""Phantom parallelism: phantom layers, the tensor-parallel baseline, the energy model."""

from par4d.phantom.baseline import TensorParallelFFN
from par4d.phantom.data import SyntheticTeacher
from par4d.phantom.energy import CPU_CORE_ESTIMATE, FRONTIER_GCD, DeviceProfile, EnergyMonitor
from par4d.phantom.layers import PhantomFFN, PhantomLinear, block_matrix, parameter_count

__all__ = ["CPU_CORE_ESTIMATE", "DeviceProfile", "EnergyMonitor", "FRONTIER_GCD", "PhantomFFN", "PhantomLinear",
           "SyntheticTeacher", "TensorParallelFFN", "block_matrix", "parameter_count"]
