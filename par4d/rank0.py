"""Work that only rank 0 does, without leaving the other ranks waiting on a failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


class Rank0Failed(RuntimeError):
    """Raised on the other ranks when rank 0's work failed: rank 0's own error is the one to report."""


def on_rank0(fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on rank 0 and tell every rank whether it failed (collective).

    A failure (disk full, a bad path) is raised on every rank, so no rank is left
    in a later barrier until a timeout, whatever the launcher does.
    """
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # reported to all ranks, re-raised below
            error = exc
    status = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] is not None:
        raise Rank0Failed(f"rank 0 failed: {status[0]}")
    return result
