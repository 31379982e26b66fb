"""``par4d plan validate``: measure the GPT at every valid grid and score the model's ranking.

For each model variant (agnostic, aware, full, and full-profiled: the full model
with its compute time profiled on this machine instead of FLOPs over peak): Kendall
τ-b between predicted and measured time, the measured rank of the predicted best, and
the predicted rank of the measured best (ranks from 1). Agnostic and aware rank by
communication time (as the paper does), the full models by iteration time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from par4d.overlap import Overlap
from par4d.plan.cost import VARIANTS, predict, priced
from par4d.plan.machines import Machine
from par4d.plan.workload import MEASURED as SPEC  # the measured workload (measure/grids.py)


@dataclass(frozen=True)
class MeasureSettings:
    nproc: int
    iters: int
    overlap: Overlap = field(default_factory=Overlap)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-b (ties in either list handled)."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for position, index in enumerate(order, 1):
        ranks[index] = position
    return ranks


@dataclass
class Score:
    model: str
    kendall_tau: float
    measured_rank_of_predicted_best: int
    predicted_rank_of_measured_best: int
    predicted: list[float]


def plain(row: dict) -> bool:
    """Whether a measured row is a grid the paper's models can rank: no pipeline, one microbatch, no
    recomputation (they know nothing of those choices)."""
    return row["sizes"].get("pipe", 1) == 1 and row.get("microbatches", 1) == 1 and not row.get("recompute", False)


def choice_prediction(row: dict, machine: Machine, variant: str, overlap: Overlap | None,
                      compute_seconds: float | None = None):
    """The model's prediction of a measured row's choice (its grid, microbatches, recomputation; a pipeline with
    the overlaps that act there)."""
    acting = overlap
    if overlap is not None and row["sizes"].get("pipe", 1) > 1:
        acting = overlap.in_pipeline()
    return predict(SPEC, row["sizes"], machine, variant, checkpointing=row.get("recompute", False),
                   compute_seconds=compute_seconds, overlap=acting if variant == "full" else None,
                   microbatches=row.get("microbatches", 1))


def score(measured: list[dict], machine: Machine, overlap: Overlap | None = None) -> list[Score]:
    """``measured``: rows with ``sizes`` (a pipeline's with ``pipe``), ``s_per_iter``, optionally
    ``microbatches`` and ``recompute``, and ``compute_s`` (profiled compute) to score the full model with
    profiled compute too, as ``full-profiled``. ``overlap``: the settings the rows were measured with (the full
    models count only the communication they leave exposed; None: synchronous). The full models rank every
    row; agnostic and aware only the :func:`plain` ones (``predicted`` is None on the others)."""
    scores = []
    profiled = all("compute_s" in row for row in measured)
    for name in VARIANTS + (("full-profiled",) if profiled else ()):
        variant = "full" if name == "full-profiled" else name
        mine = [i for i, row in enumerate(measured) if variant == "full" or plain(row)]
        preds = [choice_prediction(measured[i], machine, variant, overlap,
                                   measured[i]["compute_s"] if name == "full-profiled" else None) for i in mine]
        excluded = [(p.sizes, p.excluded) for p in preds if not p.fits]
        if excluded:
            raise ValueError(f"the '{name}' model excludes measured configurations: {excluded} "
                             f"(is the machine profile's memory right?)")
        predicted = [p.ranking_time(variant) for p in preds]
        times = [measured[i]["s_per_iter"] for i in mine]
        p_ranks, m_ranks = _ranks(predicted), _ranks(times)
        best_predicted = p_ranks.index(1)
        best_measured = m_ranks.index(1)
        every = [None] * len(measured)
        for i, value in zip(mine, predicted):
            every[i] = value
        scores.append(Score(name, kendall_tau(predicted, times), m_ranks[best_predicted],
                            p_ranks[best_measured], every))
    return scores


def memory_check(measured: list[dict], machine: Machine, overlap: Overlap | None) -> list[float | None]:
    """Per row with a measured ``memory`` (par4d.train.footprint's total, the most of any rank): the full
    model's prediction over it (1.0: exact); None where nothing was measured."""
    return [choice_prediction(row, machine, "full", overlap).mem_bytes / row["memory"]["total"]
            if row.get("memory") else None for row in measured]


def _measure_worker(settings, shapes: list[dict], passes: int) -> list[dict]:
    import statistics

    import torch
    import torch.distributed as dist

    from par4d.launch.host import threads_per_rank
    from par4d.measure.grids import held_most, measure_grid

    torch.set_num_threads(threads_per_rank(settings.nproc))

    times: list[list[float]] = [[] for _ in shapes]
    memory: list[dict | None] = [None for _ in shapes]
    # Round robin: a burst of load on the machine slows one pass of every grid, not every pass of one grid.
    for p in range(passes):
        for i, choice in enumerate(shapes):
            seconds, _, held = measure_grid(choice["sizes"], settings.iters, overlap=settings.overlap,
                                            microbatches=choice.get("microbatches"),
                                            recompute=choice.get("recompute", False),
                                            then=held_most if p == 0 else None)
            times[i].append(statistics.median(seconds))
            memory[i] = memory[i] or held
    dist.destroy_process_group()
    return [{**choice, "s_per_iter": statistics.median(t), "passes": t, "memory": m}
            for choice, t, m in zip(shapes, times, memory)]


def repeatability(measured: list[dict]) -> float | None:
    """Mean Kendall τ between the rankings of every two passes: how much a single
    pass's ranking moves (the model is scored against the median of the passes,
    which moves less). None with one pass."""
    passes = len(measured[0].get("passes", [])) if measured else 0
    taus = [kendall_tau([row["passes"][a] for row in measured], [row["passes"][b] for row in measured])
            for a in range(passes) for b in range(a + 1, passes)]
    return sum(taus) / len(taus) if taus else None


def validate(nproc: int, machine: Machine, iters: int, plot: Path | None,
             cluster=None, passes: int = 1, overlap: Overlap | None = None) -> tuple[list[dict], list[Score]]:
    """Measure on ``nproc`` local ranks, or on an emulated ``cluster`` (ClusterSpec),
    every choice of :func:`par4d.measure.grids.choices` ``passes`` times (round robin; each one's time is its
    median) and what it holds in memory once, with ``overlap`` (default ``Overlap()``: every overlap on, a
    pipeline's those that act there; ``Overlap.none()``: synchronous)."""
    overlap = Overlap() if overlap is None else overlap
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    from par4d.launch import launch_local
    from par4d.measure.grids import choices

    world = cluster.world_size if cluster is not None else nproc
    shapes = choices(world)
    compute = _profiled_compute(shapes, world)     # first: a failure here costs seconds, not the measurement
    args = (MeasureSettings(world, iters, overlap), shapes, passes)
    if cluster is None:
        measured = launch_local(nproc, _measure_worker, args, run_id="par4d-validate")[0]
        title = f"--nproc {nproc}"
    else:
        from par4d.launch.cluster import launch_cluster

        measured = launch_cluster(cluster, _measure_worker, args)[0]
        title = f"--nodes {cluster.nodes} --nproc {cluster.ranks_per_node} --link {cluster.link}"
    for row, seconds in zip(measured, compute):
        row["compute_s"] = seconds
    scores = score(measured, machine, priced(overlap))
    if plot is not None:
        _plot(measured, scores, plot, title)
    return measured, scores


def _profiled_compute(shapes: list[dict], world: int) -> list[float]:
    """Per grid: rank 0's step without communication (measure/profile.py) with the
    measurement's threads per rank, scaled by :func:`cores_shared`."""
    import torch

    from par4d.launch.host import cpu_cores, threads_per_rank
    from par4d.measure.profile import cores_shared, profile_compute

    threads = threads_per_rank(world)
    shared = cores_shared(world, threads, cpu_cores(), torch.cuda.is_available())
    return [row["seconds"] * shared for row in profile_compute(shapes, threads, iters=10)]


def label(row: dict) -> str:
    """A measured row in one short word: x y z data (pipe P, M microbatches, r: recomputed)."""
    sizes = row["sizes"]
    text = "{x}{y}{z}{data}".format(**sizes)
    if sizes.get("pipe", 1) > 1:
        text += f"p{sizes['pipe']}"
    if row.get("microbatches", 1) > 1:
        text += f"m{row['microbatches']}"
    return text + ("r" if row.get("recompute") else "")


def _plot(measured: list[dict], scores: list[Score], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scores), figsize=(4.2 * len(scores), 3.8))
    for ax, s in zip(axes, scores):
        mine = [i for i in range(len(measured)) if s.predicted[i] is not None]
        order = sorted(mine, key=lambda i: s.predicted[i])
        ax.bar(range(1, len(order) + 1), [measured[i]["s_per_iter"] for i in order], color="tab:blue")
        ax.axhline(min(measured[i]["s_per_iter"] for i in mine), color="tab:red", lw=0.8, ls="--")
        ax.set_xlabel(f"configuration, ranked by the '{s.model}' model")
        ax.set_ylabel("measured s / iteration")
        ax.set_title(f"{s.model}: τ = {s.kendall_tau:.2f}", fontsize=10)
        ax.set_xticks(range(1, len(order) + 1))
        ax.set_xticklabels([label(measured[i]) for i in order], rotation=90, fontsize=6)
    fig.suptitle(f"par4d plan validate {title} (labels: x y z data, p pipe, m microbatches, r recomputed)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(measured: list[dict], scores: list[Score], as_json: bool, memory: list[float | None] | None = None) -> str:
    """The measured rows beside each model's prediction, the scores, and with ``memory`` (:func:`memory_check`'s
    ratios) the predicted memory beside the measured."""
    between = repeatability(measured)
    memory = memory or [None] * len(measured)
    if as_json:
        grids = [json.dumps({"grid": row["sizes"], "microbatches": row.get("microbatches", 1),
                             "recompute": row.get("recompute", False), "s_per_iter": row["s_per_iter"],
                             "predicted_s": {s.model: s.predicted[i] for s in scores if s.predicted[i] is not None},
                             "memory": row.get("memory"), "memory_predicted_over_measured": memory[i]})
                 for i, row in enumerate(measured)]
        return "\n".join(grids + [json.dumps({"model": s.model, "kendall_tau": s.kendall_tau,
                                     "measured_rank_of_predicted_best": s.measured_rank_of_predicted_best,
                                     "predicted_rank_of_measured_best": s.predicted_rank_of_measured_best,
                                     "configurations": sum(v is not None for v in s.predicted),
                                     "passes": len(measured[0].get("passes", [1])),
                                     "kendall_tau_between_passes": between}) for s in scores])
    multi = between is not None
    memory_shown = any(m is not None for m in memory)
    head = "| grid (x y z data) | pipe | M | rc | measured s/iter | " + ("passes (s) | " if multi else "")
    lines = [head + " | ".join(f"{s.model} (s)" for s in scores) + (" | memory MB, measured | predicted / measured |"
                                                                   if memory_shown else " |"),
             "| --- | ---: | ---: | --- | ---: | " + ("--- | " if multi else "") + " | ".join("---:" for _ in scores)
             + (" | ---: | ---: |" if memory_shown else " |")]
    for row in sorted(range(len(measured)), key=lambda i: measured[i]["s_per_iter"]):
        sizes, r = measured[row]["sizes"], measured[row]
        cells = " | ".join("-" if s.predicted[row] is None else f"{s.predicted[row]:.4f}" for s in scores)
        each = (" ".join(f"{t:.3f}" for t in r["passes"]) + " | ") if multi else ""
        held = ""
        if memory_shown:
            held = (f" | {r['memory']['total'] / 1e6:.1f} | {memory[row]:.2f}" if memory[row] is not None
                    else " | - | -")
        lines.append(f"| {sizes['x']} {sizes['y']} {sizes['z']} {sizes['data']} | {sizes.get('pipe', 1)} | "
                     f"{r.get('microbatches', 1)} | {'on' if r.get('recompute') else 'off'} | "
                     f"{r['s_per_iter']:.3f} | {each}{cells}{held} |")
    lines += ["", "| model | configurations | Kendall τ | measured rank of predicted best | "
                  "predicted rank of measured best |", "| --- | ---: | ---: | ---: | ---: |"]
    for s in scores:
        lines.append(f"| {s.model} | {sum(v is not None for v in s.predicted)} | {s.kendall_tau:.2f} | "
                     f"{s.measured_rank_of_predicted_best} | {s.predicted_rank_of_measured_best} |")
    if multi:
        lines += ["", f"Pass against pass: mean τ {between:.2f} (how much one pass's ranking moves)."]
    if memory_shown:
        ratios = [m for m in memory if m is not None]
        worst = max(ratios, key=lambda m: abs(m - 1))
        lines += ["", f"Memory: predicted over measured {min(ratios):.2f}-{max(ratios):.2f} on {len(ratios)} "
                      f"configurations (furthest from 1: {worst:.2f}); measured: the most any rank held "
                      f"(par4d.train.footprint)."]
    return "\n".join(lines)
