"""``par4d bench pipeline``: par4d's message-driven pipeline against torch.distributed.pipelining.

One job of ``world`` ranks, every rank on the pipe axis (grid ``pipe=world``): the same GPT,
split at the same stage boundaries (``GPTConfig.stage_blocks(world)``), one stage per rank.
Rows, all on the same ranks, timed in interleaved rounds (each round runs every row: one
untimed warm-up step, then ``iters`` timed steps), so drift of the machine spreads over all
rows alike:

* ``par4d``: :func:`par4d.train.step.train_step` on a pipe grid, the pipeline's stats read by its
  ``after_backward`` hook: :func:`par4d.pipeline.run_pipeline` (no fixed schedule: a stage runs
  whatever message arrives first, at most ``pipe`` microbatches in flight), the gradient sync
  (nothing to sum on a pipe-only grid) and an AdamW step, on par4d's GPT
  (:func:`par4d.train.recipes.gpt.build_gpt`).
* ``torch GPipe`` and ``torch 1F1B``: par4d's plain-PyTorch twin (:func:`build_reference`) cut
  at the same boundaries (``wte``/``wpe`` on stage 0, ``blocks[i]`` of the stage's range,
  ``ln_f``/``head`` on the last stage, cross-entropy as the schedule's ``loss_fn``), wrapped in
  ``torch.distributed.pipelining.PipelineStage`` and run by ``ScheduleGPipe`` and
  ``Schedule1F1B`` with the same microbatches, global batch and AdamW.
  ``ScheduleInterleaved1F1B`` (and the other multi-stage schedules) does not apply: it
  interleaves *several* stages per rank (virtual stages), and here each rank holds exactly
  one stage, the same one as par4d's rank; with one stage per rank it is 1F1B.

On a pipe-only grid every other axis has size 1, so par4d's layers run PyTorch's own fused
kernels (``F.linear``, ``F.layer_norm``: nothing to gather or sum) and both frameworks do the
same arithmetic per stage (the losses agree to the last bit in practice); what differs is the
pipeline around it: the order of work, the messages and their bookkeeping. Every rank gets
``cores // world`` torch threads (at least one): emulated nodes share this machine's cores, as
in ``bench peers``.

Loss and correctness guard. torch's ``loss_fn`` is applied per microbatch (here the
microbatch's mean cross-entropy) and, with ``scale_grads=True`` (the default), the gradients
are divided by the number of microbatches: with equal microbatches (the batch must divide by
``--microbatches``) that is the gradient of the mean loss over the batch, and the mean of the
per-microbatch losses is the batch's mean loss, which is what par4d's pipeline returns. Before
any timing, every row runs two steps from the same initial weights on the same batch; the worker
raises unless each torch row's loss agrees with par4d's to 1e-5 relative at both (the second
loss is after one AdamW step: it checks the gradients too). Rows carry both losses.

Measured per row (per rank, every timed iteration):

* ``s_per_iter``: median over iterations of the slowest rank's seconds from a barrier to the
  end of its optimizer step.
* ``bubble_fraction``: per stage ``1 - compute / wall``, where ``wall`` is the seconds from the
  barrier to the end of the pipeline call (``run_pipeline`` / ``schedule.step``; the optimizer
  step is outside) and ``compute`` is the sum of the stage's timed forward and backward calls:
  every call of the stage module's forward (par4d: ``model.stage_forward``, loss included on
  the last stage; torch: the stage module's ``forward`` and, on the last stage, the
  ``loss_fn`` call) and every call of ``torch.autograd.backward`` (both frameworks' backward
  goes through it: ``Tensor.backward`` in par4d, ``stage_backward`` in torch), each timed with
  ``time.perf_counter``. Everything else on the stage (waiting for messages, sending, the
  frameworks' bookkeeping) counts as bubble. Median over iterations per stage
  (``bubble_by_stage``), then the largest over stages.
* ``peak_activation_bytes``: per stage, the most microbatches held at once (a microbatch is
  held from the start of its forward to the end of its backward, from the timed calls; most
  over the timed iterations: ``max_in_flight_by_stage``) times the stage's bytes saved for
  backward per microbatch, measured once (in the first guard step) with
  ``torch.autograd.graph.saved_tensors_hooks``: the storage bytes of every tensor saved for
  backward during a microbatch's forward, each storage once, parameters' storages left out
  (``activation_bytes_by_stage``); the largest product over stages. It counts what autograd
  keeps, not the allocator's peak (no CUDA on this machine): temporaries freed during the
  forward are not in it, and neither are the messages in flight.
* ``ratio_to_best_torch``: the row's s/iter over the fastest torch row's.
* ``handoff_ms``: median milliseconds from the end of the call that produced a message
  (forward m on stage s, backward m on stage s+1) to the start of the call that used it on the
  receiving stage, over the messages the receiver sat idle for: what passing a microbatch on
  costs on the critical path (sending, receiving, waking the receiver), from the timed calls
  on one clock (below).

The second workload, ``--slow-stage K --slow-ms T``: stage K sleeps T ms at the start of every
microbatch's forward, in both frameworks alike (inside the timed forward: it counts as compute).
The third, ``--jitter-ms J``: every stage's forward sleeps a pseudo-random draw in [0, J) ms,
the same n-th draw on a stage for every row (stage times that vary microbatch by microbatch, as
with uneven sequences or a shared link).
A fixed schedule waits for the slow stage in its fixed order; the message-driven one runs
whatever is ready. Emulated nodes (``--nodes``, one rank per node) put a slow link between
every pair of stages instead (or as well).

``--plot F.png``: the timeline of one iteration (the one of median wall time among the timed
ones), per stage, which microbatch's forward and backward ran when: par4d and the fastest
torch schedule, one panel each, on one time axis. Times are ``time.perf_counter``'s, which on
Linux is the machine's ``CLOCK_MONOTONIC``: one clock for every rank, since local ranks and
emulated nodes all run on this machine (ranks on separate machines would need their clocks
aligned first); the origin is the first rank's return from the barrier.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from par4d.bench.common import check_cluster, emit, launch, where
from par4d.bench.pipeline_timeline import (
    Clock,
    best_torch,
    bubble,
    handoff_ms,
    held_at_once,
    merged,
    one_clock,
    plot,
    saved_bytes,
)
from par4d.grid import Grid
from par4d.launch import init
from par4d.launch.host import threads_per_rank
from par4d.models import GPT, GPTConfig
from par4d.train.recipes.gpt import build_gpt, build_reference
from par4d.train.step import train_step

SCHEDULES = (("torch GPipe", "ScheduleGPipe"), ("torch 1F1B", "Schedule1F1B"))
"""The torch rows: (name, schedule class in torch.distributed.pipelining)."""
ROWS = ("par4d",) + tuple(name for name, _ in SCHEDULES)
LOSS_RTOL = 1e-5
LR = 1e-3


@dataclass(frozen=True)
class PipelineBench:
    world: int
    config: GPTConfig
    batch: int              # global batch, in sequences (every stage sees all of it: no data axis)
    microbatches: int
    iters: int
    rounds: int
    ranks_here: int         # ranks sharing this machine's cores
    slow_stage: int | None = None
    slow_ms: float = 0.0
    jitter_ms: float = 0.0  # every forward also sleeps a draw in [0, jitter_ms)
    seed: int = 0           # of the batch's tokens

    def delay(self, stage: int) -> Callable[[], float] | None:
        """Seconds to sleep before each forward call on ``stage``, call after call (None: never).
        Draw n is the same for every row (seeded by stage and n; every row makes the same
        calls in the same order), so the rows meet the same delays."""
        if not self.jitter_ms and stage != self.slow_stage:
            return None
        fixed = self.slow_ms / 1e3 if stage == self.slow_stage else 0.0
        calls = itertools.count()

        def seconds() -> float:
            return fixed + random.Random(f"{self.seed}-{stage}-{next(calls)}").random() * self.jitter_ms / 1e3
        return seconds


class TwinStage(nn.Module):
    """One pipeline stage of par4d's plain-PyTorch twin: ``wte``/``wpe`` on the first, the
    twin's ``blocks[i]`` of ``blocks``, ``ln_f`` and ``head`` on the last (logits out: the loss is
    the schedule's ``loss_fn``)."""

    def __init__(self, twin: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = twin.wte, twin.wpe
        self.blocks = nn.ModuleList(twin.blocks[i] for i in blocks)
        if last:
            self.ln_f, self.head = twin.ln_f, twin.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.wte(h) + self.wpe(torch.arange(h.shape[1], device=h.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h)) if self.last else h


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The microbatch's mean cross-entropy (the twin's loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _Row:
    """One row's model, optimizer and step on this rank; ``step(clock, x, y, began)`` returns (the
    batch's mean loss: on every stage for par4d, on the last for torch and None elsewhere, seconds
    from ``began`` to the end of the pipeline call, the step's timed calls)."""

    name: str
    framework: str
    stage: int
    module: nn.Module

    def step(self, clock: Clock, x: torch.Tensor, y: torch.Tensor, began: float):
        raise NotImplementedError


class _Par4dRow(_Row):
    def __init__(self, bench: PipelineBench, grid: Grid, clock: Clock):
        self.name, self.framework, self.grid, self.bench = "par4d", "par4d", grid, bench
        self.module = model = build_gpt(bench.config, grid)
        self.stage = grid.coord("pipe")
        # an instance attribute: what run_pipeline calls
        model.stage_forward = clock.timed(model.stage_forward, bench.delay(self.stage))
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self, clock: Clock, x: torch.Tensor, y: torch.Tensor, began: float):
        clock.begin(count_forwards=True)
        seen = {}

        def after_backward(stats) -> None:    # the pipeline's order, and its end before the sync and step
            seen.update(stats=stats, piped=time.perf_counter() - began)

        loss = train_step(self.module, self.opt, self.grid, (x, y), microbatches=self.bench.microbatches,
                          after_backward=after_backward)
        stats, piped = seen["stats"], seen["piped"]
        events = clock.end()
        if [e[0] for e in events] != [o[0] for o in stats.order]:
            raise RuntimeError(f"par4d stage {self.stage}: timed calls {[e[0] for e in events]} do not match "
                               f"the pipeline's order {stats.order}")
        for event, done in zip(events, stats.order):
            event[1] = int(done[1:])
        return float(loss), piped, events


