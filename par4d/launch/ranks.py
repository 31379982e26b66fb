"""Where a job's ranks come from, read from the launcher's variables: torchrun (and par4d's launcher, which
uses torchrun's elastic agent) sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; Slurm's ``srun``
sets ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_STEP_ID``, the rendezvous address coming from
``MASTER_ADDR`` or the first host of ``SLURM_STEP_NODELIST`` (expanded with ``scontrol``), the port from
``MASTER_PORT`` or the job id."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0]


def _slurm_tasks_per_node(env) -> int:
    """This node's task count: SLURM_STEP_TASKS_PER_NODE looks like ``4(x2),3``."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "1"
    return int(text.split(",")[0].split("(")[0])


def distributed_env(environ: dict[str, str] | None = None) -> DistEnv | None:
    """The job this process belongs to, or ``None`` when it was started alone."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=_slurm_tasks_per_node(env),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(),
            # One port per job, so two jobs sharing a node do not collide.
            master_port=int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000),
            launcher="srun",
        )
    return None
