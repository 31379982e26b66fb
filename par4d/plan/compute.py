"""Compute time of one device's share of a training step, by what runs there: each GEMM by its
shape, attention's fused matmuls, and the element-wise work between them.

A GEMM of ``m x k`` by ``k x n`` is timed by the roofline (NVIDIA's Matrix Multiplication Background
User's Guide, "Math and memory bounds"): ``2 m n k`` FLOPs at the fraction of peak the largest
GEMMs reach, or its operands and result through device memory, whichever is slower, plus a fixed
cost per kernel. Skinny shards (a small ``k / G`` or few rows per microbatch) fall under the memory
roof, which is where tensor parallelism loses at small shards. Attention runs fused
(``scaled_dot_product_attention``), at its own fraction of peak; the element-wise kernels
(norms, residual sums, biases, GELU, the loss's softmax) move their bytes at the memory bandwidth.

A machine without ``memory_bandwidth`` keeps the shape-free model: all FLOPs over peak x efficiency.
Tile and wave quantization (the same guide's Section 3) are not modelled.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from par4d.plan.machines import Machine
    from par4d.plan.workload import GPTSpec, ModuleWorkload


def gemm_seconds(m: float, n: float, k: float, machine: Machine) -> float:
    """One GEMM of ``(m x k) @ (k x n)`` in the machine's training dtype: the slower of its FLOPs at
    ``peak x efficiency`` and its three matrices through memory, plus ``kernel_latency``."""
    flops = 2 * m * n * k
    moved = (m * k + k * n + m * n) * machine.bytes_per_element
    return max(flops / (machine.peak_flops * machine.efficiency), moved / machine.memory_bandwidth) \
        + machine.kernel_latency


def stage_seconds(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], machine: Machine,
                  checkpointing: bool, microbatches: int = 1) -> float:
    """One stage's compute per step (the whole model's without a pipeline) on one device.

    By shape (the machine has ``memory_bandwidth``): every layer's forward GEMM and its two backward
    ones (input and weight gradient: the same FLOPs and bytes, transposed), once more under
    recomputation (not the head's), on each of the ``microbatches``' rows; attention's FLOPs at
    ``attention_efficiency``; the element-wise bytes at the memory bandwidth. The stage's share is
    1/P of each. Without ``memory_bandwidth``: FLOPs per device over peak x efficiency. Either way each
    layer pass of each microbatch adds the host's ``layer_overhead``."""
    world = math.prod(sizes.values())                     # every axis, pipe included
    pipe = sizes.get("pipe", 1)
    matmul, attention = spec.flops_split(checkpointing)
    attention_flops = attention * sizes["y"] / world     # replicated over y
    rows = 1 / (sizes["data"] * sizes["z"] * microbatches)
    gemms = host = 0.0                                    # per microbatch
    for layer in spec.layers():
        g_in, g_out = (sizes["x"], sizes["y"]) if layer.transposed else (sizes["y"], sizes["x"])
        passes = layer.count * (4 if checkpointing and layer.name not in spec.NOT_RECOMPUTED else 3)
        host += passes * machine.layer_overhead
        if machine.memory_bandwidth is not None:
            gemms += passes * gemm_seconds(layer.m * rows, layer.n / g_out, layer.k / g_in, machine)
    if machine.memory_bandwidth is None:
        return (matmul / world + attention_flops) / (machine.peak_flops * machine.efficiency) \
            + host * microbatches / pipe
    attention_efficiency = machine.attention_efficiency or machine.efficiency
    return ((gemms + host) * microbatches / pipe + attention_flops / (machine.peak_flops * attention_efficiency)
            + spec.elementwise_bytes(sizes, machine.bytes_per_element, checkpointing) / pipe
            / machine.memory_bandwidth)


# AdamW's one pass over a parameter's state: it reads the parameter (or its fp32 master), its gradient and the two
# moments, and writes the parameter and the moments back: 16 + 12 bytes in fp32; in 16 bits with fp32 masters
# 14 + 14 (the 16-bit gradient read, the 16-bit copy written).
OPTIMIZER_BYTES = 28
# Bytes a parameter crosses the host link in an offloaded step (par4d.optim.offload): its fp32 master and AdamW's
# two moments to the device and back, 12 each way, in copies the step waits for bucket by bucket.
OFFLOAD_LINK_BYTES = 24


def optimizer_seconds(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], machine: Machine,
                      offload_bsize: int | None = None) -> float:
    """One step's AdamW: its stage's share of the rank's parameters, :data:`OPTIMIZER_BYTES` each through the
    device's memory (the kernels are memory-bound); 0 on a machine without ``memory_bandwidth``. Offloaded
    (``offload_bsize``), the same pass on the device plus :data:`OFFLOAD_LINK_BYTES` each over the host link
    (``host_bandwidth``; a machine without it leaves the link out)."""
    params = spec.params_per_rank(sizes) / sizes.get("pipe", 1)
    device = 0.0 if machine.memory_bandwidth is None else params * OPTIMIZER_BYTES / machine.memory_bandwidth
    if offload_bsize is None or machine.host_bandwidth is None:
        return device
    return device + params * OFFLOAD_LINK_BYTES / machine.host_bandwidth


def with_bubble(t_stage: float, micro: int, pipe: int, machine: Machine) -> float:
    """A step's compute from one stage's: the pipeline's fill and drain ``(M + P - 1) / M``. Where ranks time-share
    the cores (``cores_shared`` = s), the schedule's M + P - 1 slots each take a microbatch's stage alone at full
    speed, or longer where the a stages at work (and their copies over the other axes) need more cores than there
    are: ``max(1, a s / P)`` of it. A stage idle in the fill and drain gives its cores to the others, but no rank runs
    faster than alone (its threads). Never grows with M (the search's bound relies on it)."""
    if machine.cores_shared > 1:
        share = machine.cores_shared / pipe        # of the cores one microbatch's stage at work needs
        few, many = min(pipe, micro), max(pipe, micro)
        slots = 2 * _ramp(few - 1, share) + (many - few + 1) * max(1.0, share * few)
        return t_stage * slots / (machine.cores_shared * micro)
    return t_stage * ((micro + pipe - 1) / micro)


def _ramp(n: int, share: float) -> float:
    """``max(1, a share)`` summed over a = 1 .. n: the slots of a pipeline's fill (or drain) with a stages at work."""
    if n <= 0:
        return 0.0
    ones = min(n, math.floor(1 / share))
    return ones + share * (n * (n + 1) - ones * (ones + 1)) / 2
