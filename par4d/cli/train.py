"""``par4d train``: its arguments, turning them into a checked ``TrainConfig`` (a new run, or a resumed one),
launching local ranks or joining a torchrun/srun job, and printing the run's summary."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from par4d.train.config import IMAGE_CHANNELS, MODELS, UNUSED

DEFAULT_NPROC = 4   # local ranks when no launcher gives a world size (also calibrate's and bench grid's default)


def _default(name: str):
    from par4d.train.config import TrainConfig

    return TrainConfig.__dataclass_fields__[name].default


def _help(name: str, text: str = "") -> str:
    return f"{text} (default {_default(name)})" if text else f"default {_default(name)}"


# A resumed run keeps these (they decide the model and its batches); it takes HONOURED ones when given.
FIXED = ("model", "batch_size", "seq_len", "n_layer", "n_embd", "n_head", "mlp", "phantom_k", "image_size", "seed")
HONOURED = ("lr", "grad_clip", "save_every", "keep", "overlap", "recompute", "microbatches", "pipeline_limit",
            "precision", "grad_reduce", "offload_bsize")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train the GPT on text (the main job), or a U-Net on images",
        epilog="SIGTERM (a scheduler's preemption) or Ctrl-C: every rank saves the step it is on and the run exits "
               "with 128 + the signal's number; --resume goes on from there. Exit status 1: a rank failed (its "
               "traceback is in the run's logs/); 2: bad input, found before any rank started.")
    p.add_argument("--nproc", type=int, default=None,
                   help=f"local ranks to start (default: as many as --grid names, or the resumed run's grid, "
                        f"else {DEFAULT_NPROC}); under torchrun/srun the job's")
    p.add_argument("--grid", default=None,
                   help="axis sizes, e.g. x=2,z=2, or 'auto' for the planner's first choice "
                        "(default: picked from --nproc)")
    p.add_argument("--machine", default=None,
                   help="machine profile for --grid auto (default: calibrate this machine first, ~10 s)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"total optimizer steps (default {_default('steps')}; on --resume, the saved run's)")
    p.add_argument("--out", default=None, help="run directory (default: a new folder under runs/)")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR from its checkpoint, on its grid or another one (--grid)")
    p.add_argument("--init-from", nargs=2, metavar=("hf", "DIR"), default=None,
                   help="start from the weights of a Hugging Face GPT-2 folder (as par4d export writes it); "
                        "the model's shape defaults to its config.json's, each rank reads only its shards")
    p.add_argument("--data", default=None,
                   help="a UTF-8 text file for the language models (default: Python's bundled docs); a resumed "
                        "run checks it is the same")
    model = p.add_argument_group("model and batch (a resumed run keeps its own: a different value is refused)")
    model.add_argument("--model", choices=MODELS, default=None,
                       help=_help("model", "par4d's GPT, or Hugging Face's GPT-2 or Llama built from the sizes "
                                           "below and made parallel by par4d.parallelize, all on text; or unet: "
                                           "par4d's U-Net denoising images generated from --seed (mean squared "
                                           "error; its width is --n-embd, its levels --n-layer)"))
    model.add_argument("--batch-size", type=int, default=None,
                       help=_help("batch_size", "global batch, in sequences (unet: images)"))
    model.add_argument("--seq-len", type=int, default=None, help=_help("seq_len"))
    model.add_argument("--n-layer", type=int, default=None, help=_help("n_layer", "blocks (unet: levels)"))
    model.add_argument("--n-embd", type=int, default=None,
                       help=_help("n_embd", "embedding width (unet: channels inside)"))
    model.add_argument("--n-head", type=int, default=None, help=_help("n_head"))
    model.add_argument("--image-size", type=int, default=None,
                       help=_help("image_size", f"unet: images are {IMAGE_CHANNELS} x N x N, N divisible by "
                                                f"2 ** (levels - 1)"))
    model.add_argument("--mlp", choices=["dense", "phantom"], default=None,
                       help=_help("mlp", "phantom: phantom layers over x in every MLP (needs y = z = 1)"))
    model.add_argument("--phantom-k", type=int, default=None,
                       help=_help("phantom_k", "ghost neurons per phantom layer"))
    model.add_argument("--seed", type=int, default=None, help=_help("seed"))
    steps = p.add_argument_group("optimizer and schedule (a resumed run takes these when given)")
    steps.add_argument("--lr", type=float, default=None, help=_help("lr", "peak learning rate"))
    steps.add_argument("--grad-clip", type=float, default=None,
                       help=_help("grad_clip", "clip the global gradient norm to this (0: off)"))
    steps.add_argument("--overlap", default=None, metavar="all|none|LIST",
                       help=_help("overlap", "overlap communication with compute: all, none, or a comma list of "
                                             "oar,ors,oag,cache,dp (cache needs --recompute)"))
    steps.add_argument("--recompute", default=None, metavar="none|auto|N",
                       help=_help("recompute", "recompute activations in backward every N blocks; auto: the divisor "
                                               "of the block count closest to its square root"))
    steps.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                       help=_help("precision", "compute dtype; bf16 and fp16 keep fp32 master weights (what "
                                               "checkpoints hold), fp16 with a dynamic loss scale"))
    steps.add_argument("--grad-reduce", choices=["fp32", "compute"], default=None,
                       help=_help("grad_reduce", "sum gradients over data x z in fp32 or in the compute dtype"))
    steps.add_argument("--offload-optimizer", dest="offload_bsize", nargs="?", type=int, const=1 << 22,
                       default=None, metavar="BSIZE",
                       help="keep fp32 master weights and AdamW state in CPU memory and step them through the "
                            "device BSIZE elements at a time (default 4194304; needs --precision bf16 or fp16)")
    steps.add_argument("--microbatches", type=int, default=None, metavar="M",
                       help="gradient accumulation, on any grid: each data x z shard of the batch runs as M "
                            "microbatches, one microbatch's activations at a time; the data-parallel sync and the "
                            "optimizer run once per step. With pipe > 1 the message-driven pipeline runs them "
                            "(default: pipe, else 1; at most the sequences of a shard, batch / (data * z))")
    steps.add_argument("--pipeline-limit", type=int, default=None,
                       help="with pipe > 1: microbatches the first stage keeps in flight, which bounds every "
                            "stage's activations (stage s holds at most limit - s; default: pipe)")
    steps.add_argument("--save-every", type=int, default=None,
                       help=_help("save_every", "also checkpoint every N steps (0: only at the end)"))
    steps.add_argument("--keep", type=int, default=None,
                       help=_help("keep", "checkpoints kept (the newest; a corrupt one falls back to the one before "
                                          "it)"))
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a rank dies, restart every rank up to N times from the newest checkpoint "
                        "(--save-every bounds what is recomputed); under torchrun/srun use their own restarts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from par4d.launch import Interrupted, RankFailed, distributed_env, launch_local
    from par4d.train.faults import Faults
    from par4d.train.loop import worker

    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    resumed = _resumable(args) if args.resume else None
    world, inside = _world(args, resumed)
    if inside and args.max_restarts:
        raise ValueError("--max-restarts restarts par4d's own local ranks; under torchrun or srun give the "
                         "launcher's own restart option (torchrun --max-restarts N) together with --out")
    config = _config(args, world, inside, resumed)
    Faults.from_env()     # a malformed test hook fails here, not in every rank
    if inside:   # the rank itself: its error is one line here too (torchrun adds its own report)
        rank = distributed_env().rank
        try:
            summary = worker(config)
        except Exception as error:
            raise RankFailed(rank, _with_log(f"{type(error).__name__}: {error}", rank, config.out)) from None
        return _finish(summary, quiet=rank != 0)
    import os

    from par4d.launch.machine import cpu_cores, measure_matmul_peak
    from par4d.train.lock import HELD_ENV, LOCK, RunLock

    with RunLock(config.out):    # one run per folder, from here until the ranks are gone
        if not config.resume:    # empty when checked, but another run may have written there since
            _check_new_out(Path(config.out), ignore=(LOCK,))
        if config.peak_flops is None:   # measured here, before the ranks exist, so nothing competes for the cores
            config = replace(config, peak_flops=measure_matmul_peak(threads=cpu_cores()))
        os.environ[HELD_ENV] = str(Path(config.out).resolve())    # the ranks inherit it
        try:
            results = launch_local(world, worker, (config, True), run_id="par4d-train",
                                   max_restarts=args.max_restarts)
        except RankFailed as error:
            raise RankFailed(error.rank, _with_log(error.cause, error.rank, config.out)) from None
        except Interrupted as error:   # this process got the signal; the ranks saved their step before exiting
            return _stopped(error.signum, Path(config.out))
        finally:
            os.environ.pop(HELD_ENV, None)
    return _finish(results[0])


def _resumable(args: argparse.Namespace) -> tuple[Path, dict]:
    """(the checkpoint a --resume goes on from, its meta): the newest intact one, each one skipped said why."""
    from par4d.train.checkpoint import FOLDER, check_resumable

    run_dir = Path(args.resume)
    if not run_dir.is_dir():
        raise ValueError(f"--resume {run_dir}: no such folder")
    if not (run_dir / FOLDER).is_dir():
        raise ValueError(f"--resume {run_dir} is not a par4d run folder (it has no {FOLDER}/ folder)")
    if args.init_from is not None:
        raise ValueError(f"--resume {run_dir} starts from the run's checkpoint; --init-from applies to a new run only")
    from par4d.train.folder import Folder
    from par4d.train.loop import METRICS

    files = Folder(run_dir)
    if files.kind(METRICS) not in (None, "file"):   # the one file a resume reads besides checkpoints
        raise ValueError(f"--resume {run_dir}: {run_dir / METRICS} is not a regular file (a link or a folder); "
                         f"par4d reads and writes only regular files inside a run folder")
    for name in ("summary.json", "loss.png"):     # replaced at the end (a link among them too): not a folder
        if files.kind(name) not in (None, "file", "link"):
            raise ValueError(f"--resume {run_dir}: {run_dir / name} is not a file; the run writes its {name} "
                             f"there (move it away)")
    folder, meta = check_resumable(run_dir, report=_say)
    from par4d.train.config import TrainConfig

    TrainConfig.check_record(meta.get("train_config"), f"{folder / 'meta.json'}: train_config")
    return folder, meta


def _with_log(cause: str, rank: int, out: str | None) -> str:
    from par4d.train.loop import failure_log

    log = failure_log(Path(out), rank) if out else None
    return f"{cause} (traceback in {log})" if log is not None and log.is_file() else cause


def _finish(summary: dict, quiet: bool = False) -> int:
    """Print rank 0's summary (``quiet``: another rank's); a run a signal stopped early exits
    with 128 + the signal's number."""
    if "stopped" in summary:
        import signal

        signum = signal.Signals[summary["stopped"]["signal"]]
        return 128 + signum if quiet else _stopped(signum, Path(summary["stopped"]["run"]))
    if summary and not quiet:
        _print_summary(summary)
    return 0


