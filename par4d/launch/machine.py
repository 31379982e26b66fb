"""Measured matmul peak and model FLOP/s (the paper's % of peak metric)."""

from __future__ import annotations

import os
import time

import torch


def cpu_cores() -> int:
    """Cores this process may run on (respects affinity and containers' CPU sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_memory() -> int | None:
    """Bytes of RAM this machine has (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def threads_per_rank(ranks_here: int) -> int:
    """Torch threads for each of ``ranks_here`` ranks sharing this machine's cores."""
    return max(1, cpu_cores() // ranks_here)


def job_peak(device: torch.device, dtype: torch.dtype, devices: int) -> tuple[float, str]:
    """The job's matmul peak and what it is, in words. On a GPU: one device's in ``dtype`` (the training's
    compute dtype; products of 8192 x 8192, large enough to fill one) times the ``devices`` the job's ranks
    run on, one each. On the CPU: fp32 on every core, which the ranks share."""
    if device.type == "cuda":
        name = str(dtype).removeprefix("torch.")
        one = measure_matmul_peak(size=8192, dtype=dtype, device=device)
        return one * devices, f"{name}, {devices} x {torch.cuda.get_device_name(device)}"
    return measure_matmul_peak(threads=cpu_cores()), "fp32, every core"


def measure_matmul_peak(seconds: float = 1.0, size: int = 1024, threads: int | None = None,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> float:
    """FLOP/s of repeated ``size x size`` matmuls for about ``seconds`` (best of 3 rounds)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        a @ b  # warm-up
        best = 0.0
        for _ in range(3):
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / 3:
                a @ b
                count += 1
            if a.device.type == "cuda":
                torch.cuda.synchronize()
            best = max(best, 2 * size**3 * count / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(previous)