class _TorchRow(_Row):
    def __init__(self, name: str, schedule: str, bench: PipelineBench, clock: Clock):
        from torch.distributed import pipelining

        self.name, self.framework, self.bench = name, "torch", bench
        self.stage, stages = dist.get_rank(), bench.world         # stage i on rank i: torch's default placement
        blocks = bench.config.stage_blocks(stages)[self.stage]
        first, self.last = self.stage == 0, self.stage == stages - 1
        self.module = TwinStage(build_reference(bench.config), blocks, first, self.last)
        self.module.forward = clock.timed(self.module.forward, bench.delay(self.stage))
        self.pipe_stage = pipelining.PipelineStage(self.module, self.stage, stages, torch.device("cpu"))
        for method in ("forward_one_chunk", "backward_one_chunk"):   # tell the clock which microbatch runs
            setattr(self.pipe_stage, method, self._telling(clock, getattr(self.pipe_stage, method)))
        self.schedule = getattr(pipelining, schedule)(self.pipe_stage, bench.microbatches,
                                                      loss_fn=clock.timed(cross_entropy), scale_grads=True)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)
        self.first = first

    @staticmethod
    def _telling(clock: Clock, method: Callable) -> Callable:
        def call(chunk_id, *args, **kwargs):
            clock.micro = chunk_id
            return method(chunk_id, *args, **kwargs)
        return call

    def step(self, clock: Clock, x: torch.Tensor, y: torch.Tensor, began: float):
        clock.begin(count_forwards=False)
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(x, return_outputs=False)
        elif self.last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        piped = time.perf_counter() - began
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        events = clock.end()
        return (float(torch.stack(losses).detach().mean()) if self.last else None), piped, events


