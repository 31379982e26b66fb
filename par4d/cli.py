"""``par4d``: the command line.

    par4d train [--nproc N] [--grid x=2,z=2] [--steps N] [--out DIR | --resume DIR] ...
    par4d plan --model gpt-20b --gpus 32 [--machine perlmutter] [--top 10] [--json]
    par4d bench grid [--nproc N] [--json]

Outside a launcher, ``--nproc N`` local ranks are started with torchrun's elastic
agent; inside torchrun or srun the command joins the job instead.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from par4d.cluster import ClusterUnavailable
from par4d.launch import distributed_env, launch_local

# par4d.grid (and so torch) is imported where a command needs it: `par4d plan` needs none.

DEFAULT_NPROC = 4


def default_grid(world: int) -> dict[str, int]:
    """Deterministic default shape: prime factors of ``world``, largest first, dealt
    round-robin to x, z, y, data (4 -> x=2,z=2; 8 -> x=2,y=2,z=2; 16 -> all four = 2)."""
    factors, n, p = [], world, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    sizes = {a: 1 for a in ("x", "z", "y", "data")}
    for i, factor in enumerate(sorted(factors, reverse=True)):
        axis = ("x", "z", "y", "data")[i % 4]
        sizes[axis] *= factor
    return {a: s for a, s in sizes.items() if s > 1} or {"x": 1}


def _default(name: str):
    from par4d.train.config import TrainConfig

    return TrainConfig.__dataclass_fields__[name].default


def _add_train_args(p: argparse.ArgumentParser) -> None:
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
                   help="continue the run in DIR from its checkpoint (same grid)")
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
    p.add_argument("--seed", type=int, default=_default("seed"))
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="par4d", description="4D hybrid parallel training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the GPT on text (the main job)")
    _add_train_args(train)
    plan = sub.add_parser("plan", help="rank every grid configuration of a workload")
    from par4d.plan.cli import add_arguments

    add_arguments(plan)
    calibrate = sub.add_parser("calibrate", help="measure this machine; write a machine profile for plan")
    calibrate.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="local ranks to measure with")
    calibrate.add_argument("--out", default="profiles/local.toml", help="where to write the TOML profile")
    calibrate.add_argument("--repeats", type=int, default=5)
    calibrate.add_argument("--nodes", type=int, default=None,
                           help="measure an emulated cluster of this many nodes (--nproc ranks per node; needs root)")
    calibrate.add_argument("--link", default="1gbit", help="emulated inter-node link rate (with --nodes)")
    cluster = sub.add_parser("cluster", help="run a par4d command on an emulated multi-node cluster (root)")
    cluster_sub = cluster.add_subparsers(dest="cluster", required=True)
    cluster_run = cluster_sub.add_parser("run", help="par4d cluster run --nodes 2 --nproc 2 -- train --grid x=2,data=2")
    cluster_run.add_argument("--nodes", type=int, required=True)
    cluster_run.add_argument("--nproc", type=int, default=1, help="ranks per node")
    cluster_run.add_argument("--link", default="1gbit", help="inter-node link rate per node (tc tbf)")
    cluster_run.add_argument("argv", nargs=argparse.REMAINDER, help="the par4d command each rank runs")
    cluster_sub.add_parser("clean", help="delete namespaces left by a killed par4d cluster")
    phantom = sub.add_parser("phantom", help="phantom parallelism experiments")
    phantom_sub = phantom.add_subparsers(dest="phantom", required=True)
    compare = phantom_sub.add_parser("compare", help="phantom vs tensor parallelism on the synthetic FFN task")
    compare.add_argument("--n", type=int, default=4096, help="FFN width")
    compare.add_argument("--depth", type=int, default=2)
    compare.add_argument("--nproc", default="2,4", help="rank counts, comma-separated")
    compare.add_argument("--k", default="4,16,64", help="ghost neurons, comma-separated")
    compare.add_argument("--batch", type=int, default=32)
    compare.add_argument("--lr", type=float, default=1e-3)
    compare.add_argument("--iters", type=int, default=20, help="iterations per scheme without --target-loss")
    compare.add_argument("--max-iters", type=int, default=300, help="cap with --target-loss")
    compare.add_argument("--target-loss", type=float, default=None, help="train each scheme to this MSE")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--json", action="store_true", help="one JSON object per row")
    compare.add_argument("--report", default=None, help="write a markdown report with figures (e.g. docs/phantom.md)")
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    grid = bench_sub.add_parser("grid", help="the GPT on every valid grid vs PyTorch DDP and FSDP2")
    grid.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    grid.add_argument("--iters", type=int, default=8, help="timed iterations per row (after 2 warm-up)")
    grid.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    grid.add_argument("--out", default=None, help="also write the rows as JSON lines to this file")
    gemm = bench_sub.add_parser("gemm", help="gain of GEMM tuning per matmul shape and pass")
    gemm.add_argument("--json", action="store_true", help="one JSON object per row")
    return parser


def _world(nproc: int | None) -> tuple[int, bool]:
    """(world size, whether we are inside a launched job)."""
    env = distributed_env()
    if env is not None:
        if nproc is not None and nproc != env.world_size:
            raise ValueError(f"--nproc {nproc} but the {env.launcher} job has {env.world_size} ranks")
        return env.world_size, True
    nproc = DEFAULT_NPROC if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc, False


def _planned_grid(args: argparse.Namespace, world: int, inside: bool) -> tuple[dict[str, int], float | None]:
    """The planner's first choice for this training run on this machine, and the
    machine's matmul peak when it was calibrated for it (so train need not measure again)."""
    from par4d.plan.machines import load_machine
    from par4d.plan.model import rank_configurations
    from par4d.plan.workload import GPTSpec
    from par4d.train.config import VOCAB_BYTES

    peak = None
    if args.machine is not None:
        machine = load_machine(args.machine)
    elif inside:
        raise ValueError("--grid auto under torchrun/srun needs --machine PROFILE (make one with par4d calibrate)")
    else:
        import tempfile

        from par4d.plan.calibrate import calibrate

        print(f"par4d train: calibrating this machine on {world} ranks for --grid auto ...", flush=True)
        calibration = calibrate(world, Path(tempfile.mkdtemp()) / "local.toml")
        machine, peak = calibration["machine"], calibration["peak_total"]
    spec = GPTSpec("train", n_layer=args.n_layer, hidden=args.n_embd, heads=args.n_head, seq_len=args.seq_len,
                   global_batch=args.batch_size, vocab=VOCAB_BYTES)
    ranked, excluded = rank_configurations(spec, world, machine, "full", checkpointing=False)
    if not ranked:
        reasons = "; ".join(sorted({p.excluded for p in excluded}))
        raise ValueError(f"--grid auto: no grid of {world} ranks runs this model ({reasons})")
    best = ranked[0]
    print(f"par4d train: --grid auto chose x={best.sizes['x']} y={best.sizes['y']} z={best.sizes['z']} "
          f"data={best.sizes['data']} (predicted {best.t_iter:.3f} s/step; {len(ranked)} grids ranked on "
          f"{machine.name})", flush=True)
    return {a: s for a, s in best.sizes.items() if s > 1} or {"x": 1}, peak


