"""The ledger: what every collective on a grid moved, how long it was in flight, and how
long this rank waited for it.

Two times per collective: ``in_flight`` (from issue to completion) and ``seconds`` (how
long this rank was blocked waiting for it: the *exposed* communication). A synchronous
collective's two times are equal; an overlapped one's wait is shorter by the compute
it hid behind.

An :class:`Entry`'s ``elements`` is the per-rank message ``m`` of the ring model
(docs/architecture.md, "Collectives and the ledger"): the input shard for an
all-gather, the full input for a reduce-scatter, the buffer for an all-reduce or a
broadcast. Counts are exact, so tests pin them against the model's equations.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Entry:
    """One collective: its kind, the axes it spans, its per-rank message, when it was issued
    (``time.perf_counter()``), how long it was in flight and how long this rank waited;
    ``overlapped``: issued without waiting (waited for later, by a handle: an overlap's, or
    point-to-point), as opposed to waited for where issued; ``stage``: ``""`` for a flat collective,
    ``"node"`` or ``"link"`` for a stage of a staged one (par4d.staged: one entry per stage, each
    the collective that stage issues, over the axes the whole collective spans)."""

    kind: str
    axes: tuple[str, ...]
    elements: int
    bytes: int
    seconds: float = 0.0
    issued_at: float = 0.0
    in_flight: float = 0.0
    overlapped: bool = False
    stage: str = ""


@dataclass
class Total:
    count: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0
    in_flight: float = 0.0


class Watched(Protocol):
    def seen_done(self, now: float) -> bool:
        """Whether it completed; if so, its completion time ``now`` unless seen earlier."""


class Ledger:
    """Running totals per (kind, axes, stage), plus full entries while :meth:`capture` is on, and the
    collectives in flight whose completion :meth:`probe` looks for."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, tuple[str, ...], str], Total] = defaultdict(Total)
        self._captures: list[list[Entry]] = []
        self.watched: list[Watched] = []

    def probe(self) -> None:
        """Every watched collective that has completed, given its completion time (now: the first moment seen
        so, late by at most the time since the last probe) and no longer watched. Called where this rank's
        Python runs anyway (a collective issued or waited for, a gradient's hook): a callback on the backend's
        thread at completion would need the GIL there (a comm-bound data=4 step on 4 CPU ranks runs 0.4-0.8%
        faster without it, docs/benchmarks.md)."""
        if self.watched:
            now = time.perf_counter()
            self.watched = [w for w in self.watched if not w.seen_done(now)]

    def record(self, entry: Entry) -> None:
        total = self.totals[(entry.kind, entry.axes, entry.stage)]
        total.count += 1
        total.elements += entry.elements
        total.bytes += entry.bytes
        total.seconds += entry.seconds
        for captured in self._captures:
            captured.append(entry)

    def waited(self, entry: Entry, seconds: float, in_flight: float) -> None:
        """Book the wait (``seconds``) and the issue-to-completion time of an entry already
        recorded (async handles wait later)."""
        entry.seconds += seconds
        entry.in_flight += in_flight
        total = self.totals[(entry.kind, entry.axes, entry.stage)]
        total.seconds += seconds
        total.in_flight += in_flight

    @contextmanager
    def capture(self) -> Iterator[list[Entry]]:
        """Collect every entry recorded inside the ``with`` block into a list."""
        entries: list[Entry] = []
        self._captures.append(entries)
        try:
            yield entries
        finally:
            self._captures.remove(entries)

    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.totals.values())

    def total_seconds(self) -> float:
        """Seconds this rank waited for collectives (exposed communication)."""
        return sum(t.seconds for t in self.totals.values())


def in_flight_seconds(entries: list[Entry]) -> float:
    """Wall-clock seconds during which at least one of ``entries`` was in flight (the union
    of their issue-to-completion intervals: concurrent collectives count once)."""
    spans = sorted((e.issued_at, e.issued_at + e.in_flight) for e in entries)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def ring_terms(kind: str, ranks: int) -> tuple[float, float]:
    """(ring steps, volume factor) of a ring collective over ``ranks`` (the paper's Eqs 1-3): a rank
    sends ``factor * m`` for a per-rank message ``m``; time = steps * latency + factor * bytes / β."""
    if kind == "all_gather":
        return ranks - 1, ranks - 1
    if kind == "reduce_scatter":
        return ranks - 1, (ranks - 1) / ranks
    if kind == "all_reduce":
        return 2 * (ranks - 1), 2 * (ranks - 1) / ranks
    raise ValueError(f"unknown collective {kind!r}")
