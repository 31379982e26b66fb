"""``par4d bench overlap``: what each overlap buys, in the order of the 4D paper's Fig. 3.

One GPT on one communication-heavy grid, one job: rows ``none``, ``+oar``, ``+ors``,
``+oag``, ``+cache`` and ``all`` (``+dp``), each adding its switch to the row above.
Every row recomputes activations at the paper's spacing (as the paper's runs do; the
cache has nothing to reuse otherwise), so rows differ in their waits only. The rows
share one model and switch settings with :func:`par4d.set_overlap`; they are timed
in interleaved rounds (each round runs every row), so drift of the machine spreads
over all rows alike. Per row: median s/iter, and per iteration the seconds rank by
rank spent waiting for collectives (``exposed_comm_s``, mean over ranks) and the wall
seconds with a collective in flight (``in_flight_s``), and ``speedup`` over ``none``.

Grid and workload. By default every rank is on z (z=4 on 2 emulated nodes of 2 ranks):
each weight's all-gather (OAG, the cache) and each gradient's reduce-scatter (ORS) and
the z-sums of biases and norms (dp) cross the link; with ``--grid x=2,z=2`` x sits
inside a node and OAR has all-reduces to hide too (docs/benchmarks.md shows both).
The model and batch (4 blocks of width 256, 3.3 M parameters; 16 sequences of 128
tokens) were chosen so that over a 1 Gbit/s link communication and compute are of the
same order: in the ``none`` row on this machine communication was 54% of the
iteration (z=4) and compute the rest. With 8 sequences communication was 68%, twice
the compute; with the demo's width of 128 the weights are 4x smaller and compute
dominates.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from par4d.bench.common import emit, launch, sum_over_ranks, where
from par4d.grid import Grid, parse_grid, validate_sizes
from par4d.launch import init
from par4d.launch.host import threads_per_rank
from par4d.layout import shard_batch
from par4d.ledger import in_flight_seconds
from par4d.models import GPT, GPTConfig
from par4d.models.config import recompute_spacing
from par4d.optim.data_parallel import gradient_sync
from par4d.overlap import Overlap, set_overlap
from par4d.train.step import train_step

ROWS = (("none", ()), ("+oar", ("oar",)), ("+ors", ("oar", "ors")), ("+oag", ("oar", "ors", "oag")),
        ("+cache", ("oar", "ors", "oag", "cache")), ("+dp", ("oar", "ors", "oag", "cache", "dp")),
        ("all", ("oar", "ors", "oag", "cache", "dp", "xy")))
"""Fig. 3's order, then par4d's own: each row adds one switch to the row above (``all`` adds xy)."""


@dataclass(frozen=True)
class OverlapBench:
    grid: dict[str, int]
    config: GPTConfig
    batch: int
    iters: int
    rounds: int
    ranks_here: int        # ranks sharing this node's cores
    recompute: int
    prefetch: int


def _settings(names: tuple[str, ...], prefetch: int = 1) -> Overlap:
    return replace(Overlap.parse(",".join(names)) if names else Overlap.none(), prefetch=prefetch)


def _mean_over_ranks(value: float) -> float:
    return sum_over_ranks(value) / dist.get_world_size()


def bench_worker(bench: OverlapBench) -> list[dict]:
    torch.set_num_threads(threads_per_rank(bench.ranks_here))
    grid = init(**bench.grid)
    model = GPT(bench.config, grid=grid, recompute=bench.recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, bench.config.vocab_size, (bench.batch, bench.config.block_size + 1), generator=gen)
    x, y = shard_batch(grid, tokens[:, :-1]).to(grid.device), shard_batch(grid, tokens[:, 1:]).to(grid.device)
    times = {name: [] for name, _ in ROWS}
    exposed = {name: [] for name, _ in ROWS}
    flight = {name: [] for name, _ in ROWS}
    by_kind = {name: {} for name, _ in ROWS}     # (kind, axes) -> seconds waited, summed over timed iterations
    for _ in range(bench.rounds):
        for name, switches in ROWS:
            set_overlap(model, _settings(switches, bench.prefetch))
            gradient_sync(model, grid)                       # rebuild the buckets for these settings
            train_step(model, optimizer, grid, (x, y))   # warm-up: records the gather order (OAG)
            for _ in range(bench.iters):
                dist.barrier()
                with grid.ledger.capture() as entries:
                    began = time.perf_counter()
                    train_step(model, optimizer, grid, (x, y))
                    seconds = time.perf_counter() - began
                times[name].append(seconds)
                exposed[name].append(sum(e.seconds for e in entries))
                flight[name].append(in_flight_seconds(entries))
                for e in entries:
                    key = f"{e.kind} {','.join(e.axes)}"
                    by_kind[name][key] = by_kind[name].get(key, 0.0) + e.seconds
    rows = []
    for name, switches in ROWS:
        s = _mean_over_ranks(statistics.median(times[name]))
        rows.append({"framework": "par4d", "name": name, "overlap": _settings(switches).describe(),
                     "grid": grid.describe(), "recompute_every": bench.recompute, "s_per_iter": s,
                     "exposed_comm_s": _mean_over_ranks(statistics.median(exposed[name])),
                     "in_flight_s": _mean_over_ranks(statistics.median(flight[name])),
                     "iters": len(times[name]), "exposed_by_collective": _exposed_by(by_kind[name], len(times[name]))})
    for row in rows:
        row["speedup"] = rows[0]["s_per_iter"] / row["s_per_iter"]
        row["exposed_share"] = row["exposed_comm_s"] / row["s_per_iter"]
    grid.close()
    dist.destroy_process_group()
    return rows


def _exposed_by(waited: dict[str, float], iters: int) -> dict[str, float]:
    """Seconds waited per iteration for each kind of collective, mean over ranks (every rank
    issues the same kinds: the grid's collectives are SPMD)."""
    keys = sorted(waited)
    t = torch.tensor([waited[k] / iters for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / dist.get_world_size() for k, v in zip(keys, t.tolist())}


def _grid(world: int) -> dict[str, int]:
    """Every rank on z: all of Algorithm 1's weight traffic crosses the nodes' links."""
    if world < 2:
        raise ValueError(f"bench overlap needs at least 2 ranks (z >= 2); got {world}")
    return {"z": world}


def markdown(rows: list[dict]) -> str:
    lines = ["| row | overlap | s/iter (median) | speedup over none | exposed comm s/iter | exposed share "
             "| in flight s/iter |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['overlap']} | {r['s_per_iter']:.3f} | {r['speedup']:.2f}x | "
                     f"{r['exposed_comm_s']:.3f} | {100 * r['exposed_share']:.0f}% | {r['in_flight_s']:.3f} |")
    return "\n".join(lines)


def plot(tables: dict[str, list[dict]], path: str) -> None:
    """Stacked bars per row, one panel per configuration (title -> rows), as the paper's Fig. 3:
    compute (the iteration minus exposed communication) and exposed communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(5.2 * len(tables), 3.8), squeeze=False)
    for ax, (title, rows) in zip(axes[0], tables.items()):
        names = [r["name"] for r in rows]
        exposed = [r["exposed_comm_s"] for r in rows]
        compute = [r["s_per_iter"] - e for r, e in zip(rows, exposed)]
        ax.bar(names, compute, label="compute (and other work)", color="#4c72b0")
        ax.bar(names, exposed, bottom=compute, label="exposed communication", color="#dd8452")
        for i, r in enumerate(rows):
            ax.text(i, r["s_per_iter"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("s / iteration (median)")
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_overlap(args: argparse.Namespace) -> int:
    if args.iters < 1 or args.rounds < 1:
        raise ValueError(f"--iters and --rounds must be >= 1 (got {args.iters}, {args.rounds})")
    world = args.nproc * (args.nodes or 1)
    sizes = parse_grid(args.grid) if args.grid else _grid(world)
    sizes = {a: s for a, s in validate_sizes(sizes, world).items() if s > 1}
    config = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd,
                       n_head=args.n_head)
    GPT(config, grid=Grid.virtual(sizes))       # shape errors before any rank starts
    shards = sizes.get("z", 1) * sizes.get("data", 1)
    if args.batch_size % shards:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by z * data = {shards}")
    recompute = recompute_spacing(config.n_layer)
    ranks_here = args.nproc if args.nodes else world        # ranks sharing one node's cores
    bench = OverlapBench(sizes, config, args.batch_size, args.iters, args.rounds, ranks_here, recompute, args.prefetch)
    rows = launch(bench_worker, (bench,), args.nproc, args.nodes, args.link, "par4d-bench-overlap")
    ranks = where(args.nproc, args.nodes, args.link)
    for row in rows:
        row.update(workload=f"GPT {config.n_layer}x{config.n_embd}, batch {args.batch_size}x{config.block_size}",
                   where=ranks)
    if args.plot:
        plot({f"{rows[0]['grid']}, {ranks}": rows}, args.plot)
    if not emit(rows, args.out, args.json):
        print(f"GPT {config.n_layer} blocks x {config.n_embd} wide ({config.num_params():,} params), global batch "
              f"{args.batch_size} x {config.block_size} tokens, grid {rows[0]['grid']}, {ranks}, recompute every "
              f"{recompute} blocks, prefetch {args.prefetch}; median of {args.iters} x {args.rounds} rounds")
        print(markdown(rows))
    sys.stdout.flush()
    return 0


__all__ = ["ROWS", "markdown", "plot", "run_bench_overlap"]
