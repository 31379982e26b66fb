"""The training job behind ``par4d train``: runs on every rank of the job."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from par4d import checkpoint
from par4d.compiled import Compiled, compile_blocks, counted
from par4d.folder import Folder
from par4d.launch import distributed_env, init
from par4d.launch.host import threads_per_rank
from par4d.launch.local import ECHO_GRACE_S, PEER_GONE
from par4d.launch.peak import job_peak
from par4d.ledger import in_flight_seconds
from par4d.nn.float8 import float8, float8_summary
from par4d.nn.moe import expert_metrics
from par4d.optim.data_parallel import global_mean
from par4d.optim.precision import FullPrecision, MixedPrecision, Precision, fused_adamw, parse_precision
from par4d.pipeline import evaluate_pipeline
from par4d.rank0 import on_rank0
from par4d.train.board import Board, resident
from par4d.train.config import TrainConfig
from par4d.train.data import Batches, Images, training_data
from par4d.train.faults import Faults
from par4d.train.footprint import measure_footprint
from par4d.train.lock import RunLock, held_by_launcher
from par4d.train.recipes import build_model, recipe
from par4d.train.run_files import (
    METRICS,
    PLOT,
    SETTINGS,
    SUMMARY,
    failure_log,
    new_run_dir,
    read_metrics,
    restart_count,
)
from par4d.train.say import say
from par4d.train.settings_file import resolved
from par4d.train.step import train_step
from par4d.train.stop import StopRequest


def _threads_per_rank() -> int:
    """Share this node's cores among its ranks."""
    env = distributed_env()
    return threads_per_rank(env.local_world_size if env else 1)


def run(config: TrainConfig, stop: StopRequest) -> dict:
    """Train on this rank; rank 0 writes the run directory. Returns rank 0's summary
    (``stopped``: the signal and step, when a signal stopped the run early)."""
    torch.set_num_threads(_threads_per_rank())
    grid = init(**config.grid, hierarchical=config.hierarchical)
    if config.out is None:  # under torchrun/srun: rank 0 names the run, the others follow
        config = replace(config, out=on_rank0(lambda: str(new_run_dir(config.grid))))
        config = replace(config, out=_broadcast(config.out))
    out = Path(config.out)
    # One run per folder: rank 0 holds its lock unless the launching process does (par4d's launcher).
    new = not config.resume and restart_count() == 0     # a restart goes on in its own folder
    lock = on_rank0(lambda: None if held_by_launcher(out) else RunLock(out, new=new))
    try:
        return _run(config, stop, grid, out)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class _Job:
    """What a rank trains with, assembled by :func:`_setup`; ``start_step``: where it goes on from."""

    config: TrainConfig
    model: torch.nn.Module
    precision: Precision             # steps the model; its masters (the model in fp32) are what is saved
    batches: Batches | Images
    source: str                      # where the batches come from (the corpus's path, or generated images)
    start_step: int
    resumed_from: dict | None        # the step and grid of the checkpoint resumed from
    restart: int                     # the elastic agent's attempt
    compiled: Compiled | None = None     # --compile: its blocks compiled (and dynamo's counts before)


def _run(config: TrainConfig, stop: StopRequest, grid, out: Path) -> dict:
    job = _setup(config, grid, out)
    run = Folder(out)
    # The machine's peak, best measured before the ranks exist (par4d's launcher does);
    # under torchrun/srun rank 0 measures on every core while the others wait.
    peak, peak_what = job.config.peak_flops, "fp32, every core"
    if job.config.matmul_peak is not None:      # --peak-flops: the user's, measured nowhere
        peak, peak_what = job.config.matmul_peak, "given by --peak-flops"
    else:
        if peak is None:     # on a GPU: one device's, in the compute dtype, times the ranks (one device each)
            dtype = job.precision.dtype
            peak, peak_what = on_rank0(lambda: job_peak(grid.device, dtype, grid.world_size)) or (0.0, "")
        peak_what += "; measured at start-up"
    metrics = on_rank0(lambda: _open_metrics(run, job.start_step))
    on_rank0(lambda: run.write_text(SETTINGS, text=resolved(job.config)))   # --config SETTINGS trains it again
    board = on_rank0(lambda: Board(run, job.start_step)) if job.config.tensorboard else None
    try:
        measured = _train(job, grid, stop, metrics, out, board, peak)
        if isinstance(measured, dict):    # stopped by a signal: its step saved
            grid.close()
            return measured
        val_loss = _evaluate(job.model, grid, job.batches, job.config.eval_batches, job.precision)
        measured.rss = _gathered(resident())   # every rank's resident memory
        measured.footprints = _gathered(measured.footprint)
        if board is not None:
            board.step(job.config.steps, {"val_loss": val_loss})
            board.final(job.config.steps, measured.rss, measured.footprints)
    finally:
        if metrics is not None:
            metrics.close()
        if board is not None:
            board.close()
    summary = on_rank0(lambda: _summarize(job, grid, run, measured, peak, peak_what, val_loss)) or {}
    grid.close()    # idle from here: a job that goes on (a test's pool of ranks) need not carry its groups
    return summary


