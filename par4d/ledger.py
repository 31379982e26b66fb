"""The ledger: what every collective on a grid moved and how long this rank waited for it.

An :class:`Entry`'s ``elements`` is the per-rank message ``m`` of the ring model
(docs/architecture.md, "Collectives and the ledger"): the input shard for an
all-gather, the full input for a reduce-scatter, the buffer for an all-reduce or a
broadcast. Counts are exact, so tests pin them against the model's equations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Entry:
    """One collective: its kind, the axes it spans, its per-rank message, time waited."""

    kind: str
    axes: tuple[str, ...]
    elements: int
    bytes: int
    seconds: float = 0.0


@dataclass
class Total:
    count: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Ledger:
    """Running totals per (kind, axes), plus full entries while :meth:`capture` is on."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, tuple[str, ...]], Total] = defaultdict(Total)
        self._captures: list[list[Entry]] = []

    def record(self, entry: Entry) -> None:
        total = self.totals[(entry.kind, entry.axes)]
        total.count += 1
        total.elements += entry.elements
        total.bytes += entry.bytes
        total.seconds += entry.seconds
        for captured in self._captures:
            captured.append(entry)

    def waited(self, entry: Entry, seconds: float) -> None:
        """Book ``seconds`` of waiting on an entry already recorded (async handles wait later)."""
        entry.seconds += seconds
        self.totals[(entry.kind, entry.axes)].seconds += seconds

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
        return sum(t.seconds for t in self.totals.values())
