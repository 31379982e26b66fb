"""One layer's communication per iteration (the 4D paper's Eqs 4-9), by the role each collective plays
(:data:`ROLES`), and how much of an iteration's communication its overlaps leave exposed."""

from __future__ import annotations

from par4d.overlap import Overlap
from par4d.plan.collectives import AXES4, across_nodes, collective_time, kind_scale
from par4d.plan.machines import Machine
from par4d.plan.workload import Layer

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
