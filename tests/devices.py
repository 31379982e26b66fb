"""The suite means gloo on the CPU. Where a GPU is present, par4d's launcher would pick NCCL and give
several ranks one GPU, so ``conftest`` hides the GPUs from the test process and every process it starts
(before anything initialises CUDA); tests marked ``cuda`` start their own processes with them visible."""

from __future__ import annotations

import os
import subprocess
import sys

GPUS_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")   # as the suite was started


def hide_gpus() -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def gpu_env(**extra: str) -> dict[str, str]:
    """This process's environment with the GPUs it was started with visible again."""
    env = dict(os.environ, **extra)
    if GPUS_VISIBLE is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = GPUS_VISIBLE
    return env


def count_gpus() -> int:
    """GPUs a process started with :func:`gpu_env` sees, asked in a child (the test process must not
    initialise CUDA); 0 without asking where torch is not a CUDA build."""
    import torch

    if torch.version.cuda is None:
        return 0
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, env=gpu_env(), timeout=120)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0
