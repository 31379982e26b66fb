"""The cost model: the paper's communication model (Eqs 4-9 per layer, over the collectives'
costs of :mod:`par4d.plan.collectives`) and par4d's extensions (latency, compute, memory).

Three variants rank configurations:

* ``agnostic``: Eqs 4-9 with one bandwidth for every axis (the machine's β_inter),
* ``aware``: the same with Eq 10's placement-aware bandwidth per axis,
* ``full``: ``aware`` + a latency term per collective step, the collectives of the
  non-matmul layers (norm statistics, vocabulary-parallel loss, embeddings, bias
  gradients), compute time (each GEMM by its shard's shape, attention, the element-wise
  work and AdamW's pass, par4d/plan/compute.py), and memory per device:
  ``t_iter = t_compute + t_comm`` for the synchronous path, and with overlap
  settings ``t_iter = t_compute + t_exposed``: each overlapped collective hidden
  behind the compute it overlaps with (:func:`exposed_comm`).

A grid with ``pipe`` = P > 1 is a pipeline of P stages (par4d/pipeline/): each term
is the average stage's (1/P of the model), with M microbatches per step, the fill and
drain bubble and the stages' point-to-point hand-offs (:func:`predict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from par4d.overlap import Overlap
from par4d.plan.collectives import AXES4, across_nodes, bandwidths, collective_time, kind_scale, latencies, ring_time
from par4d.plan.compute import optimizer_seconds, stage_seconds, with_bubble
from par4d.plan.machines import Machine
from par4d.plan.terms import ROLES, exposed_comm, layer_terms
from par4d.plan.workload import GPTSpec, Layer, ModuleWorkload

VARIANTS = ("agnostic", "aware", "full")


@dataclass
class Prediction:
    sizes: dict[str, int]
    fits: bool = True
    excluded: str | None = None
    t_comm_axes: dict[str, float] = field(default_factory=dict)
    t_comm: float = 0.0
    t_compute: float = 0.0
    t_exposed: float | None = None   # communication not hidden by overlap (None: synchronous, all of t_comm)
    t_iter: float = 0.0
    mem_bytes: float = 0.0
    percent_of_peak: float = 0.0
    microbatches: int = 1            # per step: gradient accumulation, and the pipeline's
    t_p2p: float = 0.0               # the pipeline's fill and drain hand-offs (in t_comm and t_comm_axes["pipe"])
    t_sync: float = 0.0              # collectives' arrival cost (machine.sync_cost per call; in t_iter, never hidden)
    collectives: float = 0.0         # collectives a rank issues per step (the full model's; a ledger's count)
    checkpointing: bool = False      # activation recomputation
    overlap: str | None = None       # the overlaps assumed (Overlap.describe()); None: synchronous

    def ranking_time(self, variant: str) -> float:
        """What ``variant`` ranks by: iteration time (full), else communication time (as the paper)."""
        return self.t_iter if variant == "full" else self.t_comm

    def row(self) -> dict:
        return {**self.sizes, "pipe": self.sizes.get("pipe", 1), "microbatches": self.microbatches,
                "checkpointing": self.checkpointing, "overlap": self.overlap, "fits": self.fits,
                "excluded": self.excluded, "t_comm": self.t_comm,
                **{f"t_comm_{a}": self.t_comm_axes.get(a, 0.0) for a in AXES4}, "t_p2p": self.t_p2p,
                "t_sync": self.t_sync, "collectives": self.collectives, "t_compute": self.t_compute,
                "t_exposed": self.t_exposed, "t_iter": self.t_iter, "mem_bytes": self.mem_bytes,
                "percent_of_peak": self.percent_of_peak}


def _extra_role(kind: str, axes: tuple[str, ...]) -> str:
    """The role of one of :meth:`GPTSpec.extra_collectives`: the gradient sums over data (and
    z) are the data-parallel sync; the rest (norm statistics, loss, embedding gather and
    reduce-scatter) run where the layers need them, never overlapped."""
    if kind == "all_reduce" and "data" in axes:
        return "sync"
    return "forward" if kind == "all_gather" or axes == ("x",) else "backward"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def factorizations(world: int, pipes: tuple[int, ...] | None = None) -> list[dict[str, int]]:
    """Every (x, y, z, data) whose product is ``world``; with ``pipes``, every (x, y, z, data,
    pipe) whose product is ``world``, ``pipe`` among ``pipes``."""
    every = divisors(world)
    out = []
    for pipe in (1,) if pipes is None else (p for p in pipes if world % p == 0):
        rest = world // pipe
        for x in (d for d in every if rest % d == 0):
            for y in (d for d in every if (rest // x) % d == 0):
                for z in (d for d in every if (rest // (x * y)) % d == 0):
                    sizes = {"x": x, "y": y, "z": z, "data": rest // (x * y * z)}
                    out.append(sizes if pipes is None else {**sizes, "pipe": pipe})
    return out


def problem(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int]) -> str | None:
    """Why ``spec`` cannot run on grid ``sizes`` (its own rules, and a stage per block at least), or None."""
    reason = spec.check(sizes)
    pipe = sizes.get("pipe", 1)
    if reason is None and pipe > 1 and pipe > spec.n_layer:          # as GPTConfig.stage_blocks
        reason = f"pipe={pipe}: each stage needs at least one of the n_layer={spec.n_layer} blocks"
    return reason


def memory_bytes(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], bytes_per_element: int,
                 checkpointing: bool, microbatches: int, overlap: Overlap | None,
                 offload_bsize: int | None) -> float:
    """Bytes per device (the full model's): 1/P of the model's state and weights, with the
    activations of the microbatches the first stage holds at once, min(P, M) of M."""
    pipe = sizes.get("pipe", 1)
    share = min(pipe, microbatches) / microbatches
    return spec.memory_per_device(sizes, bytes_per_element, checkpointing, share=share, overlap=overlap,
                                  offload_bsize=offload_bsize) / pipe


def predict(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], machine: Machine, variant: str = "full",
            checkpointing: bool = False, compute_seconds: float | None = None,
            overlap: Overlap | None = None, microbatches: int | None = None,
            offload_bsize: int | None = None, terms: Communication | None = None) -> Prediction:
    """Time and memory of one iteration of ``spec`` on grid ``sizes``. The full model
    takes its compute time from ``compute_seconds`` when given (profiled on this
    machine, measure/profile.py; with a pipeline, one stage's compute per step), else from
    :func:`~par4d.plan.compute.stage_seconds` (GEMMs by shape); with ``overlap`` it counts only the communication left
    exposed (:func:`exposed_comm`), and its memory holds what the overlaps keep (prefetched
    and cached weights).

    ``microbatches`` = M (default: ``pipe``) cuts the step's batch shard into M pieces: every
    microbatch's forward re-gathers the weights over z and its backward reduce-scatters their
    gradients (Algorithm 1, once per microbatch), the activation collectives move the step's
    rows in M pieces, the data-parallel sync and the optimizer run once per step, and the
    activations held are those of one microbatch (gradient accumulation, ``par4d train
    --microbatches`` on any grid). ``sizes["pipe"]`` = P > 1 (par4d's GPT only) runs them
    through P stages, each taken as the average one (1/P of the model's layers, FLOPs and
    parameters): its compute times the bubble (M + P - 1) / M (:func:`~par4d.plan.compute.with_bubble`);
    2 (P - 1) hand-offs of one microbatch's residual stream shard (fill and drain: ``t_p2p``; 2 M where
    ranks share cores, :func:`p2p_seconds`); the activations of min(P, M) microbatches (the first stage's).
    Without a pipe key, or with P = M = 1, the prediction is the 4D one. ``offload_bsize``: the optimizer
    offloaded to the CPU (the async-pipeline paper's ``4φ + 16 bsize`` bytes on the device instead of the
    states). ``terms``: this grid's :func:`communication` at M microbatches, already computed (the search's)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if compute_seconds is not None and variant != "full":
        raise ValueError(f"compute_seconds is for the 'full' model; the '{variant}' model has no compute time")
    pipe = sizes.get("pipe", 1)
    micro = pipe if microbatches is None else microbatches
    if pipe < 1 or micro < 1:
        raise ValueError(f"pipe={pipe}, microbatches={micro}: both must be >= 1")
    if pipe > 1 and not isinstance(spec, GPTSpec):
        raise ValueError(f"pipe={pipe}: the pipeline is modelled for par4d's GPT (a GPTSpec) only, whose "
                         f"stages hand on its residual stream; {spec.name!r} is a recorded module")
    pred = Prediction(dict(sizes), microbatches=micro, checkpointing=checkpointing,
                      overlap=overlap.describe() if overlap is not None and variant == "full" else None)
    reason = problem(spec, sizes)
    if reason:
        pred.fits, pred.excluded = False, reason
        return pred
    shard = spec.samples // (sizes["z"] * sizes["data"])              # samples per data x z shard
    if micro > shard:
        raise ValueError(f"microbatches={micro}: a data x z shard has {shard} sequences (global batch "
                         f"{spec.samples} over z*data={sizes['z'] * sizes['data']}); give 1 to {shard}")
    full = variant == "full"
    if full:
        pred.mem_bytes = memory_bytes(spec, sizes, machine.bytes_per_element, checkpointing, micro, overlap,
                                      offload_bsize)
        if pred.mem_bytes > machine.memory_bytes:
            pred.fits = False
            pred.excluded = (f"needs {pred.mem_bytes / 1e9:.1f} GB per device, "
                             f"{machine.name} has {machine.memory_bytes / 1e9:.0f} GB")
    comm = communication(spec, sizes, machine, variant, micro) if terms is None else terms
    # a profiled step's compute has its optimizer in it
    optimizer = optimizer_seconds(spec, sizes, machine, offload_bsize) if full and compute_seconds is None else 0.0
    return _timed(pred, spec, sizes, machine, full, checkpointing, compute_seconds, overlap, comm, optimizer)


@dataclass(frozen=True)
class Communication:
    """What one iteration communicates on a grid with M microbatches, whatever the recomputation and
    overlap settings: seconds per axis and per role (:data:`ROLES`), the z gathers, the bytes the
    data-parallel sync moves, the pipeline's fill and drain hand-offs, and how many collectives the rank issues."""

    axes: dict[str, float]
    roles: dict[str, float]
    gathers: float
    grad_bytes: float
    t_p2p: float
    calls: float = 0.0     # collectives a step issues on a rank, the data sync and the hand-offs aside,
    xy_calls: float = 0.0  # of them the layers' all-reduces over x and y (``xy`` issues each in row chunks)
    # What a recomputed forward issues again beyond the gathers: its layers' sums over x and y and its norms'
    # gathers over y (seconds per role and per axis, calls as above).
    redo_roles: dict[str, float] = field(default_factory=dict)
    redo_axes: dict[str, float] = field(default_factory=dict)
    redo_calls: float = 0.0
    redo_xy_calls: float = 0.0
    # The latency (ring steps x α) of one pass of the layers' all-reduces over x and y, per (role, axis): ``xy``'s
    # row chunks pay it once per chunk. ``redo_xy_latency``: a recomputed forward's sums.
    xy_latency: dict[tuple[str, str], float] = field(default_factory=dict)
    redo_xy_latency: dict[tuple[str, str], float] = field(default_factory=dict)


def communication(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], machine: Machine, variant: str,
                  micro: int) -> Communication:
    """The communication terms of :func:`predict` (they do not depend on recomputation or overlap, so
    the search computes them once per grid and microbatch count)."""
    full = variant == "full"
    pipe = sizes.get("pipe", 1)
    b = machine.bytes_per_element
    beta = bandwidths(sizes, machine, aware=variant != "agnostic")
    alpha = latencies(sizes, machine) if full else dict.fromkeys(beta, 0.0)
    across = across_nodes(sizes, machine)
    axes = {a: 0.0 for a in beta}                                       # pipe only where sizes names it
    roles = {r: 0.0 for r in ROLES}
    gathers = calls = xy_calls = redo_calls = redo_xy_calls = 0
    redo_roles, redo_axes = {"in_sum": 0.0, "forward": 0.0}, {"x": 0.0, "y": 0.0}   # sums over x, y; norms over y
    xy_latency = {(role, axis): 0.0 for role in ("in_sum", "input_grad") for axis in ("x", "y")}
    redo_xy_latency = {("in_sum", axis): 0.0 for axis in ("x", "y")}
    for layer in spec.layers():
        piece = layer if micro == 1 else Layer(layer.name, layer.m / micro, layer.k, layer.n, layer.transposed,
                                               layer.count)                 # the layer on one microbatch's rows
        for (axis, role), t in layer_terms(piece, sizes, beta, b, alpha, machine if full else None, not full,
                                              across).items():
            if not t:                   # an axis of one rank: no collective
                continue
            # The stage's 1/P of the layers; the data sync once per step, the rest once per microbatch.
            share = (1 if role == "sync" else micro) / pipe
            axes[axis] += t * share
            roles[role] += t * share
            if role == "sync":
                continue
            calls += layer.count * share
            if role in ("in_sum", "input_grad"):
                xy_calls += layer.count * share
                latency = ring_time("all_reduce", sizes[axis], 0.0, beta[axis], alpha[axis]) * layer.count * share
                xy_latency[role, axis] += latency
                if role == "in_sum" and layer.name not in spec.NOT_RECOMPUTED:
                    redo_roles["in_sum"] += t * share
                    redo_axes[axis] += t * share
                    redo_xy_calls += layer.count * share
                    redo_xy_latency[role, axis] += latency
        gathers += layer.count * micro / pipe if sizes["z"] > 1 else 0
    grad_bytes = 0.0
    if full:
        weights = sum(layer.k * layer.n * layer.count for layer in spec.layers())
        extras = spec.extra_collectives(sizes) + [   # par4d's data sync: one bucketed all-reduce
            ("all_reduce", ("data",), weights / (sizes["x"] * sizes["y"] * sizes["z"]), 1, 0)]
        for kind, axis_group, elements, count, again in extras:
            role = _extra_role(kind, axis_group)
            if role == "sync":
                elements /= pipe                    # the stage's own parameters, once per step
            else:
                count *= micro / pipe               # the stage's share, once per microbatch
                if axis_group != ("z",):            # over z alone: the embeddings' weights; else activations
                    elements /= micro
            ranks = 1
            for axis in axis_group:
                ranks *= sizes[axis]
            slowest = min(beta[a] for a in axis_group) * kind_scale(kind, machine, any(across[a] for a in axis_group))
            one = collective_time(kind, tuple(axis_group), sizes, elements * b, slowest,
                                  max(alpha[a] for a in axis_group), machine)
            t = one * count
            axes[axis_group[-1]] += t
            roles[role] += t
            if again:                               # re-issued by a recomputed forward, where the layers' are
                again *= micro / pipe
                redo_roles[role] += one * again
                redo_axes[axis_group[-1]] += one * again
                redo_calls += again if ranks > 1 else 0
            # gradient sums over data alone ride in the sync's buckets (counted in _timed), over z and data not
            if ranks > 1 and not (role == "sync" and (axis_group == ("data",) or sizes["z"] == 1)):
                calls += count
            if "data" in axis_group and kind == "all_reduce" and ranks > 1:
                grad_bytes += elements * b
    t_p2p = 0.0
    if pipe > 1:
        t_p2p = axes["pipe"] = p2p_seconds(spec, sizes, machine, micro, alpha["pipe"], beta["pipe"])
    return Communication(axes, roles, gathers, grad_bytes, t_p2p, calls, xy_calls, redo_roles, redo_axes,
                         redo_calls + redo_xy_calls, redo_xy_calls, xy_latency, redo_xy_latency)


def p2p_seconds(spec: GPTSpec, sizes: dict[str, int], machine: Machine, micro: int, alpha: float,
                beta: float) -> float:
    """The pipeline's hand-offs on the critical path: on a device, fill and drain, P - 1 hand-offs of one
    microbatch's stream shard (rows, seq, n_embd / G_y) each way; where ranks time-share the cores
    (``machine.cores_shared``) a hand-off takes cores the compute needs wherever it happens, so a stage's own,
    one each way per microbatch (M), all count, each at what it costs inside a node: its copies. A hand-off's
    wait on a slower link is absorbed as the bubble is (one stage waits while the others use the cores),
    unlike a collective's, which all its ranks wait for at once."""
    shard = spec.samples // (sizes["z"] * sizes["data"])
    stream = shard / micro * spec.seq_len * spec.hidden / sizes["y"] * machine.bytes_per_element
    if machine.cores_shared > 1:
        return 2 * micro * (machine.latency + stream / machine.beta_intra)
    return 2 * (sizes["pipe"] - 1) * (alpha + stream / beta)


class CommunicationByCount:
    """The full model's :func:`communication` on one grid at any microbatch count, computed at most twice.

    On a machine whose collectives do not go in stages every term is affine in M (the weights'
    collectives M times, the activations' the same bytes in M pieces, each piece paying its latency, the
    sync once), so two computed counts give every other term; the hand-offs (a term in 1/M) are computed. A
    staged machine's collectives (the faster of two ways) are computed at every count."""

    def __init__(self, spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], machine: Machine):
        self.spec, self.sizes, self.machine = spec, sizes, machine
        self.known: dict[int, Communication] = {}

    def at(self, micro: int) -> Communication:
        if micro not in self.known:
            self.known[micro] = (communication(self.spec, self.sizes, self.machine, "full", micro)
                                 if self.machine.staged or len(self.known) < 2 else self._between(micro))
        return self.known[micro]

    def _between(self, micro: int) -> Communication:
        (low, first), (high, last) = list(self.known.items())[:2]
        share = (micro - low) / (high - low)

        def between(a, b):
            if isinstance(a, dict):
                return {key: a[key] + (b[key] - a[key]) * share for key in a}
            return a + (b - a) * share

        terms = {f.name: between(getattr(first, f.name), getattr(last, f.name)) for f in fields(Communication)}
        if self.sizes.get("pipe", 1) > 1:                       # the hand-offs: a term in 1/M, computed
            alpha = latencies(self.sizes, self.machine)["pipe"]
            beta = bandwidths(self.sizes, self.machine, aware=True)["pipe"]
            terms["t_p2p"] = terms["axes"]["pipe"] = p2p_seconds(self.spec, self.sizes, self.machine, micro,
                                                                 alpha, beta)
        return Communication(**terms)


