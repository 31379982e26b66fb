"""The performance model: the paper's communication model (Eqs 1-10) and par4d's
extensions (latency, compute, memory).

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

from par4d.hierarchy import STAGE_MIN_BYTES
from par4d.ledger import ring_terms
from par4d.overlap import Overlap
from par4d.plan.compute import optimizer_seconds, stage_seconds, with_bubble
from par4d.plan.machines import Machine
from par4d.plan.workload import GPTSpec, Layer, ModuleWorkload

AXES4 = ("x", "y", "z", "data")
AXES5 = (*AXES4, "pipe")         # pipe outermost, as par4d.grid lays ranks out
VARIANTS = ("agnostic", "aware", "full")


def ring_time(kind: str, ranks: int, message_bytes: float, beta: float, latency: float = 0.0) -> float:
    """Eqs 1-3 (ring collectives) for a per-rank message, plus ``latency`` per ring step."""
    if ranks <= 1:
        return 0.0
    steps, factor = ring_terms(kind, ranks)
    return factor * message_bytes / beta + steps * latency


def bandwidths(sizes: dict[str, int], machine: Machine, aware: bool) -> dict[str, float]:
    """β per axis: x, y, z, data, and pipe where ``sizes`` names it. Placement-aware (Eq 10),
    hierarchy x, y, z, data, pipe (innermost first): a group inside a node gets β_intra (also
    requiring that groups tile the nodes); one that crosses nodes gets β_inter divided by
    the number of rings sharing the node's links, min(G_node, prod of inner sizes)."""
    axes = AXES5 if "pipe" in sizes else AXES4
    if not aware:
        return {a: machine.beta_inter for a in axes}
    far = across_nodes(sizes, machine)
    out, inner = {}, 1
    for axis in axes:
        out[axis] = machine.beta_inter / min(machine.devices_per_node, inner) if far[axis] else machine.beta_intra
        inner *= sizes[axis]
    return out


def across_nodes(sizes: dict[str, int], machine: Machine) -> dict[str, bool]:
    """Per axis (innermost first, as :func:`bandwidths` places them): whether its groups span nodes. A group is
    inside a node where its ranks fit in one and the groups tile the nodes (x=3 on 4-device nodes has a group that
    straddles two)."""
    axes = AXES5 if "pipe" in sizes else AXES4
    out, inner = {}, 1
    for axis in axes:
        span = inner * sizes[axis]
        out[axis] = not (span <= machine.devices_per_node and machine.devices_per_node % span == 0)
        inner *= sizes[axis]
    return out


def kind_scale(kind: str, machine: Machine | None, across: bool) -> float:
    """``kind``'s bandwidth relative to the all-reduce's β it is priced at: the profile's measured all-gather or
    reduce-scatter scale inside a node, or across nodes (its ``_inter`` scale where given); 1 for an all-reduce and
    without a machine."""
    if machine is None or kind == "all_reduce":
        return 1.0
    inside, far = ((machine.all_gather_scale, machine.all_gather_scale_inter) if kind == "all_gather" else
                   (machine.reduce_scatter_scale, machine.reduce_scatter_scale_inter))
    return far if across and far is not None else inside


