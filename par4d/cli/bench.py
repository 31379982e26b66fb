"""``par4d bench grid|peers|moe|context|overlap|pipeline|offload|checkpoint|data|gemm``: the GPT on every valid
grid against PyTorch DDP and FSDP2, par4d against DDP, FSDP2, HSDP and FSDP2+TP on two workloads (locally or on
an emulated cluster), a long sequence on a context axis against the grids without one and torch's context
parallel, each overlap's gain (Fig. 3's rows), par4d's message-driven pipeline against
torch.distributed.pipelining's schedules on the same stages, the offloaded optimizer against FSDP2's CPU offload,
a resharding checkpoint load against torch.distributed.checkpoint, and the gain of GEMM tuning per
matmul shape; the benchmarks themselves live in ``par4d.bench``."""

from __future__ import annotations

import argparse

from par4d.cli.files import check_new_file
from par4d.parallel import COMPILE_BACKENDS
from par4d.train.config import DEFAULT_NPROC


def _ranks(p: argparse.ArgumentParser) -> None:
    """Where a benchmark runs: local ranks, or emulated nodes of ranks."""
    p.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="ranks (per node with --nodes)")
    p.add_argument("--nodes", type=int, default=None,
                   help="emulated nodes (network namespaces, needs root); default: local ranks")
    p.add_argument("--link", default="1gbit", help="inter-node link rate per node with --nodes (tc tbf)")


def _gpt(p: argparse.ArgumentParser, *, n_layer: int, n_embd: int, n_head: int, seq_len: int,
         batch_size: int = 16) -> None:
    """The benchmarked GPT's sizes and its global batch, with this benchmark's defaults."""
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--n-embd", type=int, default=n_embd)
    p.add_argument("--n-head", type=int, default=n_head)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--batch-size", type=int, default=batch_size, help="global batch, in sequences")