def _train_config(args: argparse.Namespace, world: int, inside: bool = False):
    from par4d.grid import Grid, parse_grid, validate_sizes
    from par4d.models import GPT
    from par4d.train.config import TrainConfig
    from par4d.train.loop import new_run_dir

    if args.resume:
        from par4d.train.checkpoint import read_meta

        run_dir = Path(args.resume)
        meta = read_meta(run_dir)
        saved = meta["train_config"]
        steps = args.steps if args.steps is not None else saved["steps"]
        if steps <= meta["step"]:
            raise ValueError(f"--resume {run_dir}: the checkpoint is at step {meta['step']}; "
                             f"pass --steps greater than that (got {steps})")
        grid = parse_grid(args.grid) if args.grid else saved["grid"]
        if validate_sizes(grid, world) != meta["grid"]:
            shape = " ".join(f"{a}={s}" for a, s in meta["grid"].items())
            raise ValueError(f"--resume {run_dir}: the checkpoint was saved on grid {shape}; "
                             f"resuming on another grid is not supported yet")
        config = TrainConfig(**dict(saved, steps=steps, out=str(run_dir), resume=True, grid=grid,
                                    progress=not args.no_progress, peak_flops=None))
    else:
        if args.grid == "auto":
            if args.mlp != "dense":
                raise ValueError("--grid auto plans the dense GPT only; give --grid for --mlp phantom")
            grid, peak = _planned_grid(args, world, inside)
        else:
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
                             save_every=args.save_every, progress=not args.no_progress, peak_flops=peak)
    sizes = validate_sizes(config.grid, world)
    # Every shape error on every rank's grid is raised here, before a process starts.
    GPT(config.model_config(), grid=Grid.virtual(sizes))
    if config.batch_size % (sizes["data"] * sizes["z"]):
        raise ValueError(f"--batch-size {config.batch_size} is not divisible by data * z = "
                         f"{sizes['data']} * {sizes['z']} = {sizes['data'] * sizes['z']}")
    if config.data is not None and not Path(config.data).is_file():
        raise ValueError(f"--data {config.data}: no such file")
    return config