def timed_choice(spec: GPTSpec | ModuleWorkload, sizes: dict[str, int], machine: Machine, checkpointing: bool,
                 micro: int, overlap: Overlap | None, mem_bytes: float, t_stage: float,
                 terms: Communication, optimizer: float) -> Prediction:
    """The full model's prediction of a choice that fits, from what the search already knows of it: its
    memory, one stage's compute per step, its optimizer's pass and its communication terms (what :func:`predict`
    computes)."""
    pred = Prediction(dict(sizes), microbatches=micro, checkpointing=checkpointing, mem_bytes=mem_bytes,
                      overlap=overlap.describe() if overlap is not None else None)
    return _timed(pred, spec, sizes, machine, True, checkpointing, t_stage, overlap, terms, optimizer)


SYNCHRONOUS = Overlap.none()


def bucket_count(grad_bytes: float, overlap: Overlap | None) -> int:
    """The data-parallel sync's buckets: as many with the overlap off (it only waits for them at the end); a first
    one of at most 1 MB where buckets are larger (par4d.optim.data_parallel, as DDP's)."""
    bucket = (overlap or SYNCHRONOUS).bucket_bytes
    return math.ceil(grad_bytes / bucket) + (1 if grad_bytes > 2**20 and bucket > 2**20 else 0)


