"""Joining a job: the rendezvous and the process group (gloo on CPUs, NCCL where CUDA is), and the device
a rank computes on."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from par4d.launch.local import free_port
from par4d.launch.ranks import DistEnv

if TYPE_CHECKING:   # torch is imported where a rank joins a job: `par4d plan` needs none
    import torch

JOIN_TIMEOUT = timedelta(minutes=10)


def device(env: DistEnv | None) -> torch.device:
    """This rank's device: its node-local GPU where CUDA is present, else the CPU."""
    import torch

    if torch.cuda.is_available():
        local = env.local_rank if env is not None else 0
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join(env: DistEnv | None) -> None:
    """Join the torch.distributed job of ``env`` (torchrun, srun, par4d's launcher), or
    start a one-rank job when there is none; nothing when this process is in a job already.

    torchrun's variables go through ``env://``, so workers reuse the agent's store;
    srun's are passed as a ``tcp://`` address (no environment writes). Each join gets
    its own key prefix in the store: ``destroy_process_group()`` restarts torch's group
    numbering, and a second join on a store that still holds the first join's keys
    would connect to stale peers (pytorch/pytorch#55967). The count of joins is kept
    in the store itself (one counter per rank), not in this process.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # NCCL bound to this rank's GPU from the start (else its first barrier guesses the device, and warns)
    bound = device(env) if backend == "nccl" else None
    if env is None:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                device_id=bound)
        return
    url = ("env://" if env.launcher == "torchrun" else
           f"tcp://{env.master_addr}:{env.master_port}?rank={env.rank}&world_size={env.world_size}")
    store, rank, world = next(dist.rendezvous(url, timeout=JOIN_TIMEOUT))
    joins = store.add(f"par4d/joins/rank{rank}", 1)
    store = dist.PrefixStore(f"par4d/join{joins}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=JOIN_TIMEOUT,
                            device_id=bound)