def _output(p: argparse.ArgumentParser, plot: bool = False,
            plot_help: str = "also draw the rows as stacked bars (PNG) here") -> None:
    """Where rows go: stdout, --out (and --plot); an existing file is refused before anything runs."""
    p.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    p.add_argument("--out", default=None,
                   help="also write the rows as JSON lines to this file (an existing file is refused unless --force)")
    if plot:
        p.add_argument("--plot", default=None,
                       help=f"{plot_help} (an existing file is refused unless --force)")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing --out file" + (" and --plot file" if plot else ""))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    grid = sub.add_parser("grid", help="the GPT on every valid grid vs PyTorch DDP and FSDP2")
    grid.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    grid.add_argument("--iters", type=int, default=8, help="timed iterations per row (after 2 warm-up)")
    _output(grid)
    peers = sub.add_parser("peers", help="par4d vs PyTorch DDP, FSDP2, HSDP and FSDP2+TP, demo and comm-bound batch")
    _ranks(peers)
    peers.add_argument("--iters", type=int, default=8, help="timed iterations per row (after 2 warm-up)")
    peers.add_argument("--compile", nargs="?", const="inductor", choices=(*COMPILE_BACKENDS, "none"), default="none",
                       help="compile every model's blocks (par4d's and the peers', torch.compile): inductor when "
                            "given alone; the compiling step is timed apart")
    peers.add_argument("--rounds", type=int, default=2,
                       help="rounds over par4d's rows and DDP's, in alternating order (each row's times pooled)")
    peers.add_argument("--model", default="gpt", choices=("gpt", "hf-llama", "hf-gpt2", "hf-mixtral"),
                       help="gpt: par4d's own GPT; hf-llama, hf-gpt2: Hugging Face's, through par4d.parallelize, "
                            "against DDP, FSDP2, HSDP and (Llama) FSDP2 + TP with torch's Llama plan; hf-mixtral: "
                            "bench moe --model hf-mixtral")
    peers.add_argument("--in-turns-only", action="store_true",
                       help="only DDP's rows, each stepping par4d's data-parallel step (in that row's buckets) in "
                            "turns with DDP's: the precise comparison, with many --rounds (the line gives each "
                            "round's mean and standard error)")
    _output(peers)
    overlap = sub.add_parser("overlap", help="each overlap's gain in the order of the 4D paper's Fig. 3 "
                                             "(none, +oar, +ors, +oag, +cache, all)")
    _ranks(overlap)
    overlap.add_argument("--grid", default=None, help="axis sizes (default: z = every rank, across the nodes)")
    overlap.add_argument("--prefetch", type=int, default=2, help="OAG prefetch depth, in layers (default 2: "
                                                                 "par4d.Overlap's)")
    overlap.add_argument("--iters", type=int, default=3, help="timed iterations per row and round")
    overlap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all rows")
    _gpt(overlap, n_layer=4, n_embd=256, n_head=4, seq_len=128)
    _output(overlap, plot=True)
    pipe = sub.add_parser("pipeline", help="par4d's message-driven pipeline vs torch.distributed.pipelining "
                                           "(GPipe, 1F1B) on the same stages, every rank on pipe")
    _ranks(pipe)
    pipe.add_argument("--iters", type=int, default=3, help="timed iterations per row and round (after 1 warm-up)")
    pipe.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all rows")
    _gpt(pipe, n_layer=8, n_embd=256, n_head=4, seq_len=128)
    pipe.add_argument("--microbatches", type=int, default=8, help="microbatches per step (at least the stages; "
                                                                  "must divide --batch-size)")
    pipe.add_argument("--slow-stage", type=int, default=None,
                      help="make this stage sleep --slow-ms in every microbatch's forward (both frameworks)")
    pipe.add_argument("--slow-ms", type=float, default=0.0, help="the slow stage's sleep per forward, in ms")
    pipe.add_argument("--jitter-ms", type=float, default=0.0,
                      help="make every stage sleep a pseudo-random draw in [0, J) ms in every forward (both "
                           "frameworks, the same draws)")
    _output(pipe, plot=True, plot_help="also draw one iteration's timeline per stage, par4d and the fastest torch "
                                       "schedule (PNG), here")
    off = sub.add_parser("offload", help="the optimizer offloaded to CPU memory: par4d (Section V-C's step per "
                                         "all-reduce bucket, and without it) vs FSDP2 CPUOffloadPolicy, every rank "
                                         "on data")
    _ranks(off)
    off.add_argument("--iters", type=int, default=3, help="timed iterations per row and round (after 1 warm-up)")
    off.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all rows")
    off.add_argument("--bsize", type=int, default=1 << 20, help="elements per offloaded bucket")
    _gpt(off, n_layer=4, n_embd=256, n_head=4, seq_len=128)
    _output(off)
    faults = sub.add_parser("faults", help="soak: kill random ranks at random steps under --max-restarts; "
                                           "restarts survived, steps recomputed, final model bit for bit?")
    faults.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    faults.add_argument("--grid", default=None, help="axis sizes (default: par4d train's for --nproc)")
    faults.add_argument("--steps", type=int, default=60)
    faults.add_argument("--save-every", type=int, default=5)
    faults.add_argument("--faults", type=int, default=4, help="ranks killed, one per attempt")
    faults.add_argument("--seed", type=int, default=0, help="picks the ranks and steps killed")
    _gpt(faults, n_layer=2, n_embd=64, n_head=4, seq_len=64)
    _output(faults)
    ckpt = sub.add_parser("checkpoint", help="one resharding checkpoint load (and its save): par4d grid A -> B "
                                             "vs torch.distributed.checkpoint FSDP2 -> HSDP")
    ckpt.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="ranks (even: HSDP's (2, nproc/2) mesh)")
    ckpt.add_argument("--from", dest="grid_from", default="x=2,z=2", help="par4d's grid at the save")
    ckpt.add_argument("--to", dest="grid_to", default="z=2,data=2", help="par4d's grid at the load")
    ckpt.add_argument("--n-layer", type=int, default=4)
    ckpt.add_argument("--n-embd", type=int, default=128)
    ckpt.add_argument("--n-head", type=int, default=4)
    ckpt.add_argument("--repeats", type=int, default=3, help="save + load rounds per framework (median reported)")
    ckpt.add_argument("--workdir", default=None,
                      help="put the checkpoints in a temporary folder under this one (default: the system's "
                           "temporary folder); removed afterwards")
    _output(ckpt)
    data = sub.add_parser("data", help="par4d data prepare's tokens/s beside tokenizers' own, and par4d train "
                                       "--data from a small and a large dataset (s/step, resident memory)")
    data.add_argument("--mb", type=int, default=1000, help="MB of generated text (default 1000)")
    data.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    data.add_argument("--steps", type=int, default=20, help="training steps per run")
    data.add_argument("--rounds", type=int, default=2, help="runs per dataset, alternating (median reported)")
    data.add_argument("--confine", action="store_true",
                      help="run each training in a memory cgroup; the large dataset's holds what a small one's run "
                           "took plus a tenth of the dataset (root, cgroup v1)")
    data.add_argument("--workdir", default=None, help="put the text and datasets in a temporary folder under this "
                                                      "one (default: the system's); removed afterwards")
    _output(data)
    moe = sub.add_parser("moe", help="the GPT with a mixture of experts: par4d's expert grids vs PyTorch DDP and "
                                     "FSDP2 of the same model (s/iter, expert and parameter bytes per rank)")
    _ranks(moe)
    moe.add_argument("--model", default="gpt", choices=("gpt", "hf-mixtral"),
                     help="gpt: par4d's GPT with experts; hf-mixtral: transformers' Mixtral through par4d.parallelize "
                          "(default gpt)")
    moe.add_argument("--iters", type=int, default=8, help="timed iterations per row (after 2 warm-up)")
    moe.add_argument("--compile", nargs="?", const="inductor", choices=(*COMPILE_BACKENDS, "none"), default="none",
                     help="compile every row's blocks (par4d's and the peers'): inductor when given alone; the "
                          "compiling step timed apart, the graphs compiled again after it counted")
    moe.add_argument("--rounds", type=int, default=2,
                     help="rounds over all rows, in alternating order (each row's times pooled)")
    _output(moe)
    context = sub.add_parser("context", help="long sequences: the longest a fixed GPT trains at with a context axis "
                                             "vs without, activations per rank against length, and torch's "
                                             "context parallel")
    context.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    context.add_argument("--iters", type=int, default=3, help="timed steps per grid at --timed (after 2 warm-up)")
    context.add_argument("--n-layer", type=int, default=2)
    context.add_argument("--n-embd", type=int, default=128)
    context.add_argument("--n-head", type=int, default=4)
    context.add_argument("--lengths", default="1024,2048,4096,8192,16384",
                         help="sequence lengths measured, shortest first (each a multiple of 2 x --nproc)")
    context.add_argument("--budget-mb", type=float, default=48.0,
                         help="activations a rank may hold: the longest length within it is each grid's reach")
    context.add_argument("--timed", type=int, default=2048, help="the length at which steps are timed")
    _output(context)
    gemm = sub.add_parser("gemm", help="gain of GEMM tuning per matmul shape and pass")
    gemm.add_argument("--json", action="store_true", help="one JSON object per row")


