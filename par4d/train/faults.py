"""Fault injection for tests and ``par4d bench faults``: a rank dies, raises, or its launcher
is signalled, after a chosen step of a chosen attempt (the environment variable below)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

FAULT_ENV = "PAR4D_FAULTS"
"""A comma list of ``RANK:STEP[:KIND]``, its i-th entry acting on the job's attempt i (0: the
first; the elastic agent counts restarts), after that step. KIND ``KILL`` (the default): the
rank kills itself with SIGKILL. ``RAISE``: it raises an error (its peers are left waiting in a
collective). ``TERM``: it sends SIGTERM to its launcher (a scheduler's preemption) and waits
until the launcher passes the signal on, so the run stops after that step. ``TERM_RANK``: it sends
SIGTERM to itself alone (a user's ``kill`` of one rank)."""

FAULT_KINDS = ("KILL", "RAISE", "TERM", "TERM_RANK")


def parse_faults(spec: str) -> list[tuple[int, int, str]]:
    """``[(rank, step, kind)]`` of a :data:`FAULT_ENV` value."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fields = item.split(":")
        kind = fields[2].upper() if len(fields) == 3 else "KILL"
        if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields[:2]) or kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: give a comma list of RANK:STEP[:KIND], KIND one of "
                             f"{', '.join(FAULT_KINDS)}")
        faults.append((int(fields[0]), int(fields[1]), kind))
    return faults


@dataclass(frozen=True)
class Faults:
    planned: tuple[tuple[int, int, str], ...]

    @classmethod
    def from_env(cls) -> Faults:
        return cls(tuple(parse_faults(os.environ.get(FAULT_ENV, ""))))

    def after_step(self, rank: int, step: int, attempt: int, stop) -> None:
        """Act if this rank's ``step`` of ``attempt`` is planned; ``stop``: the rank's StopRequest."""
        if attempt >= len(self.planned) or self.planned[attempt][:2] != (rank, step):
            return
        kind = self.planned[attempt][2]
        if kind == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "RAISE":
            raise RuntimeError(f"fault injected by {FAULT_ENV} after step {step}")
        # TERM: the launcher, which signals every rank; TERM_RANK: this rank only
        os.kill(os.getppid() if kind == "TERM" else os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while stop.signum is None and time.monotonic() < deadline:
            time.sleep(0.01)
