"""``par4d bench context``: how long a sequence a fixed model trains at with a context axis, against the best
grid without one, on the same ranks; what a rank's activations take against the sequence's length; and
the time of a step against torch's own context parallel (``torch.distributed.tensor.experimental.
context_parallel``) on the same model, where it runs.

The model: par4d's GPT of ``n_layer`` blocks of width ``n_embd`` (``n_head`` heads), trained on one sequence
per step (a batch no data or z axis can split further: what a long sequence is), fp32, AdamW. Its grids on
``nproc`` ranks: ``context`` = every rank, and half of them with heads over x; and the grids without a
context axis that cut one sequence's work otherwise: heads over x, features over y, and both. For each grid
and each length of ``lengths``: the activations one training step holds on the rank holding the most (what
autograd keeps at once, ``par4d.train.footprint``: the quantity a sequence's length multiplies), and the
longest of the lengths whose activations stay within ``budget`` bytes a rank. At ``timed`` tokens, the
median seconds a step takes on each grid that fits, with and without a document mask (documents of 512
tokens on average), and torch's context parallel on the single-device twin over every rank.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par4d.bench.common import launch
from par4d.launch import distributed_env, init, join
from par4d.launch.host import threads_per_rank
from par4d.layout import shard_batch
from par4d.measure.grids import WARMUP, time_iterations
from par4d.models import GPTConfig

LENGTHS = (1024, 2048, 4096, 8192, 16384)
DOCUMENT = 512                  # tokens a packed window's document has on average (--document-mask's rows)
BUDGET_MB = 48.0


@dataclass(frozen=True)
class ContextSettings:
    nproc: int
    iters: int
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    lengths: tuple[int, ...] = LENGTHS
    budget_mb: float = BUDGET_MB
    timed: int = 2048
    warmup: int = WARMUP          # untimed steps before each timing (a test's rows need none)

    def config(self, seq_len: int) -> GPTConfig:
        return GPTConfig(vocab_size=256, block_size=seq_len, n_layer=self.n_layer, n_embd=self.n_embd,
                         n_head=self.n_head, seed=0)


def grids(settings: ContextSettings) -> list[dict[str, int]]:
    """Every rank on context, half of them with heads over x, then the grids without a context axis that split
    one sequence's work: heads over x, features over y, both (those the model's sizes divide)."""
    n, found = settings.nproc, [dict(context=settings.nproc)]
    halves = [dict(x=2, context=n // 2), dict(x=2, y=n // 2)] if n % 2 == 0 and n > 2 else []
    for sizes in [*halves[:1], dict(x=n), dict(y=n), *halves[1:]]:
        full = {"x": sizes.get("x", 1), "y": sizes.get("y", 1), "z": 1}
        if settings.config(settings.lengths[0]).grid_problem(full) is None:
            found.append(sizes)
    return found


def _documents(seq_len: int) -> torch.Tensor:
    """Each token's document in a packed window: documents of :data:`DOCUMENT` tokens on average (a start at
    each token with chance 1 / DOCUMENT), the same on every rank."""
    starts = torch.rand(1, seq_len, generator=torch.Generator().manual_seed(1)) < 1 / DOCUMENT
    return torch.cumsum(starts, dim=1)


def _tokens(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _par4d(sizes: dict[str, int], settings: ContextSettings) -> list[dict]:
    """This grid's rows: its activations at every length (until one exceeds the budget), its time at ``timed``."""
    from par4d.grid import describe
    from par4d.optim.precision import FullPrecision
    from par4d.train.footprint import measure_footprint
    from par4d.train.recipes.gpt import build_gpt
    from par4d.train.step import train_step

    grid = init(**sizes)
    rows = []
    for seq_len in settings.lengths:
        if seq_len % (2 * grid.size("context")):
            continue
        model = build_gpt(settings.config(seq_len), grid)
        precision = FullPrecision(model, grid, torch.optim.AdamW(model.parameters(), lr=1e-4))
        inputs, targets = _tokens(seq_len)
        batch = (shard_batch(grid, inputs), shard_batch(grid, targets))

        def step(model=model, precision=precision, batch=batch) -> None:
            train_step(model, precision, grid, batch)

        held = measure_footprint(model, precision, step).activations
        most = torch.tensor([float(held)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        times = time_iterations(step, settings.iters, settings.warmup) if seq_len == settings.timed else None
        rows.append({"framework": "par4d", "name": "par4d", "grid": describe(grid.sizes), "seq_len": seq_len,
                     "activation_bytes_per_rank": int(most.item()),
                     "s_per_iter": statistics.median(times) if times else None, "times": times})
        if seq_len == settings.timed:     # what keeping attention inside documents costs: the same step, masked
            masked = (*batch, shard_batch(grid, _documents(seq_len)))

            def step_masked(model=model, precision=precision, batch=masked) -> None:
                train_step(model, precision, grid, batch)

            times = time_iterations(step_masked, settings.iters, settings.warmup)
            rows.append({"framework": "par4d", "name": "par4d --document-mask", "grid": describe(grid.sizes),
                         "seq_len": seq_len, "s_per_iter": statistics.median(times), "times": times,
                         "documents": int(_documents(seq_len).max()) + 1})
        del model, precision
        if most.item() > settings.budget_mb * 2**20:
            break                          # longer ones hold more still
    grid.close()
    return rows


def _torch_context_parallel(settings: ContextSettings) -> dict:
    """torch's context parallel on the single-device twin over every rank: its time at ``timed`` tokens, or
    the error that stops it (on CPUs torch 2.13 has no sharding rule for its CPU attention kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from par4d.train.recipes.gpt import build_reference

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("context",))
    model = build_reference(settings.config(settings.timed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _tokens(settings.timed)

    def step() -> None:
        with context_parallel(mesh, buffers=[inputs, targets], buffer_seq_dims=[1, 1]):
            model(inputs, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    row = {"framework": "torch", "name": "torch context_parallel", "grid": f"context={dist.get_world_size()}",
           "seq_len": settings.timed, "s_per_iter": None}
    try:
        times = time_iterations(step, settings.iters, settings.warmup)
    except Exception as error:           # what stops it, said as torch says it (the rank's own: no collective)
        return {**row, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {**row, "s_per_iter": statistics.median(times), "times": times}


def context_worker(settings: ContextSettings) -> list[dict]:
    join(distributed_env())
    torch.set_num_threads(threads_per_rank(settings.nproc))
    rows = [row for sizes in grids(settings) for row in _par4d(sizes, settings)]
    rows.append(_torch_context_parallel(settings))
    return rows


def longest(rows: list[dict], budget: float) -> dict[str, int]:
    """Per par4d grid, the longest sequence whose activations stayed within ``budget`` bytes a rank."""
    out: dict[str, int] = {}
    for row in rows:
        if "activation_bytes_per_rank" in row and row["activation_bytes_per_rank"] <= budget:
            out[row["grid"]] = max(out.get(row["grid"], 0), row["seq_len"])
    return out


def run_bench_context(settings: ContextSettings) -> list[dict]:
    if settings.nproc < 2 or settings.iters < 1 or settings.budget_mb <= 0:
        raise ValueError(f"--nproc {settings.nproc} (at least 2), --iters {settings.iters} (at least 1) and "
                         f"--budget-mb {settings.budget_mb} (above 0)")
    bad = [n for n in settings.lengths if n < 2 * settings.nproc or n % (2 * settings.nproc)]
    if bad or settings.timed not in settings.lengths:
        raise ValueError(f"--lengths {','.join(map(str, settings.lengths))}: each a multiple of 2 x --nproc "
                         f"= {2 * settings.nproc}, and --timed {settings.timed} one of them")
    if settings.n_embd % settings.n_head:
        raise ValueError(f"--n-embd {settings.n_embd} is not divisible by --n-head {settings.n_head}")
    rows = launch(context_worker, (settings,), settings.nproc, None, "1gbit", "par4d-bench-context")
    reach = longest(rows, settings.budget_mb * 2**20)
    best_without = max((n for g, n in reach.items() if "context" not in g), default=0)
    for row in rows:
        if row["framework"] == "par4d":
            row["longest_within_budget"] = reach.get(row["grid"], 0)
            row["longest_without_context"] = best_without
    return rows


def table(rows: list[dict], budget_mb: float) -> str:
    lines = [f"{'name':<24} {'grid':<34} {'seq_len':>7} {'activations MB/rank':>19} {'s/iter':>8}"]
    for r in rows:
        held = f"{r['activation_bytes_per_rank'] / 2**20:>19.1f}" if "activation_bytes_per_rank" in r else " " * 19
        time = f"{r['s_per_iter']:>8.3f}" if r.get("s_per_iter") is not None else f"{'-':>8}"
        lines.append(f"{r['name']:<24} {r['grid']:<34} {r['seq_len']:>7} {held} {time}"
                     + (f"  {r['error']}" if "error" in r else ""))
    reach = longest(rows, budget_mb * 2**20)
    lines.append(f"longest within {budget_mb:g} MB of activations a rank: "
                 + ", ".join(f"{g}: {n}" for g, n in reach.items()))
    return "\n".join(lines)
