"""``par4d bench peers --model hf-llama`` (or ``hf-gpt2``): a Hugging Face model made parallel by
``par4d.parallelize`` against what that model's users run, side by side in one job on the same ranks.

The model (:data:`SHAPES`) is built once per row from the same seed, so every row starts from the same
weights and trains on the same global batch in fp32; each row's first loss is reported, and they agree
to fp32 rounding. Rows:

* par4d on every grid that divides the model and the batch, every overlap on (``--hierarchical`` off
  and, where a group spans nodes, auto, as for par4d's GPT); on grids with y > 1 also with the residual
  stream kept whole (``par4d (stream whole)``: ``parallelize(shard_stream=False)``, what sharding it over
  y saves, :mod:`par4d.adopt.stream`);
* torch DDP (and with 1 MB buckets, and with its gradients as views of its buckets), FSDP2 (``fully_shard``
  per decoder layer and the root; and with ``reshard_after_forward=False``), HSDP (the node as its shard
  group), and for Llama FSDP2 + tensor parallelism with ``parallelize_module`` and the standard Llama plan:
  q, k, v, gate and up column-wise, o and down row-wise, TP inside a node and FSDP across (GPT-2 has no TP
  row: its ``Conv1D`` layers are not layers ``parallelize_module`` shards, and its fused q, k, v would be cut
  across q, k and v).
  Each DDP row (every knob) also times par4d's data-parallel step in turns with DDP's, as the GPT's bench
  does (``par4d_in_turns_s``: rows timed minutes apart move by more than the two differ).

Memory per rank, the largest over ranks: ``state_bytes`` (this rank's parameters, gradients and AdamW
state after a step, counted exactly) and ``peak_bytes`` (the peak of one more step as torch's own
``MemTracker`` counts it, with ``peak_bytes_by_kind``: parameters, gradients, optimizer state,
activations, temporaries).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from par4d.bench.common import (
    check_cluster,
    emit,
    in_turns_times,
    launch,
    link_bytes,
    pooled,
    sum_over_ranks,
    where,
)
from par4d.bench.peers import (
    COMM_BOUND_SEQ_LEN,
    KNOBS,
    PeerBytes,
    PeersSettings,
    Workload,
    add_ratios,
    bucket_mb_of,
    in_turns,
    markdown,
    peer_name,
    rows_in_rounds,
    summary,
)
from par4d.bench.torch_peers import destroy_groups, peer_mesh, tp_shape
from par4d.compiled import compile_afresh
from par4d.grid import Grid, staged_splits, validate_sizes
from par4d.launch import distributed_env, init, join
from par4d.launch.cluster import link_bits_per_second
from par4d.launch.host import cpu_cores, threads_per_rank
from par4d.launch.peak import measure_matmul_peak
from par4d.layout import block, shard_batch
from par4d.measure.grids import WARMUP, compile_seconds, time_iterations
from par4d.overlap import BUCKET_MB
from par4d.plan.cost import factorizations

MODELS = ("hf-llama", "hf-gpt2")
BATCH, SEQ_LEN = 32, 128        # the demo workload: par4d's demo batch
SHAPES = {"hf-llama": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                           tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
          "hf-gpt2": dict(vocab_size=256, n_embd=128, n_layer=4, n_head=4, n_positions=SEQ_LEN, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)}
# The standard Llama plan of torch's tensor parallelism (per decoder layer).
LLAMA_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise"}


def build_lm(model: str) -> nn.Module:
    """The benchmark's Hugging Face model, fp32, its weights drawn from seed 0 (the same in every row)."""
    from par4d.nn.float8 import quiet_torchao

    with quiet_torchao():     # transformers' model classes import torchao
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model == "hf-llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPES[model])).float()
    return GPT2LMHeadModel(GPT2Config(**SHAPES[model])).float()