def _broadcast_loss(row: _Row, loss: float | None) -> float:
    """The row's loss on every rank (torch has it on the last stage only)."""
    if row.framework == "par4d":
        return loss
    t = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64)
    dist.broadcast(t, src=dist.get_world_size() - 1)
    return t.item()


def _guard(rows: list[_Row], clock: Clock, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, dict]:
    """Two steps of every row from the same initial weights; raises unless every torch row's losses
    agree with par4d's to LOSS_RTOL. Returns {row: [loss, loss]} and {row: saved bytes per microbatch}
    (this stage's, the most of any microbatch, measured in the first step)."""
    losses, saved = {}, {}
    for row in rows:
        losses[row.name] = []
        for step in range(2):
            dist.barrier()
            if step == 0:
                with saved_bytes(clock, row.module) as per_micro:
                    loss, _, _ = row.step(clock, x, y, time.perf_counter())
                saved[row.name] = max(per_micro.values(), default=0)
            else:
                loss, _, _ = row.step(clock, x, y, time.perf_counter())
            losses[row.name].append(_broadcast_loss(row, loss))
    ours = losses["par4d"]
    for name, theirs in losses.items():
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if abs(a - b) > LOSS_RTOL * abs(a):
                raise AssertionError(f"{name}'s loss at guard step {step} is {b!r}, par4d's {a!r}: not the same "
                                     f"function (relative difference {abs(a - b) / abs(a):.2e} > {LOSS_RTOL:g})")
    return losses, saved