def _setup(config: TrainConfig, grid, out: Path) -> _Job:
    """The model, its optimizer and data on this rank, from a checkpoint where the run resumes."""
    restart = restart_count()
    if restart and checkpoint.has_checkpoint(out):
        # Restarted by the elastic agent after a rank died: go on from the newest intact checkpoint
        # (not the one a --resume started from: this attempt may have saved newer ones). Rank 0
        # verifies every file; each rank then checks only the files it reads.
        chosen = _broadcast(on_rank0(lambda: _newest_intact(out)))
        config = replace(config, resume=chosen is not None, checkpoint=chosen)
    if config.resume and config.checkpoint is not None:
        # Checkpoints newer than the one resumed from failed verification: renamed aside (never deleted),
        # so that this run's saves and rotation never count them as its newest.
        on_rank0(lambda: checkpoint.set_aside_newer(out, Path(config.checkpoint), say))

    model = build_model(config, grid)
    if config.init_from and not config.resume:       # each rank reads its shards (where the build did not)
        recipe(config.model).load_pretrained(config, grid, model)
    if config.float8 != "none":        # before compiling (the compiled blocks call the layers' GEMM plans)
        float8(model, config.float8)
    compiled = compile_blocks(model, config.compile) if config.compile != "none" else None   # in place: names kept

    fused = fused_adamw(grid.device, offloaded=config.offload_bsize is not None)

    def adamw(params):
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95),
                                 fused=fused)

    # fp32 steps the model itself; mixed precision computes in bf16/fp16 with fp32 masters (what
    # checkpoints hold) and their AdamW beside it. The policy's masters are what is saved either way.
    precision = (MixedPrecision(model, grid, parse_precision(config.precision), adamw, config.grad_reduce == "fp32",
                                config.offload_bsize) if config.precision != "fp32"
                 else FullPrecision(model, grid, adamw(model.parameters())))
    batches, source = training_data(config)
    # config.checkpoint was verified whole before the ranks started (or by rank 0 on a restart)
    resumed = (checkpoint.load(out, grid, precision.masters, precision.optimizer, config.checkpoint,
                               verified=config.checkpoint is not None) if config.resume else None)
    if resumed:
        precision.load_masters()
    start_step = resumed["step"] if resumed else 0
    if restart:
        where = f"from step {start_step}, its newest intact checkpoint" if resumed else "from the start (no checkpoint)"
        on_rank0(lambda: say(f"restart {restart}: resuming {out} {where}"))
    resumed_from = None if resumed is None else {"step": resumed["step"], "grid": resumed["grid"]}
    return _Job(config, model, precision, batches, source, start_step, resumed_from, restart, compiled)


@dataclass
class _Measured:
    """Per step: tokens/s, and rank 0's (seconds with a collective in flight, seconds waited, step seconds);
    at the end, every rank's resident memory."""

    rates: list[float]
    comm: list[tuple[float, float, float]]
    rss: list[dict[str, int]] = field(default_factory=list)
    compiled: dict | None = None     # --compile: graphs, graph breaks and recompilations (Compiled.made)
    evaluation_graphs: int = 0       # dynamo's graphs made while evaluating (of a compiled run)
    footprint: dict[str, int] = field(default_factory=dict)      # this rank's, on the first step (footprint.py)
    footprints: list[dict] = field(default_factory=list)         # every rank's, at the end


