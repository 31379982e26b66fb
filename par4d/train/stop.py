"""Stopping a run on a scheduler's request: SIGTERM (preemption) or SIGINT (Ctrl-C).

The signal only sets a flag. At the end of every step the ranks agree (one all-reduce
of a single number) whether any of them was asked to stop; then every rank writes the
checkpoint of that step and returns, so the next run resumes with nothing lost.

A rank that does not reach the end of its step soon after the signal is stuck (in a
collective with a dead peer, say) and could never save: it exits at once, so a
launcher's teardown takes seconds, not a collective timeout.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
MIN_GRACE_S = 5.0     # the least a rank waits, after a signal, to reach the end of its step
STEPS_OF_GRACE = 3    # ... and at least this many times the longest it took from one check to the next


class StopRequest:
    """Installs its handlers while used as a context manager (on the main thread)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._agreed = threading.Event()
        self._grace = MIN_GRACE_S
        self._last_check: float | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():   # signal handlers live on the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        timer = threading.Timer(self._grace, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        if not self._agreed.is_set():
            os._exit(128 + (self.signum or signal.SIGTERM))

    def agreed(self, device: torch.device) -> int | None:
        """Collective, once per step: the signal number when any rank was asked to stop, else None."""
        now = time.monotonic()
        if self._last_check is not None:   # a step and whatever followed it (a checkpoint)
            self._grace = max(self._grace, STEPS_OF_GRACE * (now - self._last_check))
        self._last_check = now
        flag = torch.tensor([float(self.signum or 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum:
            self._agreed.set()
            return signum
        return None
