"""``par4d calibrate``: measure this machine and write a machine profile.

Measures the fp32 matmul peak and, with the threads one rank gets, the memory bandwidth and a grid of
GEMM shapes, fitted to the planner's roofline (par4d/plan/compute.py: the fraction of peak the largest
GEMMs reach and a fixed cost per GEMM), and the host's cost per layer pass of a training step, all before
any rank starts; then, on ``nproc`` local
ranks, the time of all-reduce, all-gather and reduce-scatter for every group size p
that divides ``nproc`` and a range of message sizes, with all groups of that size
busy at once (as in training). Fits per collective kind

* the α-β form of the planner, ``t = α * steps(p) + bytes * factor(p) / β``
  (ring steps and volume factors of Eqs 1-3), and
* the phantom paper's ``t = c1 log2 p + c2 m + c3`` (m in bytes),

and writes a TOML profile whose ``[machine]`` table ``par4d plan --machine`` reads
(ranks share this machine's cores, so each "device" gets ``peak / nproc``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from par4d.comm import KINDS
from par4d.ledger import ring_terms

if TYPE_CHECKING:
    from par4d.plan.machines import Machine

MESSAGE_BYTES = (4096, 65536, 1 << 20, 4 << 20)
# GEMM shapes (rows, out, in) on the CPU: skinny to square, the shards a small model's grids give each rank.
GEMM_ROWS, GEMM_SIDES = (16, 128, 1024, 4096), (32, 128, 512)


def finish(device: torch.device | None) -> None:
    """Wait until ``device`` has run what was queued on it (a GPU's kernels run asynchronously)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(run, least: float = 0.005, device: torch.device | None = None) -> float:
    """Median seconds of ``run()`` over 3 samples, each repeated until it lasts ``least`` seconds; on a CUDA
    ``device`` each sample ends when the device has finished."""
    run()
    finish(device)
    count, start = 1, time.perf_counter()
    run()
    finish(device)
    while time.perf_counter() - start < least:
        run()
        count += 1
        finish(device)
    repeats = count
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        finish(device)
        samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples)


@dataclass(frozen=True)
class ComputeShapes:
    """What :func:`measure_compute` times: GEMMs at every ``rows x sides x sides``, causal attention at each
    (batch x heads, sequence, head width), and an element-wise sum of ``elements`` values."""
    rows: tuple[int, ...] = GEMM_ROWS
    sides: tuple[int, ...] = GEMM_SIDES
    attention: tuple[tuple[int, int, int], ...] = ((32, 128, 32), (8, 512, 64))
    elements: int = 1 << 25


# A GPU's: shards of models that fill one (GEMMs of up to 32768 x 8192 x 8192, attention at the sequences and
# head widths of GPT-2 to Llama), and a sum far larger than its caches.
GPU_SHAPES = ComputeShapes(rows=(512, 2048, 8192, 32768), sides=(1024, 4096, 8192),
                           attention=((64, 1024, 64), (32, 2048, 128), (16, 4096, 128)), elements=1 << 28)


def measure_compute(threads: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                    shapes: ComputeShapes = ComputeShapes()) -> dict:
    """With ``threads`` torch threads, on ``device`` (default the CPU) in ``dtype``: the memory bandwidth
    (an element-wise sum: two reads and a write per element) and the seconds of a GEMM at each of the
    ``shapes`` and of causal attention, forward and backward."""
    device = device or torch.device("cpu")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _warm_up(device, dtype)
        bandwidth = _bandwidth(shapes.elements, device)
        rows = []
        for m in shapes.rows:
            for n in shapes.sides:
                for k in shapes.sides:
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    w = torch.randn(k, n, device=device, dtype=dtype)
                    rows.append({"m": m, "n": n, "k": k, "seconds": _seconds(lambda x=x, w=w: x @ w, device=device)})
                    del x, w
        return {"memory_bandwidth": bandwidth, "gemms": rows,
                "attention": _attention(shapes.attention, device, dtype)}
    finally:
        torch.set_num_threads(previous)