def _stopped(signum: int, out: Path) -> int:
    import signal

    from par4d.train.checkpoint import latest, read_meta

    name = signal.Signals(signum).name
    try:   # the pointer moves only once a checkpoint is complete (a resume verifies it)
        step = read_meta(latest(out))["step"]
        _say(f"stopped by {name}: step {step} is saved; continue with: par4d train --resume {out} (it goes on "
             f"from the newest intact checkpoint)")
    except (ValueError, OSError):
        _say(f"stopped by {name} before a checkpoint was complete; nothing to resume in {out}")
    return 128 + signum


def _world(args: argparse.Namespace, resumed: tuple[Path, dict] | None = None) -> tuple[int, bool]:
    """(world size, whether we are inside a launched job). Without --nproc: as many ranks as
    --grid names, or as the resumed run's grid has, or DEFAULT_NPROC."""
    from par4d.launch import distributed_env

    env = distributed_env()
    if env is not None:
        if args.nproc is not None and args.nproc != env.world_size:
            raise ValueError(f"--nproc {args.nproc} but the {env.launcher} job has {env.world_size} ranks")
        return env.world_size, True
    nproc = _default_nproc(args, resumed) if args.nproc is None else args.nproc
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc, False


def _default_nproc(args: argparse.Namespace, resumed: tuple[Path, dict] | None) -> int:
    from math import prod

    from par4d.grid import parse_grid

    if args.grid and args.grid != "auto":
        return prod(parse_grid(args.grid).values())
    if resumed is not None:   # the grid it was saved on (checked by _resumable)
        return prod(resumed[1]["train_config"]["grid"].values())
    return DEFAULT_NPROC