def flops_per_token(lm: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus causal attention's scores (forward and backward)."""
    weights = sum(m.weight.numel() for m in lm.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    config = lm.config
    return 6 * weights + 6 * config.num_hidden_layers * config.hidden_size * seq_len


def workloads(world: int) -> list[Workload]:
    return [Workload("demo", BATCH, SEQ_LEN), Workload("comm-bound", world, COMM_BOUND_SEQ_LEN)]


def batch(size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(lm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(lm(input_ids=x).logits.flatten(0, 1), y.flatten())


def validate(model: str, nproc: int, nodes: int | None, iters: int, rounds: int) -> None:
    """Every check that can fail, on the arguments alone, before any rank starts."""
    if model not in MODELS:
        raise ValueError(f"--model {model}: give gpt (par4d's own) or one of {', '.join(MODELS)}")
    if nproc < 1 or iters < 1 or rounds < 1:
        raise ValueError(f"--nproc, --iters and --rounds must be >= 1 (got {nproc}, {iters}, {rounds})")
    world = nproc * (nodes or 1)
    if nodes is None and nproc % 2:
        raise ValueError(f"--nproc {nproc}: HSDP's (2, nproc/2) mesh and TP over 2 of the local ranks need an even "
                         f"--nproc (or give --nodes)")
    heads, kv = SHAPES["hf-llama"]["num_attention_heads"], SHAPES["hf-llama"]["num_key_value_heads"]
    tp = tp_shape(nproc, nodes)[1]
    if model == "hf-llama" and (heads % tp or kv % tp):
        raise ValueError(f"FSDP2+TP: TP over {tp} ranks (the ranks of a node) does not divide the model's {heads} "
                         f"query and {kv} key/value heads")
    for w in workloads(world):
        if w.sequences % world:
            raise ValueError(f"the {w.name} batch of {w.sequences} sequences does not divide over {world} ranks")


def _grids(model: str, world: int, sequences: int) -> list[dict[str, int]]:
    """Every (x, y, z, data) of ``world`` ranks whose batch shards divide ``sequences`` and on which
    ``parallelize`` can cut every layer of the model (x that does not divide the heads leaves attention lone)."""
    from par4d.adopt import parallelize

    out = []
    for sizes in factorizations(world):
        if sequences % (sizes["z"] * sizes["data"]):
            continue
        with torch.device("meta"):
            lm = build_lm(model)
        try:
            parallelize(lm, Grid.virtual(sizes))
        except ValueError:
            continue
        out.append(sizes)
    return out


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (DTensors: their local shards)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _max_over_ranks(value: float) -> int:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _peak(step: Callable[[], torch.Tensor], model: nn.Module, optimizer) -> dict[str, int]:
    """Peak bytes of one more (untimed) step, by kind, as torch's MemTracker counts this rank's tensors:
    parameters, gradients, optimizer state, activations and temporaries, total; the largest over ranks.
    Tensors made on other threads (par4d's staged collectives' lanes) are not seen. ORS's deferred weight
    gradients (z > 1) reach MemTracker's gradient hook as None (autograd has none for them: the reduce-scatter
    writes them after backward), so the total holds them under another kind than gradients; its warning about
    the None, once per such weight and rank, is silenced."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass of tensor, "
                                "but got <class 'NoneType'>", category=UserWarning)
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    kinds = {"param": "PARAM", "grad": "GRAD", "optimizer": "OPT", "activation": "ACT", "temporary": "TEMP"}
    by_kind = {name: sum(v for k, v in peak.items() if str(k).endswith("." + key)) for name, key in kinds.items()}
    return {name: _max_over_ranks(v) for name, v in dict(by_kind, total=peak["Total"]).items()}


@dataclass(frozen=True)
class _Timed:
    times: list[float]
    first_loss: float
    state_bytes: int
    peak_bytes: dict[str, int] | None     # None: not measured (compiled blocks)
    first_s: float          # the first step's seconds (compiling, where the blocks are compiled)
    beside: list[float] | None = None      # the step timed in turns with these (par4d's beside DDP's)


def _time(step: Callable[[], torch.Tensor], model: nn.Module, optimizer, iters: int, compiled: bool,
          beside: Callable[[], object] | None = None) -> _Timed:
    """The first step's loss and seconds, ``iters`` timed steps (in turns with ``beside``'s, where given), and the
    memory of one more step (not with compiled blocks: torch's MemTracker warns on every tensor they hand it, and
    its count there is unchecked)."""
    start = time.perf_counter()
    first = step()          # the first step's loss: the same weights and batch in every row
    loss = first.detach().reshape(1).double()
    first_s = time.perf_counter() - start
    dist.all_reduce(loss)
    times, paired = (time_iterations(step, iters), None) if beside is None else in_turns_times([step, beside], iters)
    return _Timed(times, loss.item() / dist.get_world_size(), _max_over_ranks(_state_bytes(model, optimizer)),
                  None if compiled else _peak(step, model, optimizer), first_s, paired)


def _row(name: str, sizes: dict, timed: _Timed, per_rank_bytes: float, source: str, workload: Workload,
         flops: float, peak: float, compile: str) -> dict:
    s = statistics.median(timed.times)
    tokens = workload.tokens / s
    return {"framework": "par4d" if name.startswith("par4d") else "torch", "name": name,
            "grid": " ".join(f"{a}={sizes.get(a, 1)}" for a in ("x", "y", "z", "data")), "workload": workload.name,
            "global_batch": workload.sequences, "seq_len": workload.seq_len, "s_per_iter": s, "tokens_per_s": tokens,
            "percent_of_peak": 100 * flops * tokens / peak, "bytes_per_iter": int(sum_over_ranks(per_rank_bytes)),
            "bytes_source": source, "iters": len(timed.times), "times": timed.times, "first_loss": timed.first_loss,
            "state_bytes": timed.state_bytes, "peak_bytes": timed.peak_bytes and timed.peak_bytes["total"],
            "peak_bytes_by_kind": timed.peak_bytes, "compile": compile,
            "compile_s": compile_seconds(timed.first_s if compile != "none" else None, timed.times)}


class _Par4dStep(NamedTuple):
    """par4d's training step of the model on a grid, to call repeatedly, and what its row reports."""
    grid: Grid
    net: nn.Module
    optimizer: torch.optim.Optimizer
    flops: float
    step: Callable[[], torch.Tensor]


def _par4d_step(model: str, sizes: dict, workload: Workload, settings: PeersSettings, hierarchical: str,
                shard_stream: bool = True, bucket_mb: float = BUCKET_MB) -> _Par4dStep:
    from par4d.adopt import parallelize
    from par4d.adopt.causal_lm import CausalLM
    from par4d.overlap import Overlap, set_overlap
    from par4d.train.step import train_step

    grid = init(**sizes, hierarchical=hierarchical)
    lm = build_lm(model)
    flops = flops_per_token(lm, workload.seq_len)
    overlap = Overlap(bucket_mb=bucket_mb)      # every overlap on, as train
    net = set_overlap(CausalLM(parallelize(lm, grid, shard_stream=shard_stream), flops, 0), overlap)
    compile_afresh(net, settings.compile)       # its decoder layers, as the peers'
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    inputs, targets = batch(workload.sequences, workload.seq_len)
    x, y = shard_batch(grid, inputs), shard_batch(grid, targets)
    return _Par4dStep(grid, net, optimizer, flops, lambda: train_step(net, optimizer, grid, (x, y)))


def _bench_par4d(model: str, sizes: dict, workload: Workload, settings: PeersSettings, hierarchical: str,
                 shard_stream: bool = True) -> dict:
    grid, net, optimizer, flops, step = _par4d_step(model, sizes, workload, settings, hierarchical, shard_stream)
    before = grid.ledger.total_bytes()
    timed = _time(step, net, optimizer, settings.iters, settings.compile != "none")
    steps = 1 + WARMUP + settings.iters + 1        # the first, warm-up, timed, and MemTracker's (_time)
    per_rank = (grid.ledger.total_bytes() - before) / steps
    link, staged = link_bytes(step), [",".join(axes) for axes in grid.staged_axes()]
    grid.close()
    name = ("par4d" if hierarchical == "off" else "par4d +hierarchical") + ("" if shard_stream else " (stream whole)")
    row = _row(name, sizes, timed, per_rank, "ledger", workload, flops, settings.peak_flops, settings.compile)
    return dict(row, hierarchical=hierarchical, staged_axes=staged, link_bytes_per_iter=link)


def _par4d_rows(model: str, workload: Workload, settings: PeersSettings) -> list[dict]:
    rows = []
    for sizes in _grids(model, settings.world, workload.sequences):
        rows.append(_bench_par4d(model, sizes, workload, settings, "off"))
        if sizes["y"] > 1:                   # the same grid with the residual stream whole between blocks
            rows.append(_bench_par4d(model, sizes, workload, settings, "off", shard_stream=False))
        if settings.nodes and staged_splits(validate_sizes(sizes, settings.world), settings.node_of_ranks()):
            rows.append(_bench_par4d(model, sizes, workload, settings, "auto"))
    return rows


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {name: ColwiseParallel() if kind == "colwise" else RowwiseParallel() for name, kind in LLAMA_TP.items()}


def _build_peer(kind: str, knob: dict, mesh, model: str, settings: PeersSettings) -> tuple[nn.Module, dict, int, int]:
    """(the peer's model, par4d's axes it matches, the batch's parts, this rank's part)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    world, rank = settings.world, dist.get_rank()
    lm = build_lm(model)
    if mesh is None:
        return DistributedDataParallel(lm, **knob), {"data": world}, world, rank
    layers = lm.model.layers if model == "hf-llama" else lm.transformer.h
    if kind == "tp":
        dp, tp = mesh.shape
        for layer in layers:
            parallelize_module(layer, mesh["tp"], _tp_plan())
        shard_mesh, sizes, parts, index = mesh["dp"], {"x": tp, "z": dp}, dp, rank // tp
    elif kind == "hsdp":
        replicate, shard = mesh.shape
        shard_mesh, sizes, parts, index = mesh, {"z": shard, "data": replicate}, world, rank
    else:
        shard_mesh, sizes, parts, index = mesh, {"z": world}, world, rank
    for layer in layers:
        fully_shard(layer, mesh=shard_mesh, **knob)
    fully_shard(lm, mesh=shard_mesh, **knob)
    return lm, sizes, parts, index


def _bench_torch(kind: str, knob: dict, mesh, model: str, workload: Workload, settings: PeersSettings) -> dict:
    net, sizes, parts, index = _build_peer(kind, knob, mesh, model, settings)
    flops = flops_per_token(net.module if kind == "ddp" else net, workload.seq_len)
    compile_afresh(net, settings.compile)        # the decoder layers, as par4d's (after FSDP2 wraps them, as DDP)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    inputs, targets = batch(workload.sequences, workload.seq_len)
    rows = block(workload.sequences, parts, index)
    x, y = inputs[rows], targets[rows]

    def step() -> torch.Tensor:
        loss = _loss(net, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    beside, bucket_mb = None, bucket_mb_of(knob)
    if kind == "ddp":
        # par4d's data-parallel step (collectives flat) timed in turns with DDP's, as bench peers does; stepped once
        # first (untimed: its optimizer's state made, compiled where compiling)
        beside = _par4d_step(model, {"data": settings.world}, workload, settings, "off",
                             bucket_mb=bucket_mb)      # DDP's buckets: the same algorithm
        beside.step()
    timed = _time(step, net, optimizer, settings.iters, settings.compile != "none", beside.step if beside else None)
    if beside is not None:
        beside.grid.close()
    if kind == "ddp":   # DDP's reducer all-reduces below Python: its gradient bytes, once per step
        per_rank, source = sum(p.numel() * p.element_size() for p in net.parameters()), "gradient bytes"
    else:
        counter = PeerBytes()
        with counter:
            step()
        per_rank, source = counter.bytes, "c10d dispatch"
    row = _row(peer_name(kind, knob), sizes, timed, per_rank, source, workload, flops, settings.peak_flops,
               settings.compile)
    return dict(row, link_bytes_per_iter=link_bytes(step),
                **({"par4d_in_turns_times": timed.beside, "par4d_bucket_mb": bucket_mb}
                   if timed.beside is not None else {}))


def hf_peers_worker(model: str, settings: PeersSettings) -> list[dict]:
    join(distributed_env())
    torch.set_num_threads(threads_per_rank(settings.world))
    kinds = ("ddp", "fsdp", "hsdp", "tp") if model == "hf-llama" else ("ddp", "fsdp", "hsdp")
    rows = rows_in_rounds(lambda w: _par4d_rows(model, w, settings),
                          lambda knob, w: _bench_torch("ddp", knob, None, model, w, settings), settings)
    for kind in kinds[1:] if not settings.in_turns_only else ():
        mesh = peer_mesh(kind, settings.world, settings.nproc, settings.nodes)   # one per peer: bench peers' why
        rows += [pooled([_bench_torch(kind, knob, mesh, model, w, settings)])
                 for knob in KNOBS[kind] for w in workloads(settings.world)]
        destroy_groups(mesh)
    order = [w.name for w in workloads(settings.world)]
    rows.sort(key=lambda r: order.index(r["workload"]))
    for row in rows:
        row["model"] = model
        row["matmul_peak_gflops"] = settings.peak_flops / 1e9
    dist.destroy_process_group()
    return rows


def _memory_table(rows: list[dict]) -> str:
    def mb(value: int | None) -> str:
        return "-" if value is None else f"{value / 1e6:.1f}"

    lines = ["| name | grid (x y z data) | s/iter | x best peer | first loss | state MB/rank | peak MB/rank | "
             "of it activations |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['name']} | {r['grid']} | {r['s_per_iter']:.3f} | {r['ratio_to_best_peer']:.2f} | "
              f"{r['first_loss']:.6f} | {mb(r['state_bytes'])} | {mb(r['peak_bytes'])} | "
              f"{mb((r['peak_bytes_by_kind'] or {}).get('activation'))} |" for r in rows]
    return "\n".join(lines)


def run_bench_hf_peers(args: argparse.Namespace) -> int:
    validate(args.model, args.nproc, args.nodes, args.iters, args.rounds)
    check_cluster(args.nproc, args.nodes, args.link)
    settings = PeersSettings(args.nproc, args.nodes, args.iters, measure_matmul_peak(threads=cpu_cores()), args.link,
                             args.rounds, args.compile, args.in_turns_only)
    rows = add_ratios(launch(hf_peers_worker, (args.model, settings), args.nproc, args.nodes, args.link,
                             "par4d-bench-hf-peers"))
    if emit(rows, args.out, args.json):
        sys.stdout.flush()
        return 0
    lm = build_lm(args.model)
    print(f"{args.model}: {type(lm).__name__} {SHAPES[args.model]}, {sum(p.numel() for p in lm.parameters()):,} "
          f"params, fp32, {where(args.nproc, args.nodes, args.link)}, median of {args.iters} iterations (par4d's rows "
          f"and DDP's: x {args.rounds} rounds); matmul peak {rows[0]['matmul_peak_gflops']:.0f} GFLOP/s fp32")
    if args.nodes:
        link = 2 * (args.nodes - 1) / args.nodes * 4 * sum(p.numel() for p in lm.parameters())
        print(f"the least link time for data parallelism: {link * 8 / link_bits_per_second(args.link):.3f} s/iter")
    for w in workloads(settings.world):
        mine = [r for r in rows if r["workload"] == w.name]
        print(f"\n### {w.name}: global batch {w.sequences} x {w.seq_len} tokens\n")
        print(markdown(mine))
        print()
        print(_memory_table(mine))
    print()
    for w in workloads(settings.world) if not settings.in_turns_only else ():    # (no par4d grid row to sum up)
        print(summary(rows, w.name))
    for line in (line for w in workloads(settings.world) for line in in_turns(rows, w.name)):
        print(line)
    sys.stdout.flush()
    return 0


__all__ = ["LLAMA_TP", "MODELS", "SHAPES", "build_lm", "run_bench_hf_peers", "validate"]
