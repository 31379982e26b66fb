"""What ``par4d bench pipeline`` reads off a step's timeline: each stage's forward and backward events
on one clock, what they held at once, the bubble, the hand-off time, and the plot of the timelines."""

from __future__ import annotations

import statistics
import textwrap
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn as nn


class Clock:
    """(kind, microbatch, start, end) of this rank's timed forward and backward calls.

    ``timed(fn)`` wraps a forward callable (sleeping ``delay()`` seconds first: the slow stage,
    jitter); every
    ``torch.autograd.backward`` is timed while :meth:`installed`. ``micro`` is the microbatch
    being worked on where the caller knows it (torch's stage methods set it); with
    ``count_forwards`` each forward call gets the next number instead (par4d's forwards, the
    numbers replaced after the step from the pipeline's own record of its order)."""

    def __init__(self):
        self.events: list[list] = []
        self.on = False
        self.micro: int | None = None
        self.count_forwards = False
        self.forwards = 0
        self._depth = 0

    def begin(self, count_forwards: bool) -> None:
        self.events, self.on, self.micro, self.count_forwards, self.forwards = [], True, None, count_forwards, 0

    def end(self) -> list[list]:
        self.on = False
        return self.events

    def timed(self, fn: Callable, delay: Callable[[], float] | None = None) -> Callable:
        def call(*args, **kwargs):
            if self.count_forwards:
                self.micro, self.forwards = self.forwards, self.forwards + 1
            began = time.perf_counter()
            if delay is not None:
                time.sleep(delay())
            out = fn(*args, **kwargs)
            if self.on:
                self.events.append(["F", self.micro, began, time.perf_counter()])
            return out
        return call

    @contextmanager
    def installed(self):
        original = torch.autograd.backward

        def backward(*args, **kwargs):
            self._depth += 1
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self.on and self._depth == 0:
                    self.events.append(["B", self.micro, began, time.perf_counter()])

        torch.autograd.backward = backward
        try:
            yield self
        finally:
            torch.autograd.backward = original


@contextmanager
def saved_bytes(clock: Clock, params: nn.Module):
    """Bytes saved for backward per microbatch (``clock.micro``) while inside: each storage
    counted once per microbatch, parameters' storages left out."""
    skip = {p.untyped_storage().data_ptr() for p in params.parameters()}
    per_micro: dict = {}
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        mine = seen.setdefault(clock.micro, set())
        if ptr not in skip and ptr not in mine:
            mine.add(ptr)
            per_micro[clock.micro] = per_micro.get(clock.micro, 0) + storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield per_micro


def held_at_once(events: list[list]) -> int:
    """The most microbatches held at once: each from the start of its first forward call to the
    end of its backward."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for kind, micro, s, e in events:
        if kind == "F":
            start[micro] = min(start.get(micro, s), s)
        else:
            end[micro] = max(end.get(micro, e), e)
    points = sorted([(t, 1) for t in start.values()] + [(t, -1) for t in end.values()], key=lambda p: (p[0], p[1]))
    held = most = 0
    for _, change in points:
        held += change
        most = max(most, held)
    return most


def bubble(events: list[list], piped: float) -> float:
    compute = sum(e - s for _, _, s, e in events)
    return min(1.0, max(0.0, 1.0 - compute / piped))


def merged(events: list[list]) -> list[tuple]:
    """Consecutive calls of one (kind, microbatch) as one bar (the last stage's forward and loss)."""
    out: list[list] = []
    for kind, micro, s, e in events:
        if out and out[-1][0] == kind and out[-1][1] == micro:
            out[-1][3] = e
        else:
            out.append([kind, micro, s, e])
    return [tuple(e) for e in out]


def one_clock(per_stage: list[dict], i: int) -> list[tuple]:
    """Timed iteration ``i`` of every stage as (stage, kind, microbatch, start, end), on one clock
    (see the module docstring) from the first rank's return from the barrier."""
    origin = min(r["iterations"][i][0] for r in per_stage)
    events = []
    for r in per_stage:
        began, calls = r["iterations"][i]
        events += [(r["stage"], kind, micro, start + began - origin, end + began - origin)
                   for kind, micro, start, end in calls]
    return sorted(events, key=lambda e: (e[0], e[3]))


def handoff_ms(iterations: list[list[tuple]], stages: int) -> float | None:
    """Median milliseconds from the end of a stage's call that produced a message (forward m on
    stage s, backward m on stage s+1) to the start of the call on the receiving stage that used it,
    over the messages the receiver was idle for (nothing of its own ran in between): what handing a
    microbatch on costs on the critical path (send, receive, the receiver's wake-up)."""
    gaps = []
    for events in iterations:
        calls = {(stage, kind, micro): (start, end) for stage, kind, micro, start, end in events}
        ends = {stage: sorted(end for s, _, _, _, end in events if s == stage) for stage in range(stages)}
        for (stage, kind, micro), (start, _) in calls.items():
            source = (stage - 1, "F", micro) if kind == "F" else (stage + 1, "B", micro)
            if source not in calls:          # the first stage's forwards, the last stage's backwards
                continue
            sent = calls[source][1]
            if not any(sent < end < start for end in ends[stage]):
                gaps.append(start - sent)
    return 1e3 * statistics.median(gaps) if gaps else None


def best_torch(rows: list[dict]) -> dict:
    return min((r for r in rows if r["framework"] == "torch"), key=lambda r: r["s_per_iter"])


def plot(timelines: dict[str, list[tuple]], rows: list[dict], path: str, title: str = "") -> None:
    """One iteration's timeline per stage: par4d's and the fastest torch schedule's, one panel each,
    forwards light and backwards dark, each bar labelled with its microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["par4d", best_torch(rows)["name"]]
    stages = rows[0]["stages"]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.0 + 0.55 * stages * len(names)), sharex=True,
                             squeeze=False)
    colors = {"F": "#9ecae1", "B": "#dd8452"}
    for ax, name in zip(axes[:, 0], names):
        events = timelines[name]
        span = max((e[4] for e in events), default=1.0)
        for stage, kind, micro, start, end in events:
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (stage - 0.4, 0.8), facecolors=colors[kind],
                           edgecolors="black", linewidth=0.3)
            if end - start > 0.012 * span:
                ax.text((start + end) / 2 * 1e3, stage, str(micro), ha="center", va="center", fontsize=7)
        row = next(r for r in rows if r["name"] == name)
        ax.set_title(f"{name}: {row['s_per_iter']:.3f} s/iter (median), bubble {row['bubble_fraction']:.2f} "
                     f"(worst stage)", fontsize=9)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)], fontsize=8)
        ax.set_ylim(stages - 0.5, -0.5)
    axes[-1, 0].set_xlabel("ms from the step's start (the first rank's return from a barrier; one clock for all)")
    handles = [matplotlib.patches.Patch(color=c, label="forward" if k == "F" else "backward")
               for k, c in colors.items()]
    fig.legend(handles=handles, fontsize=8, loc="lower right", ncol=2)     # below the panels: no bar hidden
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
