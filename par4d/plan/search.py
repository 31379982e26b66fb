"""The planner's search: every choice a user of ``par4d train`` can make for a workload on a
number of devices, ranked by the full model's predicted step time.

A user chooses the five axes (x, y, z, data, pipe), the microbatches per step, activation
recomputation, and each overlap switch. For every grid the search keeps the fastest choice
that fits in memory, found without timing every combination where the model says which is
faster (each step below is tested against the brute-force search in tests/test_plan_search.py):

* **Overlap switches**: each switch hides more communication, never less
  (:func:`~par4d.plan.terms.exposed_comm`), and only two cost memory: OAG's prefetched
  weights and the cache's gathered ones under recomputation. So the best set is every
  switch, then without the cache, then without OAG: the first that fits. One switch issues
  more collectives: xy's row chunks, each paying the ring's latency and ``sync_cost``; where
  collectives cost either, the first set that fits is timed with and without xy.
* **Microbatches without a pipeline**: M microbatches pay M times the weight collectives and
  the activation collectives' latency, for compute no less (smaller GEMMs), so more is never
  faster; the best is the fewest that fit. With a pipeline, more microbatches shrink the bubble, and
  every count (each divisor of the batch shard: equal microbatches) is timed.
* **Recomputation**: on and off are both timed (it costs compute, saves memory).

:func:`search_top` ranks only the first few grids, and skips every grid whose floor (no choice on it is
faster) is slower than the few it has: the same first rows, in a fraction of the time on large machines.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from functools import cached_property

from par4d.overlap import Overlap, check_bucket_mb
from par4d.plan.collectives import bandwidths, latencies
from par4d.plan.compute import optimizer_seconds, stage_seconds, with_bubble
from par4d.plan.cost import (
    CommunicationByCount,
    Prediction,
    bucket_count,
    divisors,
    factorizations,
    memory_bytes,
    p2p_seconds,
    predict,
    priced,
    problem,
    timed_choice,
)
from par4d.plan.machines import Machine
from par4d.plan.workload import GPTSpec, ModuleWorkload

# The overlap sets the search tries, fastest first (the cache needs recomputation).
WITH_RECOMPUTE = (Overlap.parse("oar,ors,oag,dp,cache,xy,ep,cp"), Overlap.parse("oar,ors,oag,dp,xy,ep,cp"),
                  Overlap.parse("oar,ors,dp,xy,ep,cp"))
WITHOUT_RECOMPUTE = (Overlap.parse("oar,ors,oag,dp,xy,ep,cp"),)


@dataclass(frozen=True)
class Space:
    """What the search may choose; ``None`` searches, a value fixes the choice.

    ``pipe``: stages (searched: every divisor of the world up to the model's blocks);
    ``microbatches`` per step; ``checkpointing``: recomputation on or off; ``overlap``: the
    switches (:class:`Overlap`; ``Overlap.none()`` for the synchronous path);
    ``offload_bsize``: the optimizer offloaded to the CPU in buckets of this many elements;
    ``bucket_mb``: the data-parallel sync's buckets in every set tried (None: a given ``overlap``'s, else
    DDP's 25 MB)."""

    pipe: int | None = None
    microbatches: int | None = None
    checkpointing: bool | None = None
    overlap: Overlap | None = None
    offload_bsize: int | None = None
    bucket_mb: float | None = None

    def __post_init__(self) -> None:
        for name in ("pipe", "microbatches", "offload_bsize"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1 (or searched)")
        if self.bucket_mb is not None:
            check_bucket_mb(self.bucket_mb, "Space(bucket_mb=)")

    @cached_property
    def overlap_sets(self) -> dict[tuple[bool, bool], tuple[Overlap, ...]]:
        """(recomputation, a pipeline) -> the overlap sets to try, fastest first (their memory never grows down
        the list); in a pipeline, what acts there (par4d.train.config.TrainConfig.overlap_run). Computed once:
        the search asks for them per grid and choice."""
        table = {}
        for checkpointing in (False, True):
            sets = (self.overlap,) if self.overlap is not None else (
                WITH_RECOMPUTE if checkpointing else WITHOUT_RECOMPUTE)
            if self.bucket_mb is not None:
                sets = tuple(replace(overlap, bucket_mb=self.bucket_mb) for overlap in sets)
            table[checkpointing, False] = sets
            table[checkpointing, True] = tuple(dict.fromkeys(overlap.in_pipeline() for overlap in sets))
        return table


def search(spec: GPTSpec | ModuleWorkload, world: int, machine: Machine,
           space: Space | None = None) -> tuple[list[Prediction], list[Prediction]]:
    """(every grid's fastest fitting choice, ranked by predicted step time; the grids where
    nothing fits, each with its smallest footprint or the reason it cannot run)."""
    ranked, excluded, _ = _search(spec, world, machine, space, None)
    return ranked, excluded


def search_top(spec: GPTSpec | ModuleWorkload, world: int, machine: Machine, space: Space | None = None,
               top: int = 10) -> tuple[list[Prediction], list[Prediction], int]:
    """(the ``top`` fastest grids' choices: :func:`search`'s first ``top``, the same predictions in the same
    order; the grids where nothing fits, as :func:`search`'s; how many grids have a choice that fits).

    A grid is timed only where its floor (:meth:`_Grid.floor`: no choice on it is faster) is under the
    ``top``-th step time found so far: grids go in the order of their floors, the cheap one (compute) first,
    then the one with the grid's communication, and the search stops where the least floor left is slower.
    Every grid is still checked to fit. (tests/test_plan_search.py checks the result against :func:`search`
    and both floors against brute force.)"""
    if top < 1:
        raise ValueError(f"top={top}: must be >= 1")
    return _search(spec, world, machine, space, top)


def _search(spec, world: int, machine: Machine, space: Space | None,
            top: int | None) -> tuple[list[Prediction], list[Prediction], int]:
    space = Space() if space is None else space      # a Space of its own: it caches its overlap sets
    if isinstance(spec, GPTSpec):
        pipes = (space.pipe,) if space.pipe is not None else tuple(p for p in range(1, spec.n_layer + 1))
    else:
        if space.pipe not in (None, 1):
            raise ValueError(f"pipe={space.pipe}: the pipeline is modelled for par4d's GPT only")
        pipes = (1,)
    recompute = (False, True) if space.checkpointing is None else (space.checkpointing,)
    ranked, excluded, waiting = [], [], []       # waiting: (floor, order, grid, floor has communication)
    for order, sizes in enumerate(factorizations(world, pipes)):
        grid = _Grid(spec, sizes, machine, space, recompute)
        if grid.reason is not None:
            excluded.append(Prediction(dict(sizes), fits=False, excluded=grid.reason))
        elif top is None or not grid.fits_somewhere():
            best = grid.best()       # every grid's (or one whose least footprint may still not fit: it says)
            (ranked if best.fits else excluded).append(best)
        else:
            waiting.append((grid.compute_floor(), order, grid, False))
    fitting = len(ranked) + len(waiting)
    heapq.heapify(waiting)
    slowest = [-p.t_iter for p in heapq.nsmallest(top, ranked, key=_rank)] if top else []
    heapq.heapify(slowest)           # the top fastest step times so far, negated: the top-th is slowest[0]
    while waiting:
        floor, order, grid, complete = heapq.heappop(waiting)
        if len(slowest) == top and floor > -slowest[0] * (1 + FLOOR_SLACK):
            break                    # no grid left is faster than the top-th found
        if not complete:
            heapq.heappush(waiting, (grid.floor(), order, grid, True))
            continue
        best = grid.best()
        ranked.append(best)
        if len(slowest) < top:
            heapq.heappush(slowest, -best.t_iter)
        elif best.t_iter < -slowest[0]:
            heapq.heapreplace(slowest, -best.t_iter)
    ranked.sort(key=_rank)
    return (ranked if top is None else ranked[:top]), excluded, fitting


# A floor and a step time computed in different orders of summation may differ in their last bits.
FLOOR_SLACK = 1e-9


def _rank(p: Prediction) -> tuple:
    return (p.t_iter, p.sizes["pipe"], p.sizes["x"], p.sizes["y"], p.sizes["z"])


def _with_and_without_xy(overlap: Overlap, machine: Machine) -> tuple[Overlap, ...]:
    """The sets to time where the first fits: each of xy's row chunks is a collective of its own, paying the ring's
    latency and ``sync_cost``, so where collectives cost either the set without xy (the same memory) can be the
    faster."""
    if overlap.xy and (machine.sync_cost or machine.latency or machine.latency_inter):
        return overlap, replace(overlap, xy=False, row_chunks=1)
    return (overlap,)


class _Grid:
    """One grid's choices: whether it can run, its fastest fitting choice, and floors under every choice's step
    time (each a sum of terms no choice on the grid goes under: :func:`search_top` skips a grid on them)."""

    def __init__(self, spec, sizes: dict[str, int], machine: Machine, space: Space, recompute: tuple[bool, ...]):
        self.spec, self.sizes, self.machine, self.space, self.recompute = spec, sizes, machine, space, recompute
        self.pipe = sizes.get("pipe", 1)
        self.reason = problem(spec, sizes)
        if self.reason is not None:
            return
        shard = spec.samples // (sizes["z"] * sizes["data"])
        if space.microbatches is not None and space.microbatches > shard:
            self.reason = f"microbatches={space.microbatches}: a data x z shard has {shard} samples"
            return
        self.counts = [space.microbatches] if space.microbatches is not None else divisors(shard)
        self.terms = CommunicationByCount(spec, sizes, machine)   # the same with and without recomputation
        # AdamW's pass, once a step (offloaded, through the host link too)
        self.optimizer = optimizer_seconds(spec, sizes, machine, space.offload_bsize)
        self.held: dict[tuple[bool, object], tuple[float, float]] = {}

    def sets(self, checkpointing: bool) -> tuple[Overlap, ...]:
        """The overlap sets to try, fastest first (their memory never grows down the list)."""
        return self.space.overlap_sets[checkpointing, self.pipe > 1]

    def footprint(self, checkpointing: bool, overlap: Overlap, micro: int) -> float:
        """:func:`memory_bytes`, from two evaluations per setting: only the activations depend on the count,
        in proportion to the share of the batch held at once (min(P, M) / M)."""
        if (checkpointing, overlap) not in self.held:
            spec, sizes, b, bsize = self.spec, self.sizes, self.machine.bytes_per_element, self.space.offload_bsize
            whole = memory_bytes(spec, sizes, b, checkpointing, 1, overlap, bsize)
            rest = spec.memory_per_device(sizes, b, checkpointing, share=0.0, overlap=overlap,
                                          offload_bsize=bsize) / self.pipe
            self.held[checkpointing, overlap] = (rest, whole - rest)
        rest, activations = self.held[checkpointing, overlap]
        return rest + activations * min(self.pipe, micro) / micro

    def fits_somewhere(self) -> bool:
        """Whether the choice that should hold the least fits: recomputation where it may be chosen, the last
        overlap set, the most microbatches. (False only says to look at every choice.)"""
        checkpointing = self.recompute[-1]
        return self.footprint(checkpointing, self.sets(checkpointing)[-1], max(self.counts)) \
            <= self.machine.memory_bytes

    def compute_floor(self) -> float:
        """No choice computes for less: its stage at the fewest microbatches (each GEMM at its largest, fewest
        kernels) and without recomputation where that may be chosen, with the bubble of the most."""
        t_stage = stage_seconds(self.spec, self.sizes, self.machine, self.recompute[0], min(self.counts))
        return with_bubble(t_stage, max(self.counts), self.pipe, self.machine) + self.optimizer

    def floor(self) -> float:
        """No choice's step is shorter: its compute and what no overlap it may choose hides (the collectives that
        never hide; of those that do, the first gather and the last reduce-scatter and bucket, the last row chunk's
        sums), or every collective (they hide behind the stage's compute at most), plus the hand-offs and each
        collective's arrival cost; each term at the count where it is least (all but the hand-offs grow with it)."""
        machine, pipe, few, many = self.machine, self.pipe, min(self.counts), max(self.counts)
        comm = self.terms.at(few)
        roles, gathers = comm.roles, comm.gathers
        sets = [overlap for checkpointing in self.recompute for overlap in self.sets(checkpointing)]
        on = {name for overlap in sets for name in overlap.names}
        chunks = max((overlap.row_chunks for overlap in sets if overlap.xy), default=1)
        buckets = max(bucket_count(comm.grad_bytes, overlap) for overlap in sets)
        exposed = (roles["forward"] + roles["backward"] + roles["in_sum"] / chunks
                   + (0.0 if "oar" in on else roles["input_grad"] / chunks)
                   + (roles["gather"] / gathers if "oag" in on and gathers else roles["gather"])
                   + (roles["reduce_scatter"] / gathers if "ors" in on and gathers else roles["reduce_scatter"])
                   + (roles["sync"] / buckets if "dp" in on and buckets else roles["sync"]))
        t_p2p, hand_offs = 0.0, 0
        if pipe > 1:
            alpha, beta = latencies(self.sizes, machine)["pipe"], bandwidths(self.sizes, machine, aware=True)["pipe"]
            t_p2p = min(comm.t_p2p, p2p_seconds(self.spec, self.sizes, machine, many, alpha, beta))
            hand_offs = 2 * (few if machine.cores_shared > 1 else pipe - 1) + 1
        return (max(self.compute_floor() + exposed, sum(roles.values())) + t_p2p
                + (comm.calls + hand_offs) * machine.sync_cost)

    def best(self) -> Prediction:
        """The fastest choice on the grid that fits; else the smallest footprint, or why it cannot run. Memory
        is checked before anything is timed, and with a pipeline a microbatch count whose compute with its
        bubble alone is slower than the best so far is not timed."""
        spec, sizes, machine, space, pipe = self.spec, self.sizes, self.machine, self.space, self.pipe
        if self.reason is not None:
            return Prediction(dict(sizes), fits=False, excluded=self.reason)
        counts = list(reversed(self.counts)) if pipe > 1 else self.counts
        # (with a pipeline the smallest bubble first: once one count's bound loses, every smaller one does)
        self.terms.at(min(self.counts))     # computed first whether or not a floor asked: the same sums either way
        best, smallest = None, None          # smallest: (bytes, checkpointing, microbatches, overlap)
        for checkpointing in self.recompute:
            # The least a stage computes: one microbatch (each GEMM at its largest, fewest kernels).
            t_least = stage_seconds(spec, sizes, machine, checkpointing)
            for micro in counts:
                if best is not None and with_bubble(t_least, micro, pipe, machine) >= best.t_iter:
                    break                               # its compute alone is slower, and fewer microbatches' too
                for overlap in self.sets(checkpointing):
                    need = self.footprint(checkpointing, overlap, micro)
                    if need > machine.memory_bytes:
                        if smallest is None or need < smallest[0]:
                            smallest = (need, checkpointing, micro, overlap)
                        continue
                    t_stage = t_least if micro == 1 else stage_seconds(spec, sizes, machine, checkpointing, micro)
                    for candidate in _with_and_without_xy(overlap, machine):
                        pred = timed_choice(spec, sizes, machine, checkpointing, micro,
                                            priced(candidate), need, t_stage,
                                            self.terms.at(micro), self.optimizer)
                        if best is None or pred.t_iter < best.t_iter:
                            best = pred
                    break                               # the first set that fits is the fastest
                else:
                    continue                            # nothing fits at this count: try more microbatches
                if pipe == 1:
                    break                               # without a pipeline the fewest that fit are the fastest
        if best is not None:
            return best
        _, checkpointing, micro, overlap = smallest
        return predict(spec, sizes, machine, "full", checkpointing, overlap=priced(overlap),
                       microbatches=micro, offload_bsize=space.offload_bsize)
