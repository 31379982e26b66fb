"""What one collective costs on a machine: the paper's ring model (Eqs 1-3) at Eq 10's placement-aware
bandwidth per axis, a latency per ring step as NCCL's ring model counts them, measured all-gather and
reduce-scatter scales inside a node and across, and collectives staged over groups that span nodes (the
faster of the flat ring and the stages, as ``--hierarchical auto`` keeps)."""

from __future__ import annotations

import math

from par4d.hierarchy import STAGE_MIN_BYTES
from par4d.ledger import ring_terms
from par4d.plan.machines import Machine

AXES4 = ("x", "y", "z", "data")
AXES5 = (*AXES4, "pipe")         # pipe outermost, as par4d.grid lays ranks out



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
