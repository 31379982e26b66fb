"""The planner against what the 4D paper published: its weak-scaling table (Table III, GPTs on
Perlmutter, 4M-token batches of 2048-token sequences) beside the planner's first choice for
each run, and what the planner predicts for pure sharding (z = every GPU, ZeRO-3's layout).

The constants are the built-in machine's (published specifications and NCCL's cost model,
par4d/plan/machines.py), never fitted to this table (``par4d plan paper``; docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from par4d.plan.machines import PERLMUTTER, Machine
from par4d.plan.model import Prediction
from par4d.plan.search import search
from par4d.plan.workload import gpt_spec

BATCH_TOKENS, SEQ_LEN = 4 * 2**20, 2048


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
    first: Prediction | None      # the planner's first choice (None: nothing fits)
    first_4d: Prediction | None   # its first choice without a pipeline (the paper's par4d has none)
    sharded: Prediction | None    # its best choice on the grid z = every GPU (None: does not fit)


def answers(machine: Machine = PERLMUTTER) -> list[Answer]:
    out = []
    for row in TABLE_III:
        spec = gpt_spec(row.model).with_batch(BATCH_TOKENS // SEQ_LEN, SEQ_LEN)
        ranked, _ = search(spec, row.gpus, machine)
        flat = [p for p in ranked if p.sizes["pipe"] == 1]
        sharded = next((p for p in flat if p.sizes["z"] == row.gpus), None)
        out.append(Answer(row, ranked[0] if ranked else None, flat[0] if flat else None, sharded))
    return out


def _choice(pred: Prediction | None) -> str:
    if pred is None:
        return "nothing fits | - | -"
    grid = ",".join(f"{a}={n}" for a, n in pred.sizes.items() if n > 1)
    return (f"{grid}, M={pred.microbatches}, recompute {'on' if pred.checkpointing else 'off'} | "
            f"{pred.t_iter:.2f} | {pred.percent_of_peak:.1f}%")


def markdown(rows: list[Answer]) -> str:
    """The comparison as a Markdown table (what docs/planner.md shows, checked by a test). Every
    choice shown has every overlap on (the search's choice wherever memory allows it)."""
    lines = ["| GPUs | model | paper: par4d | planner's first choice | s/step | % of peak | "
             "first without a pipeline | s/step | % of peak | paper: ZeRO-3 | planner: z = GPUs |",
             "| ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for a in rows:
        p = a.published
        sharded = f"{a.sharded.percent_of_peak:.1f}% ({a.sharded.t_iter:.2f} s)" if a.sharded else "does not fit"
        lines.append(f"| {p.gpus} | {p.model.upper()} | {p.par4d}% | {_choice(a.first)} | {_choice(a.first_4d)} | "
                     f"{p.zero3}% | {sharded} |")
    return "\n".join(lines)
