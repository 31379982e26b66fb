"""The planner's search: every choice a user of ``par4d train`` can make for a workload on a
number of devices, ranked by the full model's predicted step time.

A user chooses the five axes (x, y, z, data, pipe), the microbatches per step, activation
recomputation, and each overlap switch. For every grid the search keeps the fastest choice
that fits in memory, found without timing every combination where the model says which is
faster (each step below is tested against the brute-force search in tests/test_plan_search.py):

* **Overlap switches**: each switch hides more communication, never less
  (:func:`~par4d.plan.model.exposed_comm`), and only two cost memory: OAG's prefetched
  weights and the cache's gathered ones under recomputation. So the best set is every
  switch, then without the cache, then without OAG: the first that fits. One switch issues
  more collectives: xy's row chunks; on a machine whose collectives cost ``sync_cost`` each
  the first set that fits is timed with and without xy.
* **Microbatches without a pipeline**: M microbatches pay M times the weight collectives and
  the activation collectives' latency, for compute no less (smaller GEMMs), so more is never
  faster; the best is the fewest that fit. With a pipeline, more microbatches shrink the bubble, and
  every count (each divisor of the batch shard: equal microbatches) is timed.
* **Recomputation**: on and off are both timed (it costs compute, saves memory).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from par4d.overlap import Overlap
from par4d.plan.compute import stage_seconds, with_bubble
from par4d.plan.machines import Machine
from par4d.plan.model import (
    CommunicationByCount,
    Prediction,
    factorizations,
    memory_bytes,
    predict,
    problem,
    timed_choice,
)
from par4d.plan.workload import GPTSpec, ModuleWorkload

# The overlap sets the search tries, fastest first (the cache needs recomputation).
WITH_RECOMPUTE = (Overlap.parse("oar,ors,oag,dp,cache,xy"), Overlap.parse("oar,ors,oag,dp,xy"),
                  Overlap.parse("oar,ors,dp,xy"))
WITHOUT_RECOMPUTE = (Overlap.parse("oar,ors,oag,dp,xy"),)
# What acts in a pipeline (par4d.train.config.TrainConfig.overlap_run): the same sets, fewer switches.
IN_PIPELINE = {sets: tuple(dict.fromkeys(overlap.in_pipeline() for overlap in sets))
               for sets in (WITH_RECOMPUTE, WITHOUT_RECOMPUTE)}


@dataclass(frozen=True)
class Space:
    """What the search may choose; ``None`` searches, a value fixes the choice.

    ``pipe``: stages (searched: every divisor of the world up to the model's blocks);
    ``microbatches`` per step; ``checkpointing``: recomputation on or off; ``overlap``: the
    switches (:class:`Overlap`; ``Overlap.none()`` for the synchronous path);
    ``offload_bsize``: the optimizer offloaded to the CPU in buckets of this many elements."""

    pipe: int | None = None
    microbatches: int | None = None
    checkpointing: bool | None = None
    overlap: Overlap | None = None
    offload_bsize: int | None = None

    def __post_init__(self) -> None:
        for name in ("pipe", "microbatches", "offload_bsize"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1 (or searched)")


def search(spec: GPTSpec | ModuleWorkload, world: int, machine: Machine,
           space: Space = Space()) -> tuple[list[Prediction], list[Prediction]]:
    """(every grid's fastest fitting choice, ranked by predicted step time; the grids where
    nothing fits, each with its smallest footprint or the reason it cannot run)."""
    if isinstance(spec, GPTSpec):
        pipes = (space.pipe,) if space.pipe is not None else tuple(p for p in range(1, spec.n_layer + 1))
    else:
        if space.pipe not in (None, 1):
            raise ValueError(f"pipe={space.pipe}: the pipeline is modelled for par4d's GPT only")
        pipes = (1,)
    recompute = (False, True) if space.checkpointing is None else (space.checkpointing,)
    ranked, excluded = [], []
    for sizes in factorizations(world, pipes):
        best = _best(spec, sizes, machine, space, recompute)
        (ranked if best.fits else excluded).append(best)
    ranked.sort(key=lambda p: (p.t_iter, p.sizes["pipe"], p.sizes["x"], p.sizes["y"], p.sizes["z"]))
    return ranked, excluded


def _with_and_without_xy(overlap: Overlap, machine: Machine) -> tuple[Overlap, ...]:
    """The sets to time where the first fits: xy's row chunks cost a collective each, and where collectives cost
    ``sync_cost`` beyond their time the set without xy (the same memory) can be the faster."""
    if machine.sync_cost and overlap.xy:
        return overlap, replace(overlap, xy=False, row_chunks=1)
    return (overlap,)


def _best(spec, sizes: dict[str, int], machine: Machine, space: Space, recompute: tuple[bool, ...]) -> Prediction:
    """The fastest choice on ``sizes`` that fits; else the smallest footprint, or why it cannot run.
    Memory is checked before anything is timed, and with a pipeline a microbatch count whose
    compute with its bubble alone is slower than the best so far is not timed."""
    pipe = sizes["pipe"]
    reason = problem(spec, sizes)
    if reason is not None:
        return Prediction(dict(sizes), fits=False, excluded=reason)
    shard = spec.samples // (sizes["z"] * sizes["data"])
    if space.microbatches is not None and space.microbatches > shard:
        return Prediction(dict(sizes), fits=False,
                          excluded=f"microbatches={space.microbatches}: a data x z shard has {shard} samples")
    counts = [space.microbatches] if space.microbatches is not None else [m for m in range(1, shard + 1)
                                                                           if shard % m == 0]
    if pipe > 1:
        counts.reverse()     # the smallest bubble first: once one count's bound loses, every smaller one does
    b, capacity = machine.bytes_per_element, machine.memory_bytes
    best, smallest = None, None          # smallest: (bytes, checkpointing, microbatches, overlap)
    terms = CommunicationByCount(spec, sizes, machine)   # the same with and without recomputation
    held: dict[tuple[bool, object], tuple[float, float]] = {}

    def footprint(checkpointing: bool, overlap, micro: int) -> float:
        """:func:`memory_bytes`, from two evaluations per setting: only the activations depend on the count,
        in proportion to the share of the batch held at once (min(P, M) / M)."""
        if (checkpointing, overlap) not in held:
            whole = memory_bytes(spec, sizes, b, checkpointing, 1, overlap, space.offload_bsize)
            rest = spec.memory_per_device(sizes, b, checkpointing, share=0.0, overlap=overlap,
                                          offload_bsize=space.offload_bsize) / pipe
            held[checkpointing, overlap] = (rest, whole - rest)
        rest, activations = held[checkpointing, overlap]
        return rest + activations * min(pipe, micro) / micro
    for checkpointing in recompute:
        sets = (space.overlap,) if space.overlap is not None else (
            WITH_RECOMPUTE if checkpointing else WITHOUT_RECOMPUTE)
        if pipe > 1:
            sets = IN_PIPELINE.get(sets) or (space.overlap.in_pipeline(),)
        # The least a stage computes: one microbatch (each GEMM at its largest, fewest kernels).
        t_least = stage_seconds(spec, sizes, machine, checkpointing)
        for micro in counts:
            if best is not None and with_bubble(t_least, micro, pipe, machine) >= best.t_iter:
                break                                   # its compute alone is slower, and fewer microbatches' too
            for overlap in sets:
                need = footprint(checkpointing, overlap, micro)
                if need > capacity:
                    if smallest is None or need < smallest[0]:
                        smallest = (need, checkpointing, micro, overlap)
                    continue
                t_stage = t_least if micro == 1 else stage_seconds(spec, sizes, machine, checkpointing, micro)
                for candidate in _with_and_without_xy(overlap, machine):
                    pred = timed_choice(spec, sizes, machine, checkpointing, micro,
                                        candidate if candidate.names else None, need, t_stage, terms.at(micro))
                    if best is None or pred.t_iter < best.t_iter:
                        best = pred
                break                                   # the first set that fits is the fastest
            else:
                continue                                # nothing fits at this count: try more microbatches
            if pipe == 1:
                break                                   # without a pipeline the fewest that fit are the fastest
    if best is not None:
        return best
    _, checkpointing, micro, overlap = smallest
    return predict(spec, sizes, machine, "full", checkpointing, overlap=overlap if overlap.names else None,
                   microbatches=micro, offload_bsize=space.offload_bsize)
