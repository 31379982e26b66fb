"""``par4d bench peers``: par4d against PyTorch's own parallelisms on one model and batch.

Rows, all in one job on the same ranks, one after another: PyTorch DDP, FSDP2
(``fully_shard`` per block and root), HSDP (FSDP2 on a 2D mesh: sharded inside a node,
replicated across nodes; without ``--nodes`` a (2, nproc/2) mesh), FSDP2 + DTensor
tensor parallelism (TP inside a node, FSDP across; without ``--nodes`` TP over 2 ranks),
each also with the knob a user would turn (KNOBS), and par4d on every grid that divides
the model and batch, with its collectives flat and, where a group spans nodes, staged
(``par4d +hierarchical``). Each rank trains on its own block of the global batch, as
``par4d bench grid`` does; the ranks of one TP group share a block. Columns and byte
counts are bench grid's (``bench.common.grid_row``), plus ``ratio_to_best_peer`` (a row's
s/iter over the fastest torch row's of the same workload), ``floor_s_per_iter`` (the limit
for the setting: :func:`add_floor`) and, across emulated nodes, ``link_bytes_per_iter``
(what the nodes' interfaces sent). Each DDP row (every knob: the fastest DDP differs by workload and machine)
also steps par4d's data=N step in turns with its own, summing in that row's buckets (``par4d_in_turns_s``, each
round's ratio in ``par4d_in_turns_ratios``, par4d's bucket size in ``par4d_bucket_mb``); ``--in-turns-only`` runs
those rows alone, for as many rounds as a precise ratio needs (one round's moves by a few percent here).

Two workloads, both always run:

* ``demo``: par4d's demo batch (``BATCH`` = 32 sequences of 128 tokens, ``CONFIG``).
* ``comm-bound``: one sequence of 32 tokens per rank (global batch: world size x 32), where
  DDP's all-reduce is a large share of its step (how that batch was chosen, by measurement:
  docs/benchmarks.md). Every run measures the share again (DDP's ``exposed_comm_s``: its
  s/iter minus that of the same step under ``no_sync()``), and the text output says when it
  falls below a third.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from par4d.bench.common import (
    check_cluster,
    emit,
    grid_row,
    in_rounds,
    in_turns_times,
    launch,
    link_bytes,
    pooled,
    spread,
    sum_over_ranks,
    where,
)
from par4d.bench.torch_peers import KINDS, C10dBytes, destroy_groups, peer_mesh, tp_shape
from par4d.compiled import compile_afresh
from par4d.grid import staged_splits, validate_sizes
from par4d.launch import distributed_env, init, join
from par4d.launch.cluster import link_bits_per_second
from par4d.launch.host import cpu_cores, threads_per_rank
from par4d.launch.peak import measure_matmul_peak
from par4d.layout import block
from par4d.measure.grids import (
    BATCH,
    CONFIG,
    TrainingStep,
    batch,
    compile_seconds,
    grids,
    measure_grid,
    time_iterations,
)
from par4d.models import ReferenceGPT
from par4d.overlap import BUCKET_MB, Overlap

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

NAMES = {"ddp": "torch DDP", "fsdp": "torch FSDP2", "hsdp": "torch HSDP", "tp": "torch FSDP2+TP"}
# The knobs a user would turn for a small model whose sync is exposed: DDP's buckets cut smaller, so the
# all-reduce starts earlier in backward, or its gradients left as views of its buckets (no copy out after the sum,
# as par4d's); FSDP2's gathered weights kept for backward (no second all-gather).
KNOBS: dict[str, list[dict]] = {"ddp": [{}, {"bucket_cap_mb": 1}, {"gradient_as_bucket_view": True}],
                                "fsdp": [{}, {"reshard_after_forward": False}],
                                "hsdp": [{}, {"reshard_after_forward": False}], "tp": [{}]}


def rows_in_rounds(par4d_rows: Callable[[Workload], list[dict]], ddp_row: Callable[[dict, Workload], dict],
                   settings: PeersSettings) -> list[dict]:
    """par4d's rows and DDP's (the peer with par4d's best grid's algorithm, and no mesh) per knob, each workload's,
    timed in rounds, the order reversed every other round (the row timed first after a change of model ran up to
    6% slower here), each row's rounds pooled. ``in_turns_only``: DDP's rows alone, each stepping par4d's
    data-parallel step in turns with DDP's."""
    runs = ([lambda w=w: par4d_rows(w) for w in workloads(settings.world) if not settings.in_turns_only]
            + [lambda w=w, knob=knob: [ddp_row(knob, w)] for knob in KNOBS["ddp"] for w in workloads(settings.world)])
    return [pooled(parts) for parts in in_rounds(runs, settings.rounds)]