def latencies(sizes: dict[str, int], machine: Machine) -> dict[str, float]:
    """α per ring step, per axis (the full model's): NCCL's own ring model (its ``tuning.cc``) pays
    the network's latency for the ``nodes - 1`` steps of a ring pass that cross nodes and the
    node's for the others, so a group pays, per step, ``latency`` plus the share ``(nodes - 1) /
    (G - 1)`` of ``latency_inter - latency``. Placement as :func:`bandwidths`: an axis's group
    has ``G_node / (product of the inner sizes)`` members per node (at least 1)."""
    axes = AXES5 if "pipe" in sizes else AXES4
    inter = machine.latency if machine.latency_inter is None else machine.latency_inter
    out, inner = {}, 1
    for axis in axes:
        g = sizes[axis]
        per_node = max(1, machine.devices_per_node // inner)
        nodes = -(-g // per_node)
        out[axis] = machine.latency + (inter - machine.latency) * ((nodes - 1) / (g - 1) if g > 1 else 0.0)
        inner *= g
    return out


def group_placement(sizes: dict[str, int], group: tuple[str, ...], devices_per_node: int) -> tuple[int, int, int]:
    """(inner, L, K) of a group of consecutive axes: the ranks between two of its members (the product of
    the inner axes' sizes), its members per node and the nodes it spans (ranks fill nodes in order)."""
    axes = AXES5 if "pipe" in sizes else AXES4
    first = axes.index(group[0])
    inner = math.prod(sizes[a] for a in axes[:first])
    ranks = math.prod(sizes[a] for a in group)
    per_node = max(1, min(ranks, devices_per_node // inner)) if inner < devices_per_node else 1
    if devices_per_node % inner or ranks % per_node:    # groups straddle nodes unevenly: nothing stages
        per_node = 1
    return inner, per_node, -(-ranks // per_node)


def staged_time(kind: str, group: tuple[str, ...], sizes: dict[str, int], message_bytes: float,
                machine: Machine) -> float | None:
    """Seconds of ``kind`` over ``group`` in par4d's stages (docs/architecture.md, "Staged collectives"),
    or None where its groups do not span nodes with 2 or more members on each: inside the node at
    β_intra, across at β_inter shared by the rings on the node's link (the L link-stage rings of every
    one of the ``inner`` groups a node holds, as Eq 10 shares it). A staged all-gather's or reduce-scatter's stages
    take their kind's measured scale inside and across (:func:`kind_scale`); a staged all-reduce's stages stay at
    all-reduce's β, the kind the profile measures against."""
    inner, per_node, nodes = group_placement(sizes, group, machine.devices_per_node)
    if per_node < 2 or nodes < 2:
        return None
    link = machine.beta_inter / min(machine.devices_per_node, inner * per_node) * kind_scale(kind, machine, True)
    intra = machine.beta_intra * kind_scale(kind, machine, False)
    near = machine.latency
    far = machine.latency if machine.latency_inter is None else machine.latency_inter
    m = message_bytes
    if kind == "all_reduce":
        return (ring_time("reduce_scatter", per_node, m, intra, near)
                + ring_time("all_reduce", nodes, m / per_node, link, far)
                + ring_time("all_gather", per_node, m / per_node, intra, near))
    if kind == "reduce_scatter":
        return (ring_time("reduce_scatter", per_node, m, intra, near)
                + ring_time("reduce_scatter", nodes, m / per_node, link, far))
    if kind == "all_gather":      # m: the rank's shard
        return (ring_time("all_gather", nodes, m, link, far)
                + ring_time("all_gather", per_node, m * nodes, intra, near))
    raise ValueError(f"unknown collective {kind!r}")


def collective_time(kind: str, group: tuple[str, ...], sizes: dict[str, int], message_bytes: float, beta: float,
                    latency: float, machine: Machine | None) -> float:
    """A ring collective's seconds (Eqs 1-3 at ``beta`` and ``latency``), or, on a machine whose groups across
    nodes go in stages (``machine.staged``: par4d's gloo path under --hierarchical auto), the staged one's
    where it is faster (as auto's probe keeps the faster one) and the message is not one auto leaves flat."""
    ranks = sizes[group[0]] if len(group) == 1 else math.prod(sizes[a] for a in group)
    if ranks <= 1:
        return 0.0
    flat = ring_time(kind, ranks, message_bytes, beta, latency)
    if machine is None or not machine.staged or message_bytes < STAGE_MIN_BYTES:
        return flat
    staged = staged_time(kind, group, sizes, message_bytes, machine)
    return flat if staged is None else min(flat, staged)


ROLES = ("gather", "in_sum", "forward", "input_grad", "reduce_scatter", "backward", "sync")
"""Where a collective sits in an iteration, which decides what it can hide behind:
``gather`` (Ŵ's z all-gather: OAG, behind forward compute), ``in_sum`` (a layer's forward sum over its
in-axis: xy, behind the next row chunk's matmul), ``forward`` (the other forward collectives: never hidden),
``input_grad`` (dL/dI's all-reduce: OAR, behind the weight-gradient matmul),
``reduce_scatter`` (dŴ's: ORS, behind the rest of backward), ``backward`` (never
hidden), ``sync`` (the data-parallel sums: behind backward with the dp overlap)."""


def layer_terms(layer: Layer, sizes: dict[str, int], beta: dict[str, float], bytes_per_element: int,
                latency: float | dict[str, float] = 0.0, machine: Machine | None = None,
                data_ar: bool = True, across: dict[str, bool] | None = None) -> dict[tuple[str, str], float]:
    """Eqs 4-8 for one layer (times ``layer.count``), per (axis, role). A transposed layer
    swaps x and y (sizes and bandwidths). ``latency``: α per ring step, one for every axis
    or per axis (:func:`latencies`). With ``machine``, all-gather and reduce-scatter
    use its measured bandwidth scales (inside or across nodes: ``across``, default :func:`across_nodes`);
    ``data_ar=False`` leaves Eq 8 out (the full model counts par4d's bucketed data all-reduce once per iteration
    instead)."""
    alpha = latency if isinstance(latency, dict) else dict.fromkeys(beta, latency)
    if across is None:
        across = across_nodes(sizes, machine) if machine else {}
    z_far = across.get("z", False)               # only z's collectives are gathers and reduce-scatters
    ag, rs = kind_scale("all_gather", machine, z_far), kind_scale("reduce_scatter", machine, z_far)
    gx, gy, gz, gd = sizes["x"], sizes["y"], sizes["z"], sizes["data"]
    in_axis, out_axis = ("x", "y") if layer.transposed else ("y", "x")
    g_in, g_out = sizes[in_axis], sizes[out_axis]
    b, k, n = bytes_per_element, layer.k, layer.n
    m = layer.m / gd                                                # rows of one data-parallel replica
    def t(kind: str, axis: str, message: float, scale: float = 1.0) -> float:
        return collective_time(kind, (axis,), sizes, message, beta[axis] * scale, alpha[axis], machine)

    times = {
        ("z", "gather"): t("all_gather", "z", k * n / (gx * gy * gz) * b, ag),
        ("z", "reduce_scatter"): t("reduce_scatter", "z", k * n / (gx * gy) * b, rs),
        (in_axis, "in_sum"): t("all_reduce", in_axis, m * n / (gz * g_out) * b),
        (out_axis, "input_grad"): t("all_reduce", out_axis, m * k / (gz * g_in) * b),
        ("data", "sync"): t("all_reduce", "data", k * n / (gx * gy * gz) * b) if data_ar else 0.0,
    }
    return {key: t * layer.count for key, t in times.items()}


def layer_comm(layer: Layer, sizes: dict[str, int], beta: dict[str, float], bytes_per_element: int,
               latency: float | dict[str, float] = 0.0, machine: Machine | None = None,
               data_ar: bool = True) -> dict[str, float]:
    """:func:`layer_terms` summed per axis."""
    per_axis = {a: 0.0 for a in AXES4}
    for (axis, _), t in layer_terms(layer, sizes, beta, bytes_per_element, latency, machine, data_ar).items():
        per_axis[axis] += t
    return per_axis


def exposed_comm(roles: dict[str, float], t_compute: float, overlap: Overlap | None, gathers: int,
                 buckets: int, checkpointing: bool) -> float:
    """Seconds of communication an iteration waits for, given its time per role (:data:`ROLES`).

    Synchronous (``overlap`` None or all off): every second. Overlapped, hidden behind the
    compute it overlaps with, not summed (Section IV of the 4D paper; par4d's dp and xy overlaps):
    forward compute (a third of the step's, a quarter with recomputation) hides the
    prefetched gathers but the first, then (xy) the layers' forward sums of all row chunks but
    the last (``in_sum``); backward compute hides the input-gradient
    all-reduces (OAR: at most the weight-gradient half of it), the deferred reduce-scatters
    (ORS: all but the last layer's), the data-parallel buckets (all but the last) and,
    under recomputation, the recomputed gathers (none with the cache). What does not fit
    in the compute it overlaps with stays exposed.
    """
    on = overlap.names if overlap is not None else ()
    gather, rs, sync, grad_in = roles["gather"], roles["reduce_scatter"], roles["sync"], roles["input_grad"]
    regather = 0.0 if (not checkpointing or "cache" in on) else gather
    t_forward = t_compute / (4 if checkpointing else 3)
    t_backward = t_compute - t_forward
    exposed = roles["forward"] + roles["backward"]       # never hidden
    spare = t_forward                     # forward compute not yet hiding anything
    if "oag" in on and gathers:
        exposed += gather / gathers + max(0.0, gather * (1 - 1 / gathers) - t_forward)
        spare -= min(t_forward, gather * (1 - 1 / gathers))
    else:
        exposed += gather
    # xy: each chunk's sum but the last behind the next chunk's matmul (the forward's spare compute; in
    # backward the input-gradient matmul, half of it, where OAR does not already hide the sums).
    cut = 1 - 1 / overlap.row_chunks if "xy" in on else 0.0
    exposed += roles["in_sum"] - min(roles["in_sum"] * cut, max(0.0, spare) * cut)
    hideable, tails = 0.0, 0.0
    # OAR: behind the weight-gradient half of backward; xy alone: all chunks' sums but the last behind the
    # input-gradient matmuls. Either way backward compute the later overlaps can no longer use.
    hidden = min(grad_in, t_backward / 2) if "oar" in on else min(grad_in * cut, t_backward / 2 * cut)
    exposed += grad_in - hidden
    hideable += hidden
    if "ors" in on and gathers:
        hideable += rs * (1 - 1 / gathers)
        tails += rs / gathers
    else:
        exposed += rs
    if "dp" in on and buckets:
        hideable += sync * (1 - 1 / buckets)
        tails += sync / buckets
    else:
        exposed += sync
    if "oag" in on:
        hideable += regather
    else:
        exposed += regather
    return exposed + tails + max(0.0, hideable - t_backward)


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
    machine, plan/profile.py; with a pipeline, one stage's compute per step), else from
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
    """The data-parallel sync's buckets: as many with the overlap off (it only waits for them at the end)."""
    return math.ceil(grad_bytes / (overlap or SYNCHRONOUS).bucket_bytes) + (1 if grad_bytes > 2**20 else 0)


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