def _warm_up(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> None:
    """A GPU's clocks rise from idle only under load: products of 8192 x 8192 for ``seconds`` first, so every
    shape is timed at the clocks training runs at (the first shapes ran 1.5-3x slow on an idle H200)."""
    if device.type == "cuda":
        from par4d.launch.peak import measure_matmul_peak

        measure_matmul_peak(seconds, size=8192, dtype=dtype, device=device)


def _attention(shapes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Seconds of causal ``scaled_dot_product_attention``, forward and backward, at each (batch x heads,
    sequence, head width), with its FLOPs as the planner counts them (QK^T and AV in full: ``4 T^2 d`` per
    head forward, 3 passes)."""
    import torch.nn.functional as F

    rows = []
    for heads, seq, width in shapes:
        q, k, v = (torch.randn(1, heads, seq, width, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, heads, seq, width, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        rows.append({"heads": heads, "seq": seq, "width": width, "flops": 3 * 4.0 * heads * seq * seq * width,
                     "seconds": _seconds(step, device=device)})
    return rows


def _bandwidth(elements: int, device: torch.device) -> float:
    """Bytes/s of an element-wise sum of two fp32 vectors of ``elements`` into a third (two reads, a write)."""
    a, b = torch.ones(elements, device=device), torch.ones(elements, device=device)
    out = torch.empty_like(a)
    return 3 * elements * 4 / _seconds(lambda: torch.add(a, b, out=out), device=device)


def measure_host_link(device: torch.device, elements: int) -> dict:
    """Bytes/s of copies between host memory and ``device`` as the offloaded optimizer makes them (par4d.optim.offload):
    ``elements`` fp32 values, pinned on the host where the device is a GPU, each way; ``host_bandwidth``: the rate of a
    step that moves as much each way (the two rates' harmonic mean), what a profile's ``host_bandwidth`` holds."""
    host, back = torch.ones(elements), torch.zeros(elements)
    if device.type == "cuda":                  # as the offloaded masters and moments are (empty_like would not be)
        host, back = host.pin_memory(), back.pin_memory()
    on_device = torch.empty(elements, device=device)
    to_device = elements * 4 / _seconds(lambda: on_device.copy_(host), device=device)
    to_host = elements * 4 / _seconds(lambda: back.copy_(on_device), device=device)
    return {"to_device": to_device, "to_host": to_host, "host_bandwidth": 2 / (1 / to_device + 1 / to_host),
            "bytes": elements * 4}


def fit_gemms(rows: list[dict], peak: float, bandwidth: float, bytes_per_element: int = 4) -> dict:
    """The roofline of par4d/plan/compute.py fitted to measured GEMMs: ``efficiency`` (0.01 to 1, a 0.01 grid)
    and ``kernel_latency`` (least squares, >= 0) minimizing the squared relative error, at the given ``peak``
    and memory ``bandwidth``; with the median relative error of the fit."""
    flops = np.array([2.0 * r["m"] * r["n"] * r["k"] for r in rows])
    moved = np.array([(r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"]) * bytes_per_element for r in rows])
    t = np.array([r["seconds"] for r in rows])
    best = None
    for efficiency in np.arange(1, 101) / 100:
        roof = np.maximum(flops / (peak * efficiency), moved / bandwidth)
        latency = max(0.0, float(np.sum((t - roof) / t**2) / np.sum(1 / t**2)))
        error = float(np.sum(((roof + latency - t) / t) ** 2))
        if best is None or error < best[0]:
            best = (error, float(efficiency), latency, roof)
    _, efficiency, latency, roof = best
    return {"efficiency": efficiency, "kernel_latency": latency, "memory_bandwidth": bandwidth,
            "median_error": float(np.median(np.abs((roof + latency - t) / t))), "points": len(rows)}


def fit_attention(rows: list[dict], peak: float) -> float:
    """Attention's fused kernel as the planner takes it: the median of its FLOPs over its seconds, as a fraction
    of ``peak`` (at most 1)."""
    return min(1.0, statistics.median(r["flops"] / (r["seconds"] * peak) for r in rows))


@dataclass(frozen=True)
class CalibrationSettings:
    nproc: int
    repeats: int = 5


def _measure_worker(settings: CalibrationSettings) -> list[dict]:
    import par4d
    from par4d import comm
    from par4d.launch.host import threads_per_rank

    torch.set_num_threads(threads_per_rank(settings.nproc))
    rows = []
    sizes = [p for p in range(2, settings.nproc + 1) if settings.nproc % p == 0]
    for p in sizes:
        # Flat rings: the fits are Eqs 1-3's β and α; the planner prices staged collectives from them.
        grid = par4d.init(x=p, data=settings.nproc // p, hierarchical="off")
        for kind in KINDS:
            for message in MESSAGE_BYTES:
                elements = message // 4
                if kind == "reduce_scatter":
                    elements -= elements % p
                tensor = torch.ones(elements)
                collective = getattr(comm, kind)

                def run(collective=collective, grid=grid, tensor=tensor):
                    collective(grid, tensor, "x")

                run()
                times, cpu = [], []
                for _ in range(settings.repeats):
                    dist.barrier()
                    start, busy = time.perf_counter(), time.process_time()
                    run()
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - busy)     # this process's CPU (gloo's threads included)
                worst = torch.tensor([statistics.median(times), statistics.median(cpu)])
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)      # a collective ends when its slowest rank does
                rows.append({"kind": kind, "p": p, "bytes": elements * 4, "seconds": worst[0].item(),
                             "cpu_seconds": worst[1].item()})
        if p == settings.nproc:
            rows.append(_sync_row(grid))
        grid.close()
    dist.destroy_process_group()
    return rows


SYNC_ROUNDS, SYNC_REPEATS = 30, 9


def _sync_row(grid) -> dict:
    """What a collective costs in training beyond its time from a common start: ranks reach it at different
    moments (where they time-share the cores, one may be off its core when the others arrive). Timed on every
    rank of ``grid`` (its x axis spans them all), ``SYNC_REPEATS`` times in turn: rounds of a compute chunk
    (four 256-square products), rounds of a one-element all-reduce, and rounds of both, as training issues
    them; each the mean over the ranks. The mean, not the slowest rank: the planner prices compute at each
    rank's share of the cores, the mean rank's time; and with no collective to keep them in step, the slowest
    rank's compute rounds hold the very wait for it that a round of both pays (on 8 ranks of 2 cores it measured
    0.07-0.54 ms beside the mean's 0.43-0.81). ``sync_seconds``: the median over the repeats of what a round of
    both took beyond the two apart (one measurement of it varies by 2x here: the median of 9 is what is kept)."""
    from par4d import comm

    a, tiny = torch.randn(256, 256), torch.ones(1)

    def chunk():
        for _ in range(4):
            a @ a

    def reduce():
        comm.all_reduce(grid, tiny, "x")

    def both():
        chunk()
        reduce()

    def rounds(work) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(SYNC_ROUNDS):
            work()
        return (time.perf_counter() - start) / SYNC_ROUNDS

    both()
    samples = torch.tensor([[rounds(chunk), rounds(reduce), rounds(both)] for _ in range(SYNC_REPEATS)],
                           dtype=torch.float64)
    dist.all_reduce(samples)
    samples /= dist.get_world_size()
    compute, collective, together = samples.median(dim=0).values.tolist()
    return {"kind": "sync", "p": grid.world_size, "compute_seconds": compute, "collective_seconds": collective,
            "both_seconds": together, "sync_seconds": sync_excess(samples.tolist())}


def sync_excess(samples: list[list[float]]) -> float:
    """From (compute, collective, both) seconds per repeat: the median of what both took beyond the two apart,
    never below 0 (a collective between compute never costs less than its time alone)."""
    return max(0.0, statistics.median(together - compute - collective for compute, collective, together in samples))


def _nonnegative_fit(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares of ``a x = t`` relative to ``t`` (each row weighted by 1 / t, so a 4 KB message counts as
    much as a 4 MB one: the latencies come from the small ones), with ``x >= 0``: the columns whose
    coefficient comes out negative are dropped one at a time and the rest refitted."""
    keep = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[keep], *_ = np.linalg.lstsq(a[:, keep] / t[:, None], np.ones_like(t), rcond=None)
        negative = [i for i in keep if x[i] < 0]
        if not negative:
            return x
        keep.remove(min(negative, key=lambda i: x[i]))


def fit(rows: list[dict], per_node: int | None = None) -> dict:
    """One fit of every kind, group size and message size measured, in the planner's form:
    ``t = steps(p) α + bytes factor(p) / β_kind`` (the ring steps and volume factors of Eqs 1-3), non-negative
    and relative (:func:`_nonnegative_fit`). The latency per ring step is the link's, the same for every kind
    (a profile has one); each kind has its own bandwidth. With ``per_node`` (an emulated cluster), groups
    inside a node give ``alpha`` and ``beta``; groups across K nodes pay per step ``α + (α_inter - α) (K - 1) /
    (p - 1)`` (as ``par4d.plan.collectives.latencies`` prices them) at ``beta_inter``, with ``α_inter >= α``: a step
    across nodes never costs less than one inside (a fit of the two apart gave 489 µs across, 904 inside).

    Per kind: ``alpha`` (and ``alpha_inter``, the same for all), ``beta`` (``beta_inter``), the fit's
    ``median_error``, ``cpu``: the share of the time the ranks' CPU was busy (gloo's copies and sums on the
    cores; the rest is waiting: latency and transfer), and the phantom paper's ``c1 log2 p + c2 m + c3``."""
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    t = np.array([r["seconds"] for r in rows])
    a = np.zeros((len(rows), 2 + 2 * len(kinds)))      # α, α_inter - α, then 1/β and 1/β_inter of each kind
    for i, r in enumerate(rows):
        steps, factor = ring_terms(r["kind"], r["p"])
        # As the planner places an innermost group of p ranks: inside a node if it fits and groups tile the
        # nodes (collectives.bandwidths), on ceil(p / per_node) nodes (collectives.latencies)
        across = per_node is not None and not (r["p"] <= per_node and per_node % r["p"] == 0)
        share = (-(-r["p"] // per_node) - 1) / (r["p"] - 1) if across else 0.0
        a[i, 0], a[i, 1] = steps, steps * share       # α on every step, α_inter - α (never < 0) on those across
        a[i, 2 + 2 * kinds.index(r["kind"]) + across] = r["bytes"] * factor
    used = [j for j in range(a.shape[1]) if a[:, j].any()]
    x = np.zeros(a.shape[1])
    x[used] = _nonnegative_fit(a[:, used], t)
    out = {}
    for index, kind in enumerate(kinds):
        mine = [i for i, r in enumerate(rows) if r["kind"] == kind]
        inverse, inverse_inter = x[2 + 2 * index], x[3 + 2 * index]
        inter = a[mine, 3 + 2 * index].any()
        if inverse <= 0 or (inter and inverse_inter <= 0):
            raise ValueError(f"calibration of {kind} is too noisy to fit a bandwidth (time does not grow with "
                             f"message size); run again with more --repeats on a quieter machine")
        errors = np.abs(a[mine] @ x - t[mine]) / t[mine]
        out[kind] = {"alpha": float(x[0]), "beta": float(1 / inverse), "points": len(mine),
                     "median_error": float(np.median(errors))}
        if inter:
            out[kind].update(alpha_inter=float(x[0] + x[1]), beta_inter=float(1 / inverse_inter))
        if all("cpu_seconds" in rows[i] for i in mine):
            out[kind]["cpu"] = float(sum(rows[i]["cpu_seconds"] for i in mine) / t[mine].sum())
        if len({rows[i]["p"] for i in mine}) > 1:   # with one p, log2 p and the constant cannot be told apart
            b = np.array([[math.log2(rows[i]["p"]), rows[i]["bytes"], 1.0] for i in mine])
            (c1, c2, c3), *_ = np.linalg.lstsq(b, t[mine], rcond=None)
            out[kind].update(c1=float(c1), c2=float(c2), c3=float(c3))
    return out


def calibrate(nproc: int, out: Path, repeats: int = 5, cluster=None) -> dict:
    """Measure on ``nproc`` local ranks, or on an emulated ``cluster`` (a ClusterSpec):
    then groups inside a node give β_intra and the one ring over all ranks β_inter."""
    from par4d.launch import launch_local
    from par4d.launch.host import cpu_cores, threads_per_rank
    from par4d.launch.peak import measure_matmul_peak
    from par4d.measure.profile import profile_layer_overhead
    from par4d.plan.machines import Machine

    if cluster is not None:
        nproc = cluster.world_size
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 to measure collectives, got {nproc}")
    peak = measure_matmul_peak(threads=cpu_cores())
    # One rank's compute, measured alone with its threads, then stretched by how many ranks share each core
    # (training runs them all at once; emulated nodes share this machine too): the profile's device is one
    # rank among nproc.
    threads = threads_per_rank(nproc)
    shared = max(1.0, nproc * threads / cpu_cores())
    compute = measure_compute(threads)
    gemms = [dict(r, seconds=r["seconds"] * shared) for r in compute["gemms"]]
    gemm = fit_gemms(gemms, peak / nproc, compute["memory_bandwidth"] / shared)
    gemm["attention_efficiency"] = fit_attention([dict(r, seconds=r["seconds"] * shared) for r in compute["attention"]],
                                                 peak / nproc)
    host = profile_layer_overhead(threads)
    settings = CalibrationSettings(nproc, repeats)
    if cluster is None:
        rows, sync = _apart(launch_local(nproc, _measure_worker, (settings,), run_id="par4d-calibrate")[0])
        per_node, name = nproc, f"local-{nproc}"
        fits = fit(rows)
        beta = beta_inter = fits["all_reduce"]["beta"]
        latency_inter = None                 # one node: every ring step is the node's
        inter_scales = {}
    else:
        from par4d.launch.cluster import launch_cluster

        rows, sync = _apart(launch_cluster(cluster, _measure_worker, (settings,))[0])
        per_node, name = cluster.ranks_per_node, f"emulated-{cluster.nodes}x{cluster.ranks_per_node}-{cluster.link}"
        fits = fit(rows, per_node)           # groups inside a node and across, in one fit
        beta, beta_inter = fits["all_reduce"]["beta"], fits["all_reduce"]["beta_inter"]
        latency_inter = fits["all_reduce"]["alpha_inter"]
        # Each kind's ratio to the all-reduce across nodes, from the fits across: the ratio inside rides on the
        # all-reduce's β inside, the noisiest fit on emulated nodes, and carried onto the link it misprices the
        # all-gathers there (docs/planner.md, the scales across nodes).
        inter_scales = {f"{kind}_scale_inter": fits[kind]["beta_inter"] / beta_inter
                        for kind in ("all_gather", "reduce_scatter")}
    memory = _total_memory()
    machine = Machine(name=name, devices_per_node=per_node, peak_flops=peak / nproc,
                      memory_bytes=memory / nproc, beta_intra=beta, beta_inter=beta_inter,
                      latency=fits["all_reduce"]["alpha"], latency_inter=latency_inter,
                      efficiency=gemm["efficiency"], memory_bandwidth=gemm["memory_bandwidth"],
                      kernel_latency=gemm["kernel_latency"], bytes_per_element=4, cores_shared=shared,
                      attention_efficiency=gemm["attention_efficiency"],
                      # the share of all the collectives' time (every kind, group and size) the CPU was busy
                      comm_cpu_share=min(1.0, sum(r["cpu_seconds"] for r in rows) / sum(r["seconds"] for r in rows)),
                      all_gather_scale=fits["all_gather"]["beta"] / beta,
                      reduce_scatter_scale=fits["reduce_scatter"]["beta"] / beta, **inter_scales,
                      staged=cluster is not None,    # gloo across nodes: par4d stages (--hierarchical auto)
                      sync_cost=sync["sync_seconds"])
    host["layer_overhead"] = layer_overhead(host, machine)
    machine = replace(machine, layer_overhead=host["layer_overhead"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_toml_fit(machine, {**fits, "gemm": gemm, "sync": sync, "host": host}, peak, nproc))
    return {"machine": machine, "fits": fits, "gemm": gemm, "gemm_rows": gemms, "rows": rows, "peak_total": peak,
            "world": nproc, "sync": sync, "host": host}


def layer_overhead(host: dict, machine: Machine) -> float:
    """The host's seconds per layer pass (``machine.layer_overhead``) from one rank's measurement alone
    (:func:`~par4d.measure.profile.profile_layer_overhead`): what a microbatch added to the step, stretched by the
    ranks sharing each core, less what ``machine``'s GEMMs already charge a microbatch more (their kernel latency,
    their weights read again), over a microbatch's layer passes."""
    from par4d.plan.compute import stage_seconds
    from par4d.plan.workload import MEASURED

    spec, alone = MEASURED.with_batch(host["batch"], host["seq_len"]), {"x": 1, "y": 1, "z": 1, "data": 1}
    kernels = replace(machine, layer_overhead=0.0)
    modelled = (stage_seconds(spec, alone, kernels, False, 4) - stage_seconds(spec, alone, kernels, False, 1)) / 3
    return max(0.0, (host["microbatch_seconds"] * machine.cores_shared - modelled) / host["layer_passes"])


def _apart(rows: list[dict]) -> tuple[list[dict], dict]:
    """The collectives' rows, and the one row of :func:`_sync_row`."""
    return [r for r in rows if r["kind"] != "sync"], next(r for r in rows if r["kind"] == "sync")


def _toml_fit(machine, fits: dict, peak: float, ranks: int) -> str:
    lines = [machine.to_toml(), f"# Measured by par4d calibrate: matmul peak {peak / 1e9:.1f} GFLOP/s fp32 "
             f"for the whole machine, shared by {ranks} ranks.", "[fit]"]
    for kind, values in fits.items():
        inner = ", ".join(f"{k} = {v!r}" for k, v in values.items())
        lines.append(f"{kind} = {{ {inner} }}")
    return "\n".join(lines) + "\n"


def _total_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9
