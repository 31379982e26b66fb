"""The planner against what the 4D paper published: its weak-scaling table (Table III, GPTs on
Perlmutter, 4M-token batches of 2048-token sequences) beside the planner's first choice for each
run, and, for the paper's ZeRO-3 column, the planner's pure sharding (z = every GPU) without
par4d's overlaps (``par4d plan paper``; docs/planner.md).

One constant is fitted to the table, once: the fraction of the A100's peak the paper's GEMMs
reached (:data:`PAPER_EFFICIENCY`, from :func:`fit_efficiency`, ``par4d plan paper --fit``). The
built-in ``perlmutter`` keeps the published maximum a matmul reaches today (par4d/plan/machines.py);
everything else is the built-in machine's (data sheets, NCCL's cost model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from par4d.overlap import Overlap
from par4d.plan.cost import Prediction
from par4d.plan.machines import PERLMUTTER, Machine
from par4d.plan.search import Space, search, search_top
from par4d.plan.workload import gpt_spec

BATCH_TOKENS, SEQ_LEN = 4 * 2**20, 2048

PAPER_EFFICIENCY = 0.57
"""The fraction of the A100's bf16 peak the paper's GEMMs are taken to reach: the value of
:func:`fit_efficiency` over :data:`TABLE_III`'s par4d column (least squares over the five rows, on
a 0.01 grid), fitted once. Against the 0.859 a large matmul reaches with CUDA 12.1 (machines.py)."""


@dataclass(frozen=True)
class Published:
    """One row of Table III: % of the bf16 peak each framework reached."""

    gpus: int
    model: str
    megatron: int
    zero3: int
    deepspeed_3d: int
    par4d: int


TABLE_III = (
    Published(64, "gpt-5b", 37, 55, 33, 67),
    Published(128, "gpt-10b", 42, 57, 33, 63),
    Published(256, "gpt-20b", 42, 57, 35, 67),
    Published(512, "gpt-40b", 44, 55, 35, 64),
    Published(1024, "gpt-80b", 42, 27, 38, 57),
)


@dataclass(frozen=True)
class Answer:
    published: Published
    first_4d: Prediction | None   # the first choice without a pipeline (the paper's par4d has none); None: nothing fits
    first: Prediction | None      # the first choice with the pipe axis searched too
    zero3: Prediction | None      # z = every GPU, no overlaps (ZeRO-3's layout); None: does not fit


def paper_machine(efficiency: float = PAPER_EFFICIENCY) -> Machine:
    return replace(PERLMUTTER, name=f"perlmutter (GEMMs at {efficiency:.2f} of peak)", efficiency=efficiency)


def _spec(row: Published):
    return gpt_spec(row.model).with_batch(BATCH_TOKENS // SEQ_LEN, SEQ_LEN)


def answer(row: Published, machine: Machine, pipelines: bool = True, zero3: bool = True) -> Answer:
    """The planner's answers for ``row``; without ``pipelines`` or ``zero3`` those searches are left out."""
    spec = _spec(row)
    flat = search_top(spec, row.gpus, machine, Space(pipe=1), top=1)[0]
    ranked = search_top(spec, row.gpus, machine, top=1)[0] if pipelines else flat
    sharded = None
    if zero3:
        plain, _ = search(spec, row.gpus, machine, Space(pipe=1, overlap=Overlap.none()))
        sharded = next((p for p in plain if p.sizes["z"] == row.gpus), None)
    return Answer(row, flat[0] if flat else None, ranked[0] if ranked else None, sharded)


def answers(machine: Machine | None = None) -> list[Answer]:
    return [answer(row, machine or paper_machine()) for row in TABLE_III]


def percent(row: Published, pred: Prediction) -> float:
    """% of the bf16 peak as the paper counts it: Narayanan et al.'s FLOPs, which count the recomputed forward
    whether or not a run recomputes (the async-pipeline paper's Eq. 3: ``96 B s l h^2 (...)``)."""
    flops = _spec(row).flops_per_iteration(checkpointing=True)
    return 100 * flops / (pred.t_iter * row.gpus * PERLMUTTER.peak_flops)


def misfit(efficiency: float) -> float:
    """Root-mean-square points between the first choices without a pipeline at ``efficiency`` and the
    paper's par4d column (a row where nothing fits counts 100 points)."""
    machine = paper_machine(efficiency)
    errors = []
    for row in TABLE_III:
        first = answer(row, machine, pipelines=False, zero3=False).first_4d
        errors.append(100.0 if first is None else percent(row, first) - row.par4d)
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def fit_efficiency(low: float = 0.40, high: float = PERLMUTTER.efficiency, step: float = 0.01) -> float:
    """The efficiency on a ``step`` grid in [low, high] whose predictions miss the par4d column least."""
    grid = [round(low + i * step, 10) for i in range(int((high - low) / step + 1e-9) + 1)]
    return min(grid, key=misfit)


def _choice(row: Published, pred: Prediction | None) -> str:
    if pred is None:
        return "nothing fits | - | -"
    grid = ",".join(f"{a}={n}" for a, n in pred.sizes.items() if n > 1)
    return (f"{grid}, M={pred.microbatches}, recompute {'on' if pred.checkpointing else 'off'} | "
            f"{pred.t_iter:.2f} | {percent(row, pred):.1f}%")


def _pipeline(a: Answer) -> str:
    """The first choice with a pipeline where one is faster, and by how much; else "-"."""
    if a.first is None or a.first_4d is None or a.first.sizes.get("pipe", 1) == 1:
        return "- | -"
    grid = ",".join(f"{k}={n}" for k, n in a.first.sizes.items() if n > 1)
    return f"{grid}, M={a.first.microbatches} | {a.first_4d.t_iter / a.first.t_iter:.2f}x"


def markdown(rows: list[Answer]) -> str:
    """The comparison as a Markdown table (what docs/planner.md shows, checked by a test). The first
    choices have every overlap the search could afford; the ZeRO-3 column has none; % of peak as the paper
    counts it (:func:`percent`)."""
    lines = ["| GPUs | model | paper: par4d | planner's first choice (no pipeline) | s/step | % of peak | "
             "faster with a pipeline | speed-up | paper: ZeRO-3 | planner: z = GPUs, no overlap |",
             "| ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for a in rows:
        p = a.published
        zero3 = f"{percent(p, a.zero3):.1f}% ({a.zero3.t_iter:.2f} s)" if a.zero3 else "does not fit"
        lines.append(f"| {p.gpus} | {p.model.upper()} | {p.par4d}% | {_choice(p, a.first_4d)} | {_pipeline(a)} | "
                     f"{p.zero3}% | {zero3} |")
    return "\n".join(lines)