def _train(job: _Job, grid, stop: StopRequest, metrics, out: Path, board: Board | None,
           peak: float) -> _Measured | dict:
    """The steps from ``job.start_step`` on, saving as the run says, the validation loss every
    ``--eval-every`` steps; what was measured, or (a signal stopped the run, its step saved) ``{"stopped": ...}``."""
    config, precision, batches = job.config, job.precision, job.batches
    flops_per_token = _flops_per_token(job)
    progress = _progress_bar(config, grid, job.start_step) if grid.rank == 0 else None
    tokens_per_step = batches.tokens_per_step
    measured = _Measured([], [])
    ledger = grid.ledger
    faults = Faults.from_env()
    try:
        for step in range(job.start_step, config.steps):
            began = time.perf_counter()
            bytes_before = ledger.total_bytes()
            lr = config.learning_rate(step)
            for group in precision.param_groups:
                group["lr"] = lr
            batch = _local(grid, batches.local_batch(grid, "train", step), precision)   # (x, y[, documents])
            report: dict = {}

            def run_step(batch=batch, report=report) -> torch.Tensor:
                return train_step(job.model, precision, grid, batch, grad_clip=config.grad_clip,
                                  microbatches=config.microbatches, pipeline_limit=config.pipeline_limit,
                                  report=report)

            with ledger.capture() as entries:
                if step == job.start_step:       # what the step holds, measured on the run's first step
                    losses: list[torch.Tensor] = []
                    measured.footprint = measure_footprint(job.model, precision,
                                                           lambda out=losses: out.append(run_step())).row()
                    loss = losses[0]
                    after_first = counted()     # (dynamo's: what compiling the blocks made)
                else:
                    loss = run_step()
                mean_loss = global_mean(loss, grid).item()
            if not math.isfinite(mean_loss):   # the same value on every rank: all stop here, none waits
                raise FloatingPointError(_not_finite(config, mean_loss, step, first=step == job.start_step, lr=lr))
            faults.after_step(grid.rank, step + 1, job.restart, stop)
            seconds = time.perf_counter() - began
            measured.rates.append(tokens_per_step / seconds)
            # Rank 0's communication: wall seconds with a collective in flight (issued), seconds waited (exposed).
            comm = (in_flight_seconds(entries), sum(e.seconds for e in entries), seconds)
            measured.comm.append(comm)
            moved = ledger.total_bytes() - bytes_before          # the step's, not the evaluation's
            evaluated = config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps
            val_loss = None
            if evaluated:       # without gradients: a compiled block's graph of its own, made once (not a recompile)
                before = counted()[0]
                val_loss = _evaluate(job.model, grid, batches, config.eval_batches, precision)
                measured.evaluation_graphs += counted()[0] - before
            if metrics is not None:
                record = {"step": step + 1, "loss": mean_loss, "tokens_per_s": tokens_per_step / seconds,
                          "s_per_step": seconds, "lr": lr, "comm_bytes": moved,
                          "comm_issued_s": comm[0], "comm_exposed_s": comm[1], **report}
                if val_loss is not None:
                    record["val_loss"] = val_loss
                if grid.size("pipe") > 1:    # rank 0's point-to-point bytes sent to its pipeline neighbours
                    record["p2p_sent_bytes"] = sum(e.bytes for e in entries if e.kind == "send")
                record.update(precision.metrics())   # mixed precision's loss scale and skipped steps
                record.update(expert_metrics(job.model))   # a mixture's load per layer (none without one)
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                if board is not None:
                    flops = flops_per_token * record["tokens_per_s"]
                    board.step(step + 1, dict(record, model_flops_per_s=flops, rss_bytes=resident()["now_bytes"],
                                              percent_of_peak=100 * flops / peak if peak else None))
                if progress is not None:
                    progress.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                         refresh=False)
                    progress.update(1)
            signum = stop.agreed(grid.device) if step + 1 < config.steps else None   # the last step ends it anyway
            if signum or (config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.steps):
                checkpoint.save(out, step + 1, grid, precision.masters, precision.optimizer, _meta(config),
                                config.keep)
            if signum:   # a scheduler's preemption or Ctrl-C: this step is saved, the next run resumes here
                return {"stopped": {"signal": signal.Signals(signum).name, "step": step + 1, "run": str(out)}}
    finally:
        if progress is not None:
            progress.close()
    checkpoint.save(out, config.steps, grid, precision.masters, precision.optimizer, _meta(config),
                    config.keep)   # kept if saved
    if job.compiled is not None and job.start_step < config.steps:
        measured.compiled = job.compiled.made(after_first, counted(), measured.evaluation_graphs)
    return measured