def _say(line: str) -> None:
    print(f"par4d train: {line}", flush=True)   # flushed: the ranks started next write to the same stdout


def _config(args: argparse.Namespace, world: int, inside: bool, resumed: tuple[Path, dict] | None = None):
    """The run's ``TrainConfig``; every error a rank would raise on its grid is raised here, before any starts."""
    from par4d.grid import Grid, validate_sizes
    from par4d.launch import distributed_env
    from par4d.launch.machine import host_memory
    from par4d.train.data import BUNDLED, read_corpus
    from par4d.train.model import build_model

    if args.resume:
        config = _resumed_config(args, world, inside, resumed or _resumable(args))
    else:
        config = _new_config(args, world, inside)
    sizes = validate_sizes(config.grid, world)
    env = distributed_env()
    config.check_memory(world, env.local_world_size if env else world, host_memory())   # before any model is built
    last_stage = world - world // sizes["pipe"]        # the first rank of the last pipeline stage (head, loss)
    for rank in sorted({0, last_stage}):               # every rank's shape errors
        build_model(config, Grid.virtual(sizes, rank))
    batch = _named(args, "batch_size", config.batch_size)
    if config.batch_size % (sizes["data"] * sizes["z"]):
        raise ValueError(f"{batch} is not divisible by data * z = "
                         f"{sizes['data']} * {sizes['z']} = {sizes['data'] * sizes['z']}")
    per_rank = config.batch_size // (sizes["data"] * sizes["z"])
    if sizes["pipe"] > 1 and not (config.microbatches or sizes["pipe"]) <= per_rank:
        raise ValueError(f"{_named(args, 'microbatches', config.microbatches or sizes['pipe'])} exceeds the "
                         f"{per_rank} sequences per rank ({batch} / (data * z))")
    if config.init_from and not config.resume:
        from par4d.train.hf import check_hf

        check_hf(Path(config.init_from), config.model_config())    # names the file and every number that differs
    if config.model == "unet":   # its images are generated: no text to check
        return config
    label = None if args.data is not None or config.data is None else f"the run's data {config.data}"
    corpus = read_corpus(config.data, config.seq_len, config.data_sha256, label)   # a resume checks it is the same text
    return replace(config, data=None if corpus.source == BUNDLED else corpus.source, data_sha256=corpus.sha256)