def peer_name(kind: str, knob: dict) -> str:
    extra = {"bucket_cap_mb": "{} MB buckets", "reshard_after_forward": "reshard {}",
             "gradient_as_bucket_view": "gradients as bucket views"}       # (a switch: no value to show)
    words = [extra[k].format(v) for k, v in knob.items()]
    return NAMES[kind] + (f" ({', '.join(words)})" if words else "")


COMM_BOUND_SHARE = 1 / 3   # DDP's exposed all-reduce share the comm-bound batch is meant to reach
COMM_BOUND_SEQ_LEN = 32    # tokens per sequence of the comm-bound batch (one sequence per rank): module docstring


@dataclass(frozen=True)
class PeersSettings:
    nproc: int              # ranks per node (all ranks without nodes)
    nodes: int | None       # None: local ranks, no emulated cluster
    iters: int
    peak_flops: float
    link: str = "1gbit"
    rounds: int = 1         # par4d's rows and DDP's timed this many times, in alternating order, times pooled
    compile: str = "none"   # every model's blocks compiled by this backend (par4d.compiled), par4d's and the peers'
    in_turns_only: bool = False   # DDP's rows alone, par4d's data=N step in turns with each: the precise comparison

    @property
    def world(self) -> int:
        return self.nproc * (self.nodes or 1)

    def node_of_ranks(self) -> tuple[int, ...]:
        """Each rank's node (the emulated cluster puts ranks on nodes in order)."""
        return tuple(rank // self.nproc for rank in range(self.world))


@dataclass(frozen=True)
class Workload:
    name: str
    sequences: int          # global batch
    seq_len: int            # tokens per sequence

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len



def workloads(world: int) -> list[Workload]:
    """Both workloads on ``world`` ranks (see the module docstring for how comm-bound's batch was chosen)."""
    return [Workload("demo", BATCH, CONFIG.block_size), Workload("comm-bound", world, COMM_BOUND_SEQ_LEN)]


def validate(nproc: int, nodes: int | None, iters: int, rounds: int = 1) -> None:
    """Every check that can fail, on the arguments alone: a bad shape must not surface as a hang mid-job."""
    if nproc < 1 or iters < 1 or rounds < 1:
        raise ValueError(f"--nproc, --iters and --rounds must be >= 1 (got {nproc}, {iters}, {rounds})")
    if nodes is not None and nodes < 1:
        raise ValueError(f"--nodes must be >= 1 (got {nodes})")
    world = nproc * (nodes or 1)
    if nodes is None and nproc % 2:
        raise ValueError(f"--nproc {nproc}: HSDP's (2, nproc/2) mesh and TP over 2 of the local ranks need an even "
                         f"--nproc (or give --nodes)")
    tp = tp_shape(nproc, nodes)[1]
    if CONFIG.n_head % tp:
        raise ValueError(f"FSDP2+TP: TP over {tp} ranks (the ranks of a node) does not divide the model's "
                         f"{CONFIG.n_head} attention heads")
    for w in workloads(world):
        if w.sequences % world:
            raise ValueError(f"the {w.name} batch of {w.sequences} sequences does not divide over {world} ranks")
        if not grids(world, batch=w.sequences):
            raise ValueError(f"no par4d grid of {world} ranks divides the benchmark model {CONFIG} "
                             f"and the {w.name} batch of {w.sequences} sequences")


def qkv_rows_by_rank(dim: int, tp: int) -> torch.Tensor:
    """Row order of a fused qkv weight (q, k, v blocks of ``dim`` rows) after which ColwiseParallel's
    contiguous split over ``tp`` ranks gives rank r the q, k and v rows of its own heads."""
    return torch.arange(3 * dim).view(3, tp, dim // tp).transpose(0, 1).reshape(-1)


class TPAttention(nn.Module):
    """The twin's attention with its heads split over ``tp`` ranks: qkv ColwiseParallel and proj
    RowwiseParallel leave each rank a local width ``dim / tp`` the twin's forward (which reshapes
    with the global head count) cannot take. Reorders qkv's rows in place (see qkv_rows_by_rank),
    so the sharded model computes exactly the twin's function. Keeps the names ``qkv`` and ``proj``."""

    def __init__(self, attn: nn.Module, tp: int):
        super().__init__()
        if attn.n_head % tp:
            raise ValueError(f"TP over {tp} ranks does not divide {attn.n_head} attention heads")
        self.qkv, self.proj, self.local_heads = attn.qkv, attn.proj, attn.n_head // tp
        order = qkv_rows_by_rank(attn.proj.in_features, tp)
        with torch.no_grad():
            self.qkv.weight.copy_(self.qkv.weight[order])
            self.qkv.bias.copy_(self.qkv.bias[order])

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """As the twin's block calls its attention (``documents``: the benchmarks train without them)."""
        if documents is not None:
            raise ValueError("TPAttention keeps no document mask: the peers' benchmarks train without one")
        batch_, seq, _ = h.shape
        q, k, v = self.qkv(h).chunk(3, dim=-1)     # this rank's heads: q, k, v of width dim / tp each
        width = q.shape[-1]
        q, k, v = (t.view(batch_, seq, self.local_heads, width // self.local_heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(batch_, seq, width))


class PeerBytes(C10dBytes):
    """bench grid's c10d counter, plus the functional collectives DTensor issues (TP). Ops on
    DTensors are passed back (NotImplemented, as torch's CommDebugMode does), so DTensor runs
    them with this mode still on and the collectives they turn into are seen here."""

    FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace.startswith("_c10d_functional") and name.startswith(self.FUNCTIONAL):
            inputs = args[0]
            for t in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
                self.bytes += t.numel() * t.element_size()
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass(frozen=True)
class _Peer:
    name: str
    model: nn.Module
    sizes: dict[str, int]             # par4d's axes it matches: x = TP, z = sharded, data = replicated
    data_parts: int                   # the global batch is split in this many blocks ...
    data_index: int                   # ... and this rank trains on this one


def _build(kind: str, knob: dict, mesh: DeviceMesh | None, settings: PeersSettings) -> _Peer:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    world, rank, name = settings.world, dist.get_rank(), peer_name(kind, knob)
    model = ReferenceGPT(CONFIG)
    if mesh is None:
        return _Peer(name, DistributedDataParallel(model, **knob), {"data": world}, world, rank)
    if kind == "tp":
        dp, tp = mesh.shape
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
        for layer in model.blocks:
            layer.attn = TPAttention(layer.attn, tp)
            parallelize_module(layer, mesh["tp"], plan)
        shard_mesh, peer = mesh["dp"], _Peer(name, model, {"x": tp, "z": dp}, dp, rank // tp)
    elif kind == "hsdp":
        replicate, shard = mesh.shape
        shard_mesh, peer = mesh, _Peer(name, model, {"z": shard, "data": replicate}, world, rank)
    else:
        shard_mesh, peer = mesh, _Peer(name, model, {"z": world}, world, rank)
    for layer in model.blocks:
        fully_shard(layer, mesh=shard_mesh, **knob)
    fully_shard(model, mesh=shard_mesh, **knob)
    return peer


def _for_workload(row: dict, workload: Workload, peak_flops: float) -> dict:
    """``grid_row`` assumes the demo batch; recount tokens/s and % of peak for ``workload``'s tokens
    (attention's FLOPs per token grow with the sequence length)."""
    tokens_per_s = row["tokens_per_s"] * workload.tokens / (BATCH * CONFIG.block_size)
    flops_per_token = dataclasses.replace(CONFIG, block_size=workload.seq_len).flops_per_token()
    row.update(workload=workload.name, global_batch=workload.sequences, seq_len=workload.seq_len,
               tokens_per_s=tokens_per_s, percent_of_peak=100 * flops_per_token * tokens_per_s / peak_flops)
    return row


def _bench_par4d(sizes: dict[str, int], workload: Workload, settings: PeersSettings, hierarchical: str) -> dict:
    times, per_rank, (link, staged, compiling) = measure_grid(
        sizes, settings.iters, workload.sequences, workload.seq_len, hierarchical=hierarchical,
        compile=settings.compile,
        then=lambda grid, step: (link_bytes(step), [",".join(axes) for axes in grid.staged_axes()],
                                 step.compile_seconds))
    name = "par4d" if hierarchical == "off" else "par4d +hierarchical"   # staged_axes: what auto kept staged
    row = grid_row(name, sizes, times, sum_over_ranks(per_rank), settings.peak_flops, "ledger")
    row.update(hierarchical=hierarchical, staged_axes=staged, link_bytes_per_iter=link, times=times,
               compile=settings.compile, compile_s=compiling)     # (beyond a timed step's: measure_grid)
    return _for_workload(row, workload, settings.peak_flops)


def _par4d_rows(workload: Workload, settings: PeersSettings) -> list[dict]:
    """Every grid with its collectives flat; again with them staged where the grid has a group that spans nodes
    (a row per switch: what staging alone buys)."""
    rows = []
    for sizes in grids(settings.world, batch=workload.sequences):
        rows.append(_bench_par4d(sizes, workload, settings, "off"))
        if settings.nodes and staged_splits(validate_sizes(sizes, settings.world), settings.node_of_ranks()):
            rows.append(_bench_par4d(sizes, workload, settings, "auto"))
    return rows


def bucket_mb_of(knob: dict) -> float:
    """A DDP row's bucket size (its ``bucket_cap_mb``, else DDP's default): par4d's data-parallel step stepped beside
    it sums in buckets of that size (``Overlap.bucket_mb``), the same algorithm. Across a slow link the size decides
    how much of the sum is left after backward (docs/benchmarks.md)."""
    return knob.get("bucket_cap_mb", BUCKET_MB)


def _par4d_beside(workload: Workload, settings: PeersSettings, bucket_mb: float = BUCKET_MB) -> TrainingStep:
    """par4d's step on DDP's algorithm (data over every rank, its collectives flat, buckets of ``bucket_mb``), to be
    timed in turns with DDP's: rows timed minutes apart moved by more than the two differ. Stepped once (untimed: its
    optimizer's state made, compiled where compiling) before the timed turns."""
    step = TrainingStep(init(data=settings.world, hierarchical="off"), workload.sequences, workload.seq_len,
                        overlap=Overlap(bucket_mb=bucket_mb), compile=settings.compile)
    step()
    return step


def _bench_torch(kind: str, knob: dict, mesh: DeviceMesh | None, workload: Workload, settings: PeersSettings) -> dict:
    peer = _build(kind, knob, mesh, settings)
    model = peer.model
    compile_afresh(model, settings.compile)       # the twin's blocks, as par4d's (after FSDP2 wraps them, as DDP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = batch(workload.sequences, workload.seq_len)
    rows = block(workload.sequences, peer.data_parts, peer.data_index)
    x, y = inputs[rows], targets[rows]

    def step(sync: bool = True) -> None:
        if sync:
            model(x, y).backward()
        else:
            with model.no_sync():
                model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    compiling = time_iterations(step, 1, 0)[0] if settings.compile != "none" else None   # as measure_grid
    extra: dict = {"compile": settings.compile}
    if kind == "ddp":
        # DDP's reducer all-reduces below Python: count its gradient bytes, all-reduced once per step.
        per_rank, source = sum(p.numel() * p.element_size() for p in model.parameters()), "gradient bytes"
        bucket_mb = bucket_mb_of(knob)
        beside = _par4d_beside(workload, settings, bucket_mb)
        times, local, paired = in_turns_times([step, lambda: step(sync=False), beside], settings.iters)
        beside.grid.close()
        extra.update(par4d_in_turns_times=paired, par4d_bucket_mb=bucket_mb)
        exposed = statistics.median(times) - statistics.median(local)
        extra.update(exposed_comm_s=exposed, exposed_comm_share=exposed / statistics.median(times),
                     compute_s=statistics.median(local), local_times=local)
    else:
        times = time_iterations(step, settings.iters)
        counter = PeerBytes()   # one more, untimed iteration: the dispatch hook costs time
        with counter:
            step()
        per_rank, source = counter.bytes, "c10d dispatch"
    extra["link_bytes_per_iter"] = link_bytes(step)      # untimed iterations, synchronized (DDP's too)
    extra["times"] = times
    extra["compile_s"] = compile_seconds(compiling, times)
    row = grid_row(peer.name, peer.sizes, times, sum_over_ranks(per_rank), settings.peak_flops, source)
    return _for_workload(dict(row, **extra), workload, settings.peak_flops)


def peers_worker(settings: PeersSettings) -> list[dict]:
    join(distributed_env())    # the emulated cluster starts bare ranks; under torchrun this joins its job
    # Every rank of every (emulated) node shares this machine's cores.
    torch.set_num_threads(threads_per_rank(settings.world))
    rows = rows_in_rounds(lambda w: _par4d_rows(w, settings),
                          lambda knob, w: _bench_torch("ddp", knob, None, w, settings), settings)
    for kind in (k for k in KINDS if k != "ddp" and not settings.in_turns_only):
        # One mesh per peer for both workloads, its groups destroyed after: DTensor caches sharding decisions,
        # meshes in them included, per *equal* mesh (same shape and names), so a second mesh like the first
        # would be handed the first one's destroyed groups.
        mesh = peer_mesh(kind, settings.world, settings.nproc, settings.nodes)
        rows += [pooled([_bench_torch(kind, knob, mesh, workload, settings)])
                 for knob in KNOBS[kind] for workload in workloads(settings.world)]
        if mesh is not None:
            destroy_groups(mesh)
    order = [workload.name for workload in workloads(settings.world)]
    rows.sort(key=lambda r: order.index(r["workload"]))     # stable: per workload, par4d rows, then torch's
    for row in rows:
        row["matmul_peak_gflops"] = settings.peak_flops / 1e9
    add_floor(rows, settings)
    dist.destroy_process_group()
    return rows


def floor_link_seconds(settings: PeersSettings) -> float:
    """The least time the link takes per iteration for data parallelism: each node sends
    ``2 (nodes - 1) / nodes`` of the gradient bytes over its link (and receives as much), at the link's rate;
    0 on local ranks."""
    if not settings.nodes or settings.nodes < 2:
        return 0.0
    gradient_bytes = CONFIG.num_params() * 4       # fp32
    return 2 * (settings.nodes - 1) / settings.nodes * gradient_bytes * 8 / link_bits_per_second(settings.link)


def add_floor(rows: list[dict], settings: PeersSettings) -> None:
    """Every row's ``floor_s_per_iter``: the compute of one rank's share (DDP's step under ``no_sync()``, on the
    same ranks at once: the cores shared as in every row) plus :func:`floor_link_seconds`."""
    for workload in {r["workload"] for r in rows}:
        ddp = next(r for r in rows if r["workload"] == workload and r["name"] == NAMES["ddp"])
        floor = ddp["compute_s"] + floor_link_seconds(settings)
        for r in rows:
            if r["workload"] == workload:
                r["floor_s_per_iter"] = floor


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set every row's ``ratio_to_best_peer``: its s/iter over the fastest torch row's of its
    workload (None where a workload has no torch row)."""
    best: dict[str, float] = {}
    for r in rows:
        if r["framework"] == "torch":
            best[r["workload"]] = min(best.get(r["workload"], float("inf")), r["s_per_iter"])
    for r in rows:
        peer = best.get(r["workload"])
        r["ratio_to_best_peer"] = r["s_per_iter"] / peer if peer else None
    return rows


def _buckets(ddp: dict) -> str:
    """par4d's bucket size in an in-turns line, where it is not the default (it is the DDP row's)."""
    mb = ddp.get("par4d_bucket_mb", BUCKET_MB)
    return "" if mb == BUCKET_MB else f" ({mb:g} MB buckets)"


def in_turns(rows: list[dict], workload: str) -> list[str]:
    """A line per DDP row of ``workload`` that stepped par4d's data-parallel step in turns with its own
    (``par4d_in_turns_s``): both medians and their ratio, each round's ratio summarized."""
    return [f"{workload}: par4d data={ddp['grid'].split('data=')[1]}{_buckets(ddp)} against {ddp['name']} stepped "
            f"in turns: {ddp['par4d_in_turns_s']:.4f} against {ddp['s_per_iter']:.4f} s/iter, "
            f"{ddp['par4d_in_turns_s'] / ddp['s_per_iter']:.3f}x" + spread(ddp.get("par4d_in_turns_ratios", []))
            for ddp in rows if ddp["workload"] == workload and ddp["name"].startswith(NAMES["ddp"])
            and ddp.get("par4d_in_turns_s") is not None]


def summary(rows: list[dict], workload: str) -> str:
    """One line: par4d's best grid of ``workload`` and its ratio to the best torch row."""
    mine = [r for r in rows if r["workload"] == workload]
    ours = min((r for r in mine if r["framework"] == "par4d"), key=lambda r: r["s_per_iter"], default=None)
    peer = min((r for r in mine if r["framework"] == "torch"), key=lambda r: r["s_per_iter"], default=None)
    if ours is None or peer is None:
        return f"{workload}: no {'par4d' if ours is None else 'torch'} row"
    return (f"{workload}: par4d's best grid {ours['grid']} takes {ours['s_per_iter']:.3f} s/iter, "
            f"{ours['ratio_to_best_peer']:.2f}x the best peer ({peer['name']}, {peer['s_per_iter']:.3f} s/iter)")


def markdown(rows: list[dict]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    def mb(value: float | None) -> str:
        return "" if value is None else f"{value / 1e6:.2f}"

    lines = ["| name | grid (x y z data) | s/iter (median) | x best peer | x floor | tokens/s | % of peak | MB/iter | "
             "bytes from | link MB/iter | DDP exposed comm s | compiling s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        floor = r["s_per_iter"] / r["floor_s_per_iter"] if r.get("floor_s_per_iter") else None
        lines.append(f"| {r['name']} | {r['grid']} | {r['s_per_iter']:.3f} | {fmt(r['ratio_to_best_peer'], '.2f')} | "
                     f"{fmt(floor, '.2f')} | {r['tokens_per_s']:,.0f} | {r['percent_of_peak']:.1f} | "
                     f"{r['bytes_per_iter'] / 1e6:.2f} | {r['bytes_source']} | {mb(r.get('link_bytes_per_iter'))} | "
                     f"{fmt(r.get('exposed_comm_s'), '.3f')} | {fmt(r.get('compile_s'), '.1f')} |")
    return "\n".join(lines)


def run_bench_peers(args: argparse.Namespace) -> int:
    validate(args.nproc, args.nodes, args.iters, args.rounds)
    check_cluster(args.nproc, args.nodes, args.link)
    # The peak is measured before the ranks exist, so nothing competes for the cores.
    settings = PeersSettings(args.nproc, args.nodes, args.iters, measure_matmul_peak(threads=cpu_cores()), args.link,
                             args.rounds, args.compile, args.in_turns_only)
    rows = add_ratios(launch(peers_worker, (settings,), args.nproc, args.nodes, args.link, "par4d-bench-peers"))
    if emit(rows, args.out, args.json):
        sys.stdout.flush()
        return 0
    print(f"GPT {CONFIG.n_layer} layers x {CONFIG.n_embd} wide, {CONFIG.num_params():,} params, "
          f"{where(args.nproc, args.nodes, args.link)}, median of {args.iters} iterations (par4d's rows and DDP's: "
          f"x {args.rounds} rounds); matmul peak {rows[0]['matmul_peak_gflops']:.0f} GFLOP/s fp32"
          + (f"; every model's blocks compiled ({args.compile}), the compiling step timed apart"
             if args.compile != "none" else ""))
    for w in workloads(settings.world):
        mine = [r for r in rows if r["workload"] == w.name]
        print(f"\n### {w.name}: global batch {w.sequences} x {w.seq_len} tokens\n")
        print(markdown(mine))
        ddp = next(r for r in mine if r["name"] == NAMES["ddp"])
        low = (f"; below {COMM_BOUND_SHARE:.0%}: not communication-bound on these ranks"
               if w.name == "comm-bound" and ddp["exposed_comm_share"] < COMM_BOUND_SHARE else "")
        print(f"\nDDP's exposed all-reduce: {ddp['exposed_comm_s']:.3f} s of {ddp['s_per_iter']:.3f} s/iter "
              f"({ddp['exposed_comm_share']:.0%}{low}). The floor: {ddp['floor_s_per_iter']:.3f} s/iter (one rank's "
              f"compute, DDP under no_sync(), {ddp['compute_s']:.3f} s, plus the least link time, "
              f"{floor_link_seconds(settings):.3f} s)")
    print()
    for w in workloads(settings.world) if not settings.in_turns_only else ():    # (no par4d grid row to sum up)
        print(summary(rows, w.name))
    for line in (line for w in workloads(settings.world) for line in in_turns(rows, w.name)):
        print(line)
    sys.stdout.flush()
    return 0


__all__ = ["TPAttention", "add_ratios", "in_turns", "markdown", "qkv_rows_by_rank", "run_bench_peers", "summary",
           "validate"]
