"""This host's resources: the cores a process may run on, its memory, the threads each local rank takes."""

from __future__ import annotations

import os


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