def _flops_per_token(job: _Job) -> float:
    """Training FLOPs per token (per pixel for images), as the model's recipe counts them."""
    return recipe(job.config.model).flops_per_token(job.config, job.model)


def _gathered(mine: dict) -> list[dict]:
    """Every rank's ``mine``, in rank order (collective)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every




def _summarize(job: _Job, grid, run: Folder, measured: _Measured, peak: float, peak_what: str,
               val_loss: float) -> dict:
    """Rank 0: the run's summary (steady-state rates: the first step, with its one-time warm-up, left out),
    written to summary.json with the loss plot."""
    config, model = job.config, job.model
    model_config, kind = config.model_config(), recipe(config.model)
    text = kind.data == "text"      # the async-pipeline paper's Eq 2 and 3 count language models' tokens
    history = read_metrics(run)
    steady = measured.rates[1:] if len(measured.rates) > 1 else measured.rates
    tokens_per_s = sum(steady) / len(steady) if steady else 0.0
    flops_per_token = _flops_per_token(job)
    flops = flops_per_token * tokens_per_s
    steady_comm = measured.comm[1:] if len(measured.comm) > 1 else measured.comm
    issued, exposed, step_s = (sum(c[i] for c in steady_comm) / max(1, len(steady_comm)) for i in range(3))
    resumed_from = job.resumed_from
    summary = {
        "grid": grid.sizes, "world_size": grid.world_size, "device": grid.device.type,
        "backend": dist.get_backend(), "model": config.model,
        "params": getattr(model, "num_params", None) or kind.num_params(config),
        "steps": config.steps, "start_step": job.start_step, "resumed_from": resumed_from,
        "grid_changed": resumed_from is not None and resumed_from["grid"] != grid.sizes,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": flops, "matmul_peak_flops_per_s": peak, "matmul_peak_of": peak_what,
        # The async-pipeline paper's Eq 3 (Narayanan's count) and Eq 2 (time to train on 300 B tokens):
        # the language models' (None for the U-Net); Eq 3 counts a dense model's FLOPs (None for a mixture).
        "eq3_flops_per_s": None if not text or config.mlp == "moe" else
        model_config.narayanan_flops(config.batch_size) / step_s if step_s else 0.0,
        "eq2_days_to_300b_tokens": None if not text else 3e11 / job.batches.tokens_per_step * step_s / 86400,
        "percent_of_peak": 100 * flops / peak if peak else 0.0,
        "overlap": config.overlap_run().describe(), "recompute_every": config.recompute_every(),
        "optimizer": job.precision.describe(config.grad_clip, config.overlap_settings().data_parallel),
        "s_per_step": step_s, "comm_issued_s_per_step": issued, "comm_exposed_s_per_step": exposed,
        # Which groups summed in stages across nodes: under --hierarchical auto a probe at start chose, and the
        # order of summation (the bits) follows the choice. Named by their axes of more than one rank (z,data
        # with z = 1 is data's group).
        "staged": sorted({",".join(a for a in axes if grid.size(a) > 1) for axes in grid.staged_axes()}),
        "initial_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "val_loss": val_loss, "data": job.source, "rss_per_rank": measured.rss,
        "footprint_per_rank": measured.footprints, "config": asdict(config),
        **({"expert_imbalance": history[-1]["expert_imbalance"]} if "expert_imbalance" in history[-1] else {}),
        **({"float8": float8_summary(model)} if config.float8 != "none" else {}),
        # The first step's seconds beyond a steady one's: compiling the blocks, besides the warm-up eager runs have
        **({"compiled": dict(measured.compiled,
                             first_step_extra_s=job.batches.tokens_per_step / measured.rates[0] - step_s)}
           if measured.compiled else {}),
    }
    run.write_text(SUMMARY, text=json.dumps(summary, indent=2))
    _plot(run, history, kind.loss_unit)
    return summary


def _newest_intact(out: Path) -> str | None:
    """The checkpoint a restart resumes from; None when none is intact (the first save was
    interrupted): the run starts over."""
    try:
        return str(checkpoint.choose(out, report=say))
    except ValueError as error:
        say(f"{error}; starting over")
        return None


def _broadcast(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _progress_bar(config: TrainConfig, grid, start_step: int):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=start_step, desc=f"train [{grid.describe()}]", unit="step",
                dynamic_ncols=True, mininterval=1.0)


def _local(grid, batch: tuple[torch.Tensor, ...], precision: Precision) -> tuple[torch.Tensor, ...]:
    """This rank's (inputs, targets[, documents]) on its device; images in the compute dtype."""
    return tuple(t.to(grid.device, precision.dtype if t.is_floating_point() else None) for t in batch)