def _print_summary(summary: dict) -> None:
    from par4d.grid import AXES

    grid = " ".join(f"{a}={summary['grid'][a]}" for a in AXES)
    rows = [
        ("grid", f"{grid}  ({summary['world_size']} ranks)"),
        ("parameters", f"{summary['params']:,}"),
        ("steps", f"{summary['start_step']} -> {summary['steps']}"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        ("model FLOP/s", f"{summary['model_flops_per_s'] / 1e9:.2f} GFLOP/s"),
        ("matmul peak", f"{summary['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s fp32 (measured at start-up)"),
        ("% of peak", f"{summary['percent_of_peak']:.1f}%"),
        ("loss", f"{summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (train), "
                 f"{summary['val_loss']:.3f} (validation)"),
        ("run directory", summary["config"]["out"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


def _train(args: argparse.Namespace) -> int:
    from par4d.train.loop import worker

    world, inside = _world(args.nproc)
    config = _train_config(args, world, inside)
    if inside:
        summary = worker(config)
        if summary:
            _print_summary(summary)
        return 0
    from par4d.perf import cpu_cores, measure_matmul_peak

    if config.peak_flops is None:   # measured here, before the ranks exist, so nothing competes for the cores
        config = replace(config, peak_flops=measure_matmul_peak(threads=cpu_cores()))
    results = launch_local(world, worker, (config,), run_id="par4d-train")
    _print_summary(results[0])
    return 0


def _cluster(args: argparse.Namespace) -> int:
    import subprocess

    from par4d.cluster import ClusterSpec, EmulatedCluster, leftover_namespaces

    if args.cluster == "clean":
        for ns in leftover_namespaces():
            subprocess.run(["ip", "netns", "del", ns], check=False)
            print(f"deleted {ns}")
        return 0
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ValueError("par4d cluster run: give the par4d command after --, e.g. -- train --grid x=2,data=2")
    with EmulatedCluster(ClusterSpec(args.nodes, args.nproc, args.link)) as cluster:
        cluster.run_command(["-m", "par4d.cli", *argv])
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from par4d.plan.calibrate import calibrate

    cluster = None
    if args.nodes is not None:
        from par4d.cluster import ClusterSpec

        cluster = ClusterSpec(args.nodes, args.nproc, args.link)
    result = calibrate(args.nproc, Path(args.out), args.repeats, cluster)
    machine = result["machine"]
    print(f"matmul peak {result['peak_total'] / 1e9:.1f} GFLOP/s fp32 (whole machine; "
          f"{machine.peak_flops / 1e9:.1f} per rank of {result['world']})")
    print(f"{'collective':<21} {'alpha (us)':>10} {'beta (GB/s)':>11}   c1 log2 p + c2 m + c3")
    for kind, f in result["fits"].items():
        tail = (f"c1={f['c1'] * 1e3:.3f} ms, c2={f['c2'] * 1e9:.3f} s/GB, c3={f['c3'] * 1e3:.3f} ms" if "c1" in f
                else "(one group size: not fitted)")
        print(f"{kind:<21} {f['alpha'] * 1e6:>10.1f} {f['beta'] / 1e9:>11.3f}   {tail}")
    print(f"profile written to {args.out}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "gemm":
        from par4d.bench.gemm import run_bench_gemm

        return run_bench_gemm(args)
    from par4d.bench.grid import run_bench_grid

    return run_bench_grid(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "phantom":
            from par4d.phantom.compare import main as phantom_main

            return phantom_main(args)
        if args.command == "cluster":
            return _cluster(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "plan":
            from par4d.plan.cli import run

            return run(args)
        return _bench(args)
    except (ValueError, ClusterUnavailable) as error:
        print(f"par4d {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