def run(args: argparse.Namespace) -> int:
    for flag in ("--out", "--plot"):        # before any peak is measured or rank starts
        path = getattr(args, flag[2:], None)
        if path:
            check_new_file(path, flag, args.force)
    if args.bench == "gemm":
        from par4d.bench.gemm import run_bench_gemm

        return run_bench_gemm(args)
    if args.bench == "data":
        from par4d.bench.data import run_bench_data

        return run_bench_data(args)
    if args.bench == "faults":
        from par4d.bench.faults import run_bench_faults

        return run_bench_faults(args)
    if args.bench == "overlap":
        from par4d.bench.overlap import run_bench_overlap

        return run_bench_overlap(args)
    if args.bench == "pipeline":
        from par4d.bench.pipeline import run_bench_pipeline

        return run_bench_pipeline(args)
    if args.bench == "offload":
        from par4d.bench.offload import run_bench_offload

        return run_bench_offload(args)
    if args.bench == "checkpoint":
        from par4d.bench.checkpoint import run_bench_checkpoint

        return run_bench_checkpoint(args)
    if args.bench == "context":
        from par4d.bench.common import emit
        from par4d.bench.context import ContextSettings, run_bench_context, table

        try:
            lengths = tuple(int(n) for n in args.lengths.split(","))
        except ValueError:
            raise ValueError(f"--lengths {args.lengths!r}: give a comma list of token counts") from None
        settings = ContextSettings(args.nproc, args.iters, args.n_layer, args.n_embd, args.n_head, lengths,
                                   args.budget_mb, args.timed)
        rows = run_bench_context(settings)
        if not emit(rows, args.out, args.json):
            print(table(rows, settings.budget_mb))
        return 0
    if args.bench == "peers" and args.in_turns_only and args.model == "hf-mixtral":
        raise ValueError("--in-turns-only: --model hf-mixtral runs bench moe, which has no DDP row stepped in turns "
                         "with par4d's; give --model gpt, hf-llama or hf-gpt2")
    if args.bench == "moe" or (args.bench == "peers" and args.model == "hf-mixtral"):   # a mixture's peers
        from par4d.bench.common import emit
        from par4d.bench.moe import run_bench_moe, table

        rows = run_bench_moe(args.nproc, args.iters, args.model, args.nodes, args.link, args.compile, args.rounds)
        if not emit(rows, args.out, args.json):
            print(table(rows))
        return 0
    if args.bench == "peers":
        if args.model != "gpt":
            from par4d.bench.hf_peers import run_bench_hf_peers

            return run_bench_hf_peers(args)
        from par4d.bench.peers import run_bench_peers

        return run_bench_peers(args)
    from par4d.bench.grid import run_bench_grid

    return run_bench_grid(args)
