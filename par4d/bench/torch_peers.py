"""torch's side of the benchmarks: the meshes of the peers a user would pick instead of par4d (DDP,
FSDP2, HSDP, FSDP2 + tensor parallelism), a counter of the bytes their collectives move, and tearing
their process groups down between rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

KINDS = ("ddp", "fsdp", "hsdp", "tp")


class C10dBytes(TorchDispatchMode):
    """Counts the per-rank input bytes of c10d collectives issued through the dispatcher."""

    OPS = ("allgather", "reduce_scatter", "allreduce", "_allgather_base", "_reduce_scatter_base")

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and any(name.startswith(op) for op in self.OPS):
            inputs = args[1] if name.startswith(("allgather", "reduce_scatter", "_allgather", "_reduce")) else args[0]
            for t in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
                for leaf in t if isinstance(t, (list, tuple)) else [t]:
                    if isinstance(leaf, torch.Tensor):
                        self.bytes += leaf.numel() * leaf.element_size()
        return func(*args, **(kwargs or {}))


def hsdp_shape(nproc: int, nodes: int | None) -> tuple[int, int]:
    """(replicate, shard) sizes of HSDP's mesh: shard inside a node, replicate across nodes."""
    return (nodes, nproc) if nodes is not None else (2, nproc // 2)


def tp_shape(nproc: int, nodes: int | None) -> tuple[int, int]:
    """(FSDP, TP) sizes of the FSDP2+TP mesh: TP inside a node (2 of the local ranks without nodes)."""
    return (nodes, nproc) if nodes is not None else (nproc // 2, 2)


def peer_mesh(kind: str, world: int, nproc: int, nodes: int | None) -> DeviceMesh | None:
    """The DeviceMesh of peer ``kind`` (None for DDP, which runs on the job's default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "ddp":
        return None
    if kind == "fsdp":
        return init_device_mesh("cpu", (world,))
    if kind == "hsdp":
        shape, names = hsdp_shape(nproc, nodes), ("replicate", "shard")
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    if kind == "tp":
        return init_device_mesh("cpu", tp_shape(nproc, nodes), mesh_dim_names=("dp", "tp"))
    raise ValueError(f"unknown peer {kind!r}; peers are {', '.join(KINDS)}")


def destroy_groups(mesh: DeviceMesh) -> None:
    """Destroy a mesh's own groups (not the job's default group): idle gloo groups slow later rows."""
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if group is dist.group.WORLD:
            continue
        try:
            dist.destroy_process_group(group)
        except ValueError:     # destroyed already through another mesh dim
            pass
