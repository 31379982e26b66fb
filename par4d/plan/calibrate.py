"""``par4d calibrate``: measure this machine and write a machine profile.

Measures the fp32 matmul peak (before any rank starts), then, on ``nproc`` local
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from par4d.comm import KINDS
from par4d.ledger import ring_terms

MESSAGE_BYTES = (4096, 65536, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class CalibrationSettings:
    nproc: int
    repeats: int = 5


def _measure_worker(settings: CalibrationSettings) -> list[dict]:
    import par4d
    from par4d import comm
    from par4d.launch.machine import threads_per_rank

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
                times = []
                for _ in range(settings.repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                worst = torch.tensor([statistics.median(times)])
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)      # a collective ends when its slowest rank does
                rows.append({"kind": kind, "p": p, "bytes": elements * 4, "seconds": worst.item()})
        grid.close()
    dist.destroy_process_group()
    return rows


def fit(rows: list[dict]) -> dict:
    """Least-squares fits per kind: α-β, and c1 log2 p + c2 m + c3."""
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        t = np.array([r["seconds"] for r in mine])
        terms = [ring_terms(kind, r["p"]) for r in mine]
        a = np.array([[steps, r["bytes"] * factor] for (steps, factor), r in zip(terms, mine)])
        (alpha, inv_beta), *_ = np.linalg.lstsq(a, t, rcond=None)
        if inv_beta <= 0:
            raise ValueError(f"calibration of {kind} is too noisy to fit a bandwidth (time does not grow with "
                             f"message size); run again with more --repeats on a quieter machine")
        out[kind] = {"alpha": float(max(alpha, 0.0)), "beta": float(1 / inv_beta), "points": len(mine)}
        if len({r["p"] for r in mine}) > 1:   # with one p, log2 p and the constant cannot be told apart
            b = np.array([[math.log2(r["p"]), r["bytes"], 1.0] for r in mine])
            (c1, c2, c3), *_ = np.linalg.lstsq(b, t, rcond=None)
            out[kind].update(c1=float(c1), c2=float(c2), c3=float(c3))
    return out


def calibrate(nproc: int, out: Path, repeats: int = 5, cluster=None) -> dict:
    """Measure on ``nproc`` local ranks, or on an emulated ``cluster`` (a ClusterSpec):
    then groups inside a node give β_intra and the one ring over all ranks β_inter."""
    from par4d.launch import launch_local
    from par4d.launch.machine import cpu_cores, measure_matmul_peak
    from par4d.plan.machines import Machine

    if cluster is not None:
        nproc = cluster.world_size
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 to measure collectives, got {nproc}")
    peak = measure_matmul_peak(threads=cpu_cores())
    settings = CalibrationSettings(nproc, repeats)
    if cluster is None:
        rows = launch_local(nproc, _measure_worker, (settings,), run_id="par4d-calibrate")[0]
        per_node, name, intra_rows, inter_rows = nproc, f"local-{nproc}", rows, rows
    else:
        from par4d.launch.cluster import launch_cluster

        rows = launch_cluster(cluster, _measure_worker, (settings,))[0]
        per_node, name = cluster.ranks_per_node, f"emulated-{cluster.nodes}x{cluster.ranks_per_node}-{cluster.link}"
        intra_rows = [r for r in rows if r["p"] <= per_node and per_node % r["p"] == 0] or rows
        inter_rows = [r for r in rows if r["p"] == nproc]
    fits = fit(intra_rows)
    beta = beta_inter = fits["all_reduce"]["beta"]
    latency_inter = None                     # one node: every ring step is the node's
    if cluster is not None:
        inter = fit(inter_rows)
        beta_inter, latency_inter = inter["all_reduce"]["beta"], inter["all_reduce"]["alpha"]
        fits = {**fits, **{f"{k}_inter": v for k, v in inter.items()}}
    memory = _total_memory()
    machine = Machine(name=name, devices_per_node=per_node, peak_flops=peak / nproc,
                      memory_bytes=memory / nproc, beta_intra=beta, beta_inter=beta_inter,
                      latency=fits["all_reduce"]["alpha"], latency_inter=latency_inter, efficiency=0.5,
                      bytes_per_element=4,
                      all_gather_scale=fits["all_gather"]["beta"] / beta,
                      reduce_scatter_scale=fits["reduce_scatter"]["beta"] / beta,
                      staged=cluster is not None)    # gloo across nodes: par4d stages (--hierarchical auto)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_toml_fit(machine, fits, peak, nproc))
    return {"machine": machine, "fits": fits, "rows": rows, "peak_total": peak, "world": nproc}


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