def _grid(args: argparse.Namespace, world: int, inside: bool, dims: dict) -> tuple[dict, float | None]:
    """(grid, the machine's peak where the planner measured it) from --grid, or a default for ``world``."""
    from par4d.grid import parse_grid
    from par4d.plan.choose import default_grid, planned_grid

    if args.grid != "auto":
        return (parse_grid(args.grid) if args.grid else default_grid(world)), None
    if dims["mlp"] != "dense" or dims.get("model", "gpt") != "gpt":
        raise ValueError(f"--grid auto plans par4d's dense GPT only; give --grid for --mlp phantom or "
                         f"--model {dims.get('model', 'gpt')}")
    return planned_grid(world, machine=args.machine, inside=inside, report=_say,
                        **{k: dims[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size")})


def _new_config(args: argparse.Namespace, world: int, inside: bool):
    from par4d.launch import distributed_env
    from par4d.train.config import TrainConfig
    from par4d.train.loop import new_run_dir

    chosen = {name: getattr(args, name) for name in FIXED + HONOURED if getattr(args, name) is not None}
    model = chosen.get("model", _default("model"))
    unused = [name for name in UNUSED[model] if name in chosen]
    if unused:
        why = "the U-Net's sizes are --n-embd, --n-layer and --image-size" if model == "unet" else "it is for unet"
        raise ValueError(f"--model {model}: {_flag(unused[0])} {chosen[unused[0]]} does not apply ({why})")
    init_from = _init_from(args.init_from)
    if init_from is not None and model == "gpt":   # the shape is the saved model's unless a flag says otherwise
        from par4d.train.hf import gpt_dims

        chosen = dict(gpt_dims(init_from), **chosen)
    dims = {name: chosen.get(name, _default(name)) for name in FIXED}
    grid, peak = _grid(args, world, inside, dims)
    # Launched here: name the new run now. Under torchrun/srun rank 0 names it later.
    out = Path(args.out) if args.out else (None if distributed_env() else new_run_dir(grid))
    if out is not None and not _restarted_in(out, inside):
        from par4d.train.lock import LOCK

        _check_new_out(out, ignore=(LOCK,))   # a lock left by a run that ended before writing anything
    steps = _default("steps") if args.steps is None else args.steps
    return TrainConfig(grid=grid, out=None if out is None else str(out), steps=steps, data=args.data,
                       progress=not args.no_progress, peak_flops=peak, init_from=init_from, **chosen)


def _check_new_out(out: Path, ignore: tuple[str, ...] = ()) -> None:
    """A new run's folder: missing, or an empty folder (``ignore``: but for these names)."""
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {out} is a symbolic link to nothing; give a folder for the run")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the run (nothing is overwritten)")
    if out.exists() and any(p.name not in ignore for p in out.iterdir()):
        raise ValueError(f"--out {out} already holds files; pass --resume {out} to continue that run, "
                         f"or choose another --out (nothing is overwritten)")


def _named(args: argparse.Namespace, name: str, value) -> str:
    """How an error names a setting: the flag when the user gave it, else the run's own (a resume's saved value)."""
    if getattr(args, name, None) is not None or not args.resume:
        return f"{_flag(name)} {value}"
    return f"the run's {name} {value} (train_config in its meta.json)"


def _restarted_in(out: Path, inside: bool) -> bool:
    """Whether torchrun (or srun's requeue) restarted this job in its own run folder: the ranks
    go on there from the newest intact checkpoint (par4d.train.loop)."""
    from par4d.train.checkpoint import FOLDER
    from par4d.train.loop import restart_count

    return inside and restart_count() > 0 and ((out / FOLDER).is_dir() or (out / "metrics.jsonl").is_file())


def _init_from(given: list[str] | None) -> str | None:
    if given is None:
        return None
    kind, folder = given
    if kind != "hf":
        raise ValueError(f"--init-from {kind} {folder}: the format must be hf (a Hugging Face GPT-2 folder)")
    if not Path(folder).is_dir():
        raise ValueError(f"--init-from hf {folder}: no such folder")
    return str(Path(folder).resolve())


def _resumed_config(args: argparse.Namespace, world: int, inside: bool, resumed: tuple[Path, dict]):
    """The saved run's config with what a resume may change: the grid, the step count, the HONOURED settings."""
    from par4d.train.config import TrainConfig

    run_dir = Path(args.resume)
    folder, meta = resumed    # the newest intact checkpoint
    # Runs saved before --model trained the GPT; before --image-size, a size they had no use for.
    saved = {"model": "gpt", "image_size": _default("image_size"), **meta["train_config"]}
    for name in FIXED:
        given = getattr(args, name)
        if given is not None and given != saved[name]:
            raise ValueError(f"--resume {run_dir}: {_flag(name)} {given} differs from the run's {saved[name]}; "
                             f"a resumed run keeps its model, batch and seed (start a new run to change them)")
    if args.out is not None and Path(args.out).resolve() != run_dir.resolve():
        raise ValueError(f"--resume {run_dir} continues in that folder; --out {args.out} names another "
                         f"(drop --out, or copy the run there and resume the copy)")
    if args.data is not None and (saved["data"] is None or Path(args.data).resolve() != Path(saved["data"])):
        raise ValueError(f"--resume {run_dir}: --data {args.data} is not the run's data "
                         f"({saved['data'] or 'the default data'}); a resumed run trains on the text it started on")
    steps = args.steps if args.steps is not None else saved["steps"]
    if steps <= meta["step"]:
        raise ValueError(f"--resume {run_dir}: the checkpoint is at step {meta['step']}; "
                         f"pass --steps greater than that (got {steps})")
    honoured = {name: getattr(args, name) for name in HONOURED if getattr(args, name) is not None}
    for name, value in honoured.items():
        if value != saved[name]:
            _say(f"{_flag(name)} {value} replaces the run's {saved[name]} from step {meta['step']}")
    grid, peak = _grid(args, world, inside, saved) if args.grid else (saved["grid"], None)
    shards, kept = grid.get("z", 1) * grid.get("data", 1), saved.get("microbatches")
    if (grid.get("pipe", 1) == 1 and "microbatches" not in honoured and kept is not None
            and saved["batch_size"] % shards == 0 and kept > saved["batch_size"] // shards):
        # The run's count is kept where it fits (gradient accumulation on any grid): not on this one.
        _say(f"the run's --microbatches {kept} exceeds the {saved['batch_size'] // shards} samples of a "
             f"data x z shard on this grid: one microbatch per step (give --microbatches to choose)")
        honoured["microbatches"] = None
    if grid.get("pipe", 1) == 1 and "pipeline_limit" not in honoured:
        honoured["pipeline_limit"] = None
    if honoured.get("precision") == "fp32" and "offload_bsize" not in honoured:
        honoured["offload_bsize"] = None    # an fp32 run keeps no separate masters to offload
    try:
        return TrainConfig(**dict(saved, **honoured, steps=steps, out=str(run_dir), resume=True, grid=grid,
                                  progress=not args.no_progress, peak_flops=peak, checkpoint=str(folder)))
    except ValueError as error:    # a saved value out of range: the file says it, not a flag
        if any(f"--{name.replace('_', '-')}" in str(error) for name in vars(args) if getattr(args, name) is not None):
            raise
        raise ValueError(f"{folder / 'meta.json'}: the run's saved settings are refused: {error}") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resumed(summary: dict) -> str:
    source = summary.get("resumed_from")
    if not source:
        return ""
    from par4d.grid import describe

    if summary.get("grid_changed"):
        return f"  (resumed from step {source['step']} saved on grid {describe(source['grid'])}: the grid changed)"
    return f"  (resumed from step {source['step']}, same grid)"


def _every(blocks: int) -> str:
    return f"every {blocks} blocks" if blocks else "none"


def _communication(summary: dict) -> str:
    issued, exposed, step = (summary[k] for k in ("comm_issued_s_per_step", "comm_exposed_s_per_step", "s_per_step"))
    hidden = 100 * (1 - exposed / issued) if issued > 0 else 0.0
    share = 100 * exposed / step if step > 0 else 0.0
    return (f"in flight {issued * 1e3:.1f} ms, exposed (waited) {exposed * 1e3:.1f} ms per step on rank 0: "
            f"{hidden:.0f}% hidden, exposed = {share:.0f}% of the step")


def _model_line(summary: dict) -> str:
    model = summary.get("model", "gpt")
    if model == "unet":
        return "unet: par4d's U-Net (par4d.nn.Conv2d), denoising generated images"
    return "par4d's GPT" if model == "gpt" else f"{model}: Hugging Face's, made parallel by par4d.parallelize"


def _print_summary(summary: dict) -> None:
    from par4d.grid import AXES

    grid = " ".join(f"{a}={summary['grid'][a]}" for a in AXES)
    text = summary["eq3_flops_per_s"] is not None    # the paper's GPT formulas (Eqs 2 and 3) apply
    flops = f"{summary['model_flops_per_s'] / 1e9:.2f} GFLOP/s"
    rows = [
        ("grid", f"{grid}  ({summary['world_size']} ranks, {summary['device']}, {summary['backend']})"),
        ("model", _model_line(summary)),
        ("parameters", f"{summary['params']:,}"),
        ("steps", f"{summary['start_step']} -> {summary['steps']}" + _resumed(summary)),
        ("tokens/s" if text else "pixels/s", f"{summary['tokens_per_s']:,.0f}"),
        ("model FLOP/s", f"{flops} (par4d's count; the paper's Eq 3: {summary['eq3_flops_per_s'] / 1e9:.2f} GFLOP/s)"
                         if text else flops),
        *([("300 B tokens", f"{summary['eq2_days_to_300b_tokens']:,.0f} days at this rate (the paper's Eq 2)")]
          if text else []),
        ("matmul peak", f"{summary['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s fp32 (measured at start-up)"),
        ("% of peak", f"{summary['percent_of_peak']:.1f}%"),
        ("overlap", f"{summary['overlap']}, recompute {_every(summary['recompute_every'])}"),
        ("optimizer", summary["optimizer"]),
        ("communication", _communication(summary)),
        ("loss", f"{summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (train), "
                 f"{summary['val_loss']:.3f} (validation)"),
        ("run directory", summary["config"]["out"]),
        *([("started from", summary["config"]["init_from"])] if summary["config"].get("init_from") else []),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