@torch.no_grad()
def _evaluate(model: torch.nn.Module, grid, batches: Batches | Images, count: int,
              precision: Precision) -> float:
    total = 0.0
    for index in range(count):
        batch = _local(grid, batches.local_batch(grid, "val", index), precision)
        loss = evaluate_pipeline(model, grid, *batch) if grid.size("pipe") > 1 else model(*batch)
        total += global_mean(loss, grid).item()
    return total / max(1, count)


def _open_metrics(run: Folder, start_step: int):
    """Open metrics.jsonl for appending after ``start_step``: records of steps past the
    checkpoint (written before an interruption) are dropped, since they are re-run."""
    kept = [r for r in read_metrics(run) if r["step"] <= start_step] if start_step and run.exists(METRICS) else []
    # replaced whole: a kill here leaves the old history
    run.write_text(METRICS, text="".join(json.dumps(record) + "\n" for record in kept))
    return run.append(METRICS)


def _meta(config: TrainConfig) -> dict:
    return {"train_config": asdict(config), "model_config": asdict(config.model_config())}


def _plot(run: Folder, rows: list[dict], unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({unit})")
    ax.set_title(f"par4d train — {run.name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    run.write_with(PLOT, write=lambda f: fig.savefig(f, format="png", dpi=110), sync=False)
    plt.close(fig)


def worker(config: TrainConfig, exit_on_stop: bool = False) -> dict:
    """Entry point of each rank (picklable for torchrun's elastic agent). An error is
    written, with its traceback, to the run folder's ``logs/rank-<r>.log`` and raised.

    ``exit_on_stop``: under par4d's launcher, a rank that got a signal exits (status 128 + the
    signal's number) once its checkpoint is written, also when the signal came during the last
    step (the run then ended and saved as usual): the agent stops reading return values when it
    is signalled, and a rank returning one would wait for it until killed."""
    try:
        with StopRequest() as stop:
            summary = run(config, stop)
    except Exception as error:
        _log_failure(config)
        if any(words in str(error) for words in PEER_GONE):
            # An echo of a peer's failure: the peer's own goes first (launch.local). The agent, having read it,
            # stops this rank with SIGTERM (maybe already: then no wait), which ends the wait at once.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if stop.signum is None:
                time.sleep(ECHO_GRACE_S)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # The grid (a reference cycle) still holds its groups, whose gloo threads hold finished work
        # with Python callbacks: freed now, not at interpreter exit, where a thread taking the GIL
        # aborts the process (seen once under torchrun: SIGABRT after a complete run).
        gc.collect()
    if exit_on_stop and stop.signum:
        sys.stdout.flush()
        os._exit(128 + stop.signum)
    return summary


def _not_finite(config: TrainConfig, loss: float, step: int, first: bool, lr: float) -> str:
    """What a non-finite loss says. The loss of a new run's first step comes from weights no update has
    touched: the learning rate is not at fault, what the weights and tokens came from is."""
    said = f"the loss is {loss} at step {step + 1}"
    if not first or config.resume:     # a resumed run's weights came from its earlier updates
        return (f"{said} (learning rate {lr:.3g}): the run stops here without recording it (try a lower --lr, or "
                f"--grad-clip; a resume takes both)")
    if config.init_from is not None:
        source = (f"the weights or the config.json of {config.init_from} make the model non-finite (a value such "
                  f"as an epsilon, or weights with inf or NaN)")
    else:
        source = "the model's settings or the data make it non-finite"
    wide = " (or fp16's range: try --precision bf16)" if config.precision == "fp16" else ""
    return f"{said}, before any update: {source}{wide}, not the learning rate; the run stops without recording it"


def _log_failure(config: TrainConfig) -> None:
    import traceback

    env = distributed_env()
    if config.out is None:   # under torchrun/srun without --out: rank 0 had not named the run yet
        return
    rank = env.rank if env else 0
    path = failure_log(Path(config.out), rank)
    try:
        with Folder(config.out).append("logs", path.name) as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, attempt {restart_count()}:\n")
            log.write(traceback.format_exc() + "\n")
    except (OSError, ValueError):   # the log is a courtesy: the error itself still reaches the launcher
        pass
