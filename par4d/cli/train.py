"""``par4d train``: its arguments, turning them into a checked ``TrainConfig`` (a new run, or a resumed one),
launching local ranks or joining a torchrun/srun job, and printing the run's summary."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

DEFAULT_NPROC = 4   # local ranks when no launcher gives a world size (also calibrate's and bench grid's default)


def _default(name: str):
    from par4d.train.config import TrainConfig

    return TrainConfig.__dataclass_fields__[name].default


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train the GPT on text (the main job)")
    p.add_argument("--nproc", type=int, default=None,
                   help=f"local ranks to start (default {DEFAULT_NPROC}); ignored under torchrun/srun")
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
    p.add_argument("--data", default=None, help="a UTF-8 text file (default: Python's bundled docs)")
    p.add_argument("--batch-size", type=int, default=_default("batch_size"), help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=_default("seq_len"))
    p.add_argument("--n-layer", type=int, default=_default("n_layer"))
    p.add_argument("--n-embd", type=int, default=_default("n_embd"))
    p.add_argument("--n-head", type=int, default=_default("n_head"))
    p.add_argument("--mlp", choices=["dense", "phantom"], default=_default("mlp"),
                   help="phantom: phantom layers over x in every MLP (needs y = z = 1)")
    p.add_argument("--phantom-k", type=int, default=_default("phantom_k"), help="ghost neurons per phantom layer")
    p.add_argument("--lr", type=float, default=_default("lr"), help="peak learning rate")
    p.add_argument("--grad-clip", type=float, default=_default("grad_clip"),
                   help="clip the global gradient norm to this (0: off)")
    p.add_argument("--overlap", default=_default("overlap"), metavar="all|none|LIST",
                   help="overlap communication with compute: all (default), none, or a comma list of "
                        "oar,ors,oag,cache,dp (cache needs --recompute)")
    p.add_argument("--recompute", default=_default("recompute"), metavar="none|auto|N",
                   help="recompute activations in backward every N blocks; auto: the divisor of the block "
                        "count closest to its square root (default none)")
    p.add_argument("--seed", type=int, default=_default("seed"))
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a rank dies, restart every rank up to N times from the newest checkpoint "
                        "(--save-every bounds what is recomputed); under torchrun/srun use their own restarts")
    p.add_argument("--keep", type=int, default=_default("keep"),
                   help="checkpoints kept (the newest; a corrupt one falls back to the one before it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from par4d.launch import launch_local
    from par4d.train.loop import worker

    world, inside = _world(args.nproc)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if inside and args.max_restarts:
        raise ValueError("--max-restarts restarts par4d's own local ranks; under torchrun or srun give the "
                         "launcher's own restart option (torchrun --max-restarts N) together with --out")
    config = _config(args, world, inside)
    if inside:
        summary = worker(config)
        if summary:
            _print_summary(summary)
        return 0
    from par4d.perf import cpu_cores, measure_matmul_peak

    if config.peak_flops is None:   # measured here, before the ranks exist, so nothing competes for the cores
        config = replace(config, peak_flops=measure_matmul_peak(threads=cpu_cores()))
    results = launch_local(world, worker, (config,), run_id="par4d-train", max_restarts=args.max_restarts)
    _print_summary(results[0])
    return 0


def _world(nproc: int | None) -> tuple[int, bool]:
    """(world size, whether we are inside a launched job)."""
    from par4d.launch import distributed_env

    env = distributed_env()
    if env is not None:
        if nproc is not None and nproc != env.world_size:
            raise ValueError(f"--nproc {nproc} but the {env.launcher} job has {env.world_size} ranks")
        return env.world_size, True
    nproc = DEFAULT_NPROC if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc, False


def _say(line: str) -> None:
    print(f"par4d train: {line}", flush=True)   # flushed: the ranks started next write to the same stdout


def _config(args: argparse.Namespace, world: int, inside: bool):
    """The run's ``TrainConfig``; every error a rank would raise on its grid is raised here, before any starts."""
    from par4d.grid import Grid, parse_grid, validate_sizes
    from par4d.launch import distributed_env
    from par4d.train.config import TrainConfig
    from par4d.train.loop import new_run_dir
    from par4d.train.model import build_gpt

    if args.resume:
        from par4d.train.checkpoint import check_resumable

        run_dir = Path(args.resume)
        folder, meta = check_resumable(run_dir, report=_say)    # the newest intact checkpoint
        saved = meta["train_config"]
        steps = args.steps if args.steps is not None else saved["steps"]
        if steps <= meta["step"]:
            raise ValueError(f"--resume {run_dir}: the checkpoint is at step {meta['step']}; "
                             f"pass --steps greater than that (got {steps})")
        grid = parse_grid(args.grid) if args.grid else saved["grid"]
        validate_sizes(grid, world)
        config = TrainConfig(**dict(saved, steps=steps, out=str(run_dir), resume=True, grid=grid,
                                    progress=not args.no_progress, peak_flops=None, checkpoint=str(folder),
                                    keep=args.keep))
    else:
        if args.grid == "auto":
            if args.mlp != "dense":
                raise ValueError("--grid auto plans the dense GPT only; give --grid for --mlp phantom")
            from par4d.plan.choose import planned_grid

            grid, peak = planned_grid(world, machine=args.machine, inside=inside, n_layer=args.n_layer,
                                      n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len,
                                      batch_size=args.batch_size, report=_say)
        else:
            from par4d.plan.choose import default_grid

            grid, peak = parse_grid(args.grid) if args.grid else default_grid(world), None
        # Launched here: name the new run now. Under torchrun/srun rank 0 names it later.
        out = Path(args.out) if args.out else (None if distributed_env() else new_run_dir(grid))
        if out is not None and out.exists() and any(out.iterdir()):
            raise ValueError(f"--out {out} already holds files; pass --resume {out} to continue that run, "
                             f"or choose another --out (nothing is overwritten)")
        steps = _default("steps") if args.steps is None else args.steps
        config = TrainConfig(grid=grid, out=None if out is None else str(out), steps=steps,
                             batch_size=args.batch_size, seq_len=args.seq_len, n_layer=args.n_layer,
                             n_embd=args.n_embd, n_head=args.n_head, lr=args.lr, seed=args.seed, data=args.data,
                             mlp=args.mlp, phantom_k=args.phantom_k, grad_clip=args.grad_clip,
                             save_every=args.save_every, progress=not args.no_progress, peak_flops=peak,
                             overlap=args.overlap, recompute=args.recompute, keep=args.keep)
    sizes = validate_sizes(config.grid, world)
    build_gpt(config.model_config(), Grid.virtual(sizes), config.recompute_every())   # every rank's shape errors
    if config.batch_size % (sizes["data"] * sizes["z"]):
        raise ValueError(f"--batch-size {config.batch_size} is not divisible by data * z = "
                         f"{sizes['data']} * {sizes['z']} = {sizes['data'] * sizes['z']}")
    if config.data is not None and not Path(config.data).is_file():
        raise ValueError(f"--data {config.data}: no such file")
    return config


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


def _print_summary(summary: dict) -> None:
    from par4d.grid import AXES

    grid = " ".join(f"{a}={summary['grid'][a]}" for a in AXES)
    rows = [
        ("grid", f"{grid}  ({summary['world_size']} ranks)"),
        ("parameters", f"{summary['params']:,}"),
        ("steps", f"{summary['start_step']} -> {summary['steps']}" + _resumed(summary)),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("model FLOP/s", f"{summary['model_flops_per_s'] / 1e9:.2f} GFLOP/s"),
        ("matmul peak", f"{summary['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s fp32 (measured at start-up)"),
        ("% of peak", f"{summary['percent_of_peak']:.1f}%"),
        ("overlap", f"{summary['overlap']}, recompute {_every(summary['recompute_every'])}"),
        ("communication", _communication(summary)),
        ("loss", f"{summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (train), "
                 f"{summary['val_loss']:.3f} (validation)"),
        ("run directory", summary["config"]["out"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
