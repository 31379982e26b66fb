"""Stopping a run on a scheduler's request: SIGTERM (preemption) or SIGINT (Ctrl-C).

The signal only sets a flag. At the end of every step the ranks agree (one all-reduce
of a single number) whether any of them was asked to stop; then every rank writes the
checkpoint of that step and returns, so the next run resumes with nothing lost.

What this cannot do: a Python handler runs only between bytecodes, so a rank blocked in
a collective sees the flag when the collective returns. A peer that died makes gloo's
collectives fail within seconds (the rank then exits with that error); where a
collective just hangs (NCCL with a dead peer), the launcher's own limit applies (torch's
elastic agent kills its workers 30 s after passing the signal on).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installs its handlers while used as a context manager (on the main thread)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():   # signal handlers live on the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:   # only a flag: safe whatever the main thread was doing
            self.signum = signum

    def agreed(self, device: torch.device) -> int | None:
        """Collective, once per step: the signal number when any rank was asked to stop, else None."""
        flag = torch.tensor([float(self.signum or 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None
