"""What every benchmark does alike: launch its worker on local ranks or emulated nodes,
sum a number over ranks, and write its rows as JSON lines."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from par4d.launch import launch_local
from par4d.measure.grids import time_iterations


def launch(worker: Callable, args: Sequence, nproc: int, nodes: int | None, link: str, run_id: str):
    """Rank 0's result of ``worker(*args)`` on ``nproc`` local ranks, or on ``nodes`` emulated
    nodes of ``nproc`` ranks each joined by ``link``."""
    if not nodes:
        return launch_local(nproc, worker, args, run_id=run_id)[0]
    from par4d.launch.cluster import ClusterSpec, launch_cluster

    return launch_cluster(ClusterSpec(nodes, nproc, link), worker, args)[0]


def in_rounds(runs: Sequence[Callable[[], list[dict]]], rounds: int) -> list[list[dict]]:
    """Every run's rows, each run called ``rounds`` times, the order reversed every other round (the row timed
    first after a change of model ran up to 6% slower here); a row's parts (one per round: the same workload,
    name and grid) together, in the order first seen. :func:`pooled` makes each one row."""
    timed: dict[tuple, list[dict]] = {}
    for turn in range(rounds):
        for run in runs if turn % 2 == 0 else runs[::-1]:
            for row in run():
                timed.setdefault((row.get("workload"), row["name"], row["grid"]), []).append(row)
    return list(timed.values())


def in_turns_times(steps: Sequence[Callable[[], object]], iters: int) -> list[list[float]]:
    """Seconds of ``iters`` calls of each of ``steps``, called in turns: a difference of their medians must not
    pick up a slow spell of a shared machine that hit only one of them. Each turn starts one step later than the
    last (A B C, B C A, C A B, ...): every step takes every place in a turn equally often, and none runs twice in
    a row where there are three (A/A here: the same DDP step first in each turn ran 2% slower than itself second;
    in the middle of turns reversed every other time, A B C then C B A, 3% slower than at the ends); one turn,
    untimed, first."""
    count = len(steps)
    order = [(turn + k) % count for turn in range(iters + 1) for k in range(count)]
    calls = iter(order)
    times = time_iterations(lambda: steps[next(calls)](), count * iters, warmup=count)
    return [[t for k, t in zip(order[count:], times) if k == j] for j in range(count)]


def pooled(parts: list[dict]) -> dict:
    """One row from the same row timed in several rounds: every round's iterations pooled (the median over all),
    the throughput recounted, DDP's exposed all-reduce from the pooled times with and without sync, and par4d's
    step timed in turns with DDP's (``par4d_in_turns_s``, and each round's ratio of the two medians:
    ``par4d_in_turns_ratios``, what :func:`spread` summarizes); compiled, the first round's compiling seconds (later
    rounds find Inductor's cache warm) and the graphs every round made again after its first step."""
    times = [t for part in parts for t in part["times"]]
    local = [t for part in parts for t in part.get("local_times", [])]
    beside = [t for part in parts for t in part.get("par4d_in_turns_times", [])]
    row = {k: v for k, v in parts[-1].items() if k not in ("times", "local_times", "par4d_in_turns_times")}
    s = statistics.median(times)
    for key in ("tokens_per_s", "percent_of_peak"):
        if key in row:
            row[key] *= row["s_per_iter"] / s
    row.update(s_per_iter=s, iters=len(times), rounds=len(parts))
    if "compile_s" in parts[0]:
        row["compile_s"] = parts[0]["compile_s"]
    if "recompiled_graphs" in parts[0]:
        row["recompiled_graphs"] = sum(part["recompiled_graphs"] for part in parts)
    if local:
        row.update(compute_s=statistics.median(local), exposed_comm_s=s - statistics.median(local),
                   exposed_comm_share=(s - statistics.median(local)) / s)
    if beside:                  # DDP's row: par4d's data-parallel step timed in turns with it
        row["par4d_in_turns_s"] = statistics.median(beside)
        row["par4d_in_turns_ratios"] = [statistics.median(part["par4d_in_turns_times"]) /
                                        statistics.median(part["times"]) for part in parts
                                        if part.get("par4d_in_turns_times")]
    return row


def spread(ratios: list[float]) -> str:
    """Rounds' ratios as their mean and its standard error (docs/benchmarks.md: one round's ratio of two programs
    stepped in turns moves by a few percent here, an identical one's included); empty for fewer than 2 rounds."""
    if len(ratios) < 2:
        return ""
    error = statistics.stdev(ratios) / len(ratios) ** 0.5
    return f"; per round {statistics.mean(ratios):.3f}x mean, standard error {error:.3f} ({len(ratios)} rounds)"


def check_cluster(nproc: int, nodes: int | None, link: str) -> None:
    """With ``nodes``: raise before any rank starts if the emulated cluster cannot be built
    (a bad ``link``, no root, no network namespaces)."""
    if nodes is None:
        return
    from par4d.launch.cluster import ClusterSpec, ClusterUnavailable, unavailable_reason

    ClusterSpec(nodes, nproc, link)     # checks the link rate
    reason = unavailable_reason()
    if reason:
        raise ClusterUnavailable(reason)


def where(nproc: int, nodes: int | None, link: str) -> str:
    """The ranks a benchmark ran on, in words."""
    return f"{nodes} emulated nodes x {nproc} ranks, {link} links" if nodes else f"{nproc} local ranks"


def sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def link_bytes(step: Callable[[], object], calls: int = 2) -> float | None:
    """Bytes all nodes sent over their links per call of ``step`` (each node's interface counter,
    read by its first rank; TCP/IP headers included), or None off an emulated cluster."""
    from par4d.launch.cluster import link_sent_bytes

    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    dist.barrier()
    before = link_sent_bytes()
    for _ in range(calls):
        step()
    dist.barrier()
    after = link_sent_bytes()
    if before is None or after is None:
        return None
    return sum_over_ranks(float(after - before) if first else 0.0) / calls


def emit(rows: list[dict], out: str | None, as_json: bool) -> bool:
    """Write ``rows`` as JSON lines to ``out`` (if given) and, with ``as_json``, to stdout;
    returns ``as_json`` (the caller prints its table otherwise). The CLI has refused an existing ``out`` unless
    --force (par4d.cli.files); a missing parent folder is created."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if as_json:
        for row in rows:
            print(json.dumps(row))
    return as_json


def grid_row(name: str, sizes: dict[str, int], times: list[float], bytes_per_iter: float, peak: float,
             bytes_source: str, sequences: int | None = None) -> dict:
    """A row of the demo workload (par4d's GPT on ``sequences`` of its length, default its batch): median
    seconds per iteration, tokens/s, % of ``peak``, the bytes one iteration's collectives move (``bytes_source``:
    how they were counted)."""
    from par4d.measure.grids import BATCH, CONFIG  # only the rows of the demo workload need the planner's

    s = statistics.median(times)
    tokens = (sequences or BATCH) * CONFIG.block_size / s
    flops = CONFIG.flops_per_token() * tokens
    return {"framework": "par4d" if name.startswith("par4d") else "torch", "name": name,
            "grid": " ".join(f"{a}={sizes.get(a, 1)}" for a in ("x", "y", "z", "data")),
            "s_per_iter": s, "tokens_per_s": tokens, "percent_of_peak": 100 * flops / peak,
            "bytes_per_iter": int(bytes_per_iter), "bytes_source": bytes_source, "iters": len(times)}