def pipeline_worker(bench: PipelineBench) -> dict | None:
    """Every row on this job's ranks; rank 0 returns {"rows": [...], "timelines": {row: [(stage, kind,
    microbatch, start, end), ...]}} (others None). Leaves the job joined."""
    torch.set_num_threads(threads_per_rank(bench.ranks_here))
    grid = init(pipe=bench.world)
    clock = Clock()
    gen = torch.Generator().manual_seed(bench.seed)
    tokens = torch.randint(0, bench.config.vocab_size, (bench.batch, bench.config.block_size + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with clock.installed():
        rows: list[_Row] = [_Par4dRow(bench, grid, clock)]
        rows += [_TorchRow(name, schedule, bench, clock) for name, schedule in SCHEDULES]
        losses, saved = _guard(rows, clock, x, y)
        runs = {row.name: [] for row in rows}       # (step s, pipeline s, events from began, began) per timed iteration
        for _ in range(bench.rounds):
            for row in rows:
                dist.barrier()
                row.step(clock, x, y, time.perf_counter())        # warm-up
                for _ in range(bench.iters):
                    dist.barrier()
                    began = time.perf_counter()
                    _, piped, events = row.step(clock, x, y, began)
                    wall = time.perf_counter() - began
                    runs[row.name].append((wall, piped, [[k, m, s - began, e - began] for k, m, s, e in events],
                                           began))
    result = _results(bench, grid, rows, runs, losses, saved)
    grid.close()
    return result


def _results(bench: PipelineBench, grid: Grid, rows: list[_Row], runs: dict, losses: dict, saved: dict) -> dict | None:
    mine, picked = {}, {}
    for row in rows:
        walls = torch.tensor([r[0] for r in runs[row.name]], dtype=torch.float64)
        dist.all_reduce(walls, op=dist.ReduceOp.MAX)               # an iteration lasts as long as its slowest rank
        median = statistics.median(walls.tolist())
        index = min(range(len(walls)), key=lambda i: abs(walls[i].item() - median))
        mine[row.name] = {"stage": row.stage, "s_per_iter": median,
                          "bubble": statistics.median(bubble(r[2], r[1]) for r in runs[row.name]),
                          "held": max(held_at_once(r[2]) for r in runs[row.name]),
                          "saved": saved[row.name],
                          "iterations": [(r[3], merged(r[2])) for r in runs[row.name]]}
        picked[row.name] = index
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    out, timelines = [], {}
    blocks = [f"{b.start}-{b.stop - 1}" for b in bench.config.stage_blocks(bench.world)]
    for row in rows:
        per_stage = sorted((r[row.name] for r in every), key=lambda r: r["stage"])
        held = [r["held"] for r in per_stage]
        saved_by = [r["saved"] for r in per_stage]
        bubbles = [r["bubble"] for r in per_stage]
        out.append({"framework": row.framework, "name": row.name, "grid": grid.describe(), "stages": bench.world,
                    "stage_blocks": blocks, "microbatches": bench.microbatches,
                    "s_per_iter": per_stage[0]["s_per_iter"], "iters": len(runs[row.name]),
                    "bubble_fraction": max(bubbles), "bubble_by_stage": bubbles,
                    "peak_activation_bytes": max(h * s for h, s in zip(held, saved_by)),
                    "max_in_flight_by_stage": held, "activation_bytes_by_stage": saved_by,
                    "loss_first_step": losses[row.name][0], "loss_second_step": losses[row.name][1],
                    "loss_rel_diff_to_par4d": max(abs(a - b) / abs(a) for a, b in zip(losses["par4d"],
                                                                                      losses[row.name])),
                    "slow_stage": bench.slow_stage, "slow_ms": bench.slow_ms if bench.slow_stage is not None else 0.0,
                    "jitter_ms": bench.jitter_ms})
        iterations = [one_clock(per_stage, i) for i in range(len(runs[row.name]))]
        timelines[row.name] = iterations[picked[row.name]]
        out[-1]["handoff_ms"] = handoff_ms(iterations, bench.world)
    best = min(r["s_per_iter"] for r in out if r["framework"] == "torch")
    for r in out:
        r["ratio_to_best_torch"] = r["s_per_iter"] / best
    return {"rows": out, "timelines": timelines}


def launched_worker(bench: PipelineBench) -> dict | None:
    result = pipeline_worker(bench)
    dist.destroy_process_group()
    return result


def settings(args: argparse.Namespace) -> PipelineBench:
    """The benchmark's settings from the command line; every check that can fail, before any rank starts."""
    if args.iters < 1 or args.rounds < 1:
        raise ValueError(f"--iters and --rounds must be >= 1 (got {args.iters}, {args.rounds})")
    if args.nproc < 1 or (args.nodes is not None and args.nodes < 1):
        raise ValueError(f"--nproc and --nodes must be >= 1 (got {args.nproc}, {args.nodes})")
    world = args.nproc * (args.nodes or 1)
    if world < 2:
        raise ValueError(f"bench pipeline needs at least 2 ranks (pipe >= 2); got {world}")
    config = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd,
                       n_head=args.n_head)
    config.stage_blocks(world)                           # at least one block per stage
    GPT(config, grid=Grid.virtual({"pipe": world}))      # shape errors before any rank starts
    m = args.microbatches
    if not world <= m <= args.batch_size:
        raise ValueError(f"--microbatches {m}: give {world} (the stages: torch's 1F1B needs at least one "
                         f"microbatch per stage) to --batch-size {args.batch_size}")
    if args.batch_size % m:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --microbatches {m} (torch's "
                         f"schedules average per-microbatch mean losses: equal microbatches make that the "
                         f"batch's mean)")
    slow_stage, slow_ms = getattr(args, "slow_stage", None), getattr(args, "slow_ms", 0.0) or 0.0
    if slow_stage is not None and not 0 <= slow_stage < world:
        raise ValueError(f"--slow-stage {slow_stage}: give a stage 0 to {world - 1}")
    if (slow_stage is None) != (slow_ms <= 0):
        raise ValueError("--slow-stage and --slow-ms go together (a stage, and its sleep in ms > 0 per forward)")
    jitter_ms = getattr(args, "jitter_ms", 0.0) or 0.0
    if jitter_ms < 0:
        raise ValueError(f"--jitter-ms {jitter_ms}: give a sleep of at least 0 ms")
    return PipelineBench(world, config, args.batch_size, m, args.iters, args.rounds, world, slow_stage, slow_ms,
                         jitter_ms)


def markdown(rows: list[dict]) -> str:
    lines = ["| row | s/iter (median) | x best torch | bubble (worst stage) | bubble by stage | held at once "
             "by stage | peak activations MB | hand-off ms |",
             "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for r in rows:
        bubbles = " ".join(f"{b:.2f}" for b in r["bubble_by_stage"])
        held = " ".join(str(h) for h in r["max_in_flight_by_stage"])
        lines.append(f"| {r['name']} | {r['s_per_iter']:.3f} | {r['ratio_to_best_torch']:.2f}x | "
                     f"{r['bubble_fraction']:.2f} | {bubbles} | {held} | {r['peak_activation_bytes'] / 1e6:.1f} | "
                     f"{'' if r['handoff_ms'] is None else format(r['handoff_ms'], '.2f')} |")
    return "\n".join(lines)


def run_bench_pipeline(args: argparse.Namespace) -> int:
    bench = settings(args)
    check_cluster(args.nproc, args.nodes, args.link)
    result = launch(launched_worker, (bench,), args.nproc, args.nodes, args.link, "par4d-bench-pipeline")
    rows, ranks = result["rows"], where(args.nproc, args.nodes, args.link)
    config = bench.config
    slow = (f"stage {bench.slow_stage} sleeps {bench.slow_ms:g} ms per forward" if bench.slow_stage is not None
            else "no slow stage")
    if bench.jitter_ms:
        slow += f", every forward sleeps a draw in [0, {bench.jitter_ms:g}) ms"
    for row in rows:
        row.update(workload=f"GPT {config.n_layer}x{config.n_embd}, batch {bench.batch}x{config.block_size}",
                   where=ranks)
    header = (f"GPT {config.n_layer} blocks x {config.n_embd} wide ({config.num_params():,} params), global batch "
              f"{bench.batch} x {config.block_size} tokens in {bench.microbatches} microbatches, pipe={bench.world} "
              f"(blocks {', '.join(rows[0]['stage_blocks'])}), {ranks}, {slow}; median of {args.iters} x "
              f"{args.rounds} rounds")
    if args.plot:
        plot(result["timelines"], rows, args.plot, header)
    if not emit(rows, args.out, args.json):
        print(header)
        print(markdown(rows))
        print(f"losses agree: par4d {rows[0]['loss_first_step']:.6f} then {rows[0]['loss_second_step']:.6f}; "
              f"largest relative difference of a torch row "
              f"{max(r['loss_rel_diff_to_par4d'] for r in rows):.1e}")
    sys.stdout.flush()
    return 0


__all__ = ["ROWS", "SCHEDULES", "PipelineBench", "TwinStage", "best_torch", "markdown", "pipeline_worker", "plot",
           "run_bench_pipeline", "settings"]