def priced(overlap: Overlap) -> Overlap | None:
    """What the predictions take for ``overlap``: None (the synchronous path, in DDP's buckets) where no switch is
    on and the buckets are DDP's, else the set itself (with no switch on, the same step, in its own buckets)."""
    return overlap if overlap.names or overlap.bucket_bytes != SYNCHRONOUS.bucket_bytes else None


def _timed(pred: Prediction, spec, sizes: dict[str, int], machine: Machine, full: bool, checkpointing: bool,
           compute_seconds: float | None, overlap: Overlap | None, comm: Communication,
           optimizer: float = 0.0) -> Prediction:
    """``pred`` with its times: ``comm`` and the compute (with the bubble, then ``optimizer``, its pass once a
    step), with what the overlaps hide."""
    pipe, micro = sizes.get("pipe", 1), pred.microbatches
    pred.t_p2p = comm.t_p2p
    pred.t_comm_axes = dict(comm.axes)
    roles = dict(comm.roles)
    if full and checkpointing:
        if not (overlap is not None and overlap.cache):
            pred.t_comm_axes["z"] += comm.roles["gather"]   # the recomputed forward gathers the weights again
        for axis, t in comm.redo_axes.items():              # and sums over x and y, and norms' statistics
            pred.t_comm_axes[axis] += t
        roles = {r: t + comm.redo_roles.get(r, 0.0) for r, t in comm.roles.items()}
    chunks = overlap.row_chunks if overlap is not None and overlap.xy else 1
    if full and chunks > 1:                 # each row chunk of an x/y sum pays the ring's latency again
        for (role, axis), t in (*comm.xy_latency.items(), *(comm.redo_xy_latency.items() if checkpointing else ())):
            roles[role] += t * (chunks - 1)
            pred.t_comm_axes[axis] += t * (chunks - 1)
    pred.t_comm = sum(pred.t_comm_axes.values())
    world = sizes["x"] * sizes["y"] * sizes["z"] * sizes["data"] * pipe
    flops = spec.flops_per_iteration(checkpointing)
    t_stage = 0.0                                                       # one stage's compute per step
    if full:
        t_stage = compute_seconds if compute_seconds is not None else stage_seconds(spec, sizes, machine,
                                                                                    checkpointing, micro)
        pred.t_compute = with_bubble(t_stage, micro, pipe, machine) + optimizer   # the fill and drain, then AdamW
    buckets = bucket_count(comm.grad_bytes, overlap)
    if full:
        # Every collective waits for the last rank to reach it, a cost no overlap hides (calibrate measures it):
        # the layers' and extras' calls (the x/y ones in row chunks under xy), the recomputed forward's gathers,
        # the sync's buckets, the hand-offs on the path and the loss summed over the stages once.
        regathers = comm.gathers if checkpointing and not (overlap is not None and overlap.cache) else 0
        hand_offs = 2 * (micro if machine.cores_shared > 1 else pipe - 1) + 1 if pipe > 1 else 0
        redone = comm.redo_calls + comm.redo_xy_calls * (chunks - 1) if checkpointing else 0
        pred.collectives = (comm.calls + comm.xy_calls * (chunks - 1) + regathers + redone + hand_offs
                            + (buckets if sizes["data"] > 1 else 0))
        pred.t_sync = pred.collectives * machine.sync_cost
    pred.t_iter = pred.t_compute + pred.t_comm + pred.t_sync
    if full and overlap is not None:
        # Where ranks time-share the cores, the share of each collective that is CPU work takes cores the compute
        # needs: it never hides; the rest (waiting) hides as on a device.
        busy = machine.comm_cpu_share if machine.cores_shared > 1 else 0.0
        roles = {role: t * (1 - busy) for role, t in roles.items()}
        # The stage's collectives hide behind its own compute, not behind the bubble; the hand-offs never hide.
        pred.t_exposed = exposed_comm(roles, t_stage, overlap, comm.gathers, buckets, checkpointing) \
            + busy * (pred.t_comm - comm.t_p2p) + comm.t_p2p
        pred.t_iter = pred.t_compute + pred.t_exposed + pred.t_sync
    if pred.t_iter > 0:
        pred.percent_of_peak = 100 * flops / (pred.t_iter * world * machine.peak_flops)
    return pred


def rank_configurations(spec: GPTSpec | ModuleWorkload, world: int, machine: Machine, variant: str = "full",
                        checkpointing: bool = False,
                        overlap: Overlap | None = None) -> tuple[list[Prediction], list[Prediction]]:
    """(configurations that fit, ranked by predicted time; the excluded ones)."""
    preds = [predict(spec, sizes, machine, variant, checkpointing, overlap=overlap if variant == "full" else None)
             for sizes in factorizations(world)]
    fitting = sorted((p for p in preds if p.fits),
                     key=lambda p: (p.ranking_time(variant), p.sizes["x"], p.sizes["y"], p.sizes["z"]))
    return fitting, [p for p in preds if not p.fits]
