"""The matmul peak, measured: what a job's model FLOP/s are a share of (the 4D paper's % of peak metric)."""

from __future__ import annotations

import time

import torch

from par4d.launch.host import cpu_cores

# A run measures the CPU's peak before it starts (best of 3 windows of 1/6 s, each some 18 products of 1024 x 1024
# on 2 cores); benchmarks take a second.
START_SECONDS = 0.5


def job_peak(device: torch.device, dtype: torch.dtype, devices: int) -> tuple[float, str]:
    """The job's matmul peak and what it is, in words. On a GPU: one device's in ``dtype`` (the training's
    compute dtype; products of 8192 x 8192, large enough to fill one) times the ``devices`` the job's ranks
    run on, one each. On the CPU: fp32 on every core, which the ranks share."""
    if device.type == "cuda":
        name = str(dtype).removeprefix("torch.")
        one = measure_matmul_peak(size=8192, dtype=dtype, device=device)
        return one * devices, f"{name}, {devices} x {torch.cuda.get_device_name(device)}"
    return measure_matmul_peak(START_SECONDS, threads=cpu_cores()), "fp32, every core"


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
