"""``par4d bench grid|peers|gemm``: the GPT on every valid grid against PyTorch DDP and FSDP2, par4d against
DDP, FSDP2, HSDP and FSDP2+TP on two workloads (locally or on an emulated cluster), and the gain of GEMM tuning
per matmul shape; the benchmarks themselves live in ``par4d.bench``."""

from __future__ import annotations

import argparse

from par4d.cli.train import DEFAULT_NPROC


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    grid = sub.add_parser("grid", help="the GPT on every valid grid vs PyTorch DDP and FSDP2")
    grid.add_argument("--nproc", type=int, default=DEFAULT_NPROC)
    grid.add_argument("--iters", type=int, default=8, help="timed iterations per row (after 2 warm-up)")
    grid.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    grid.add_argument("--out", default=None, help="also write the rows as JSON lines to this file")
    peers = sub.add_parser("peers", help="par4d vs PyTorch DDP, FSDP2, HSDP and FSDP2+TP, demo and comm-bound batch")
    peers.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="ranks (per node with --nodes)")
    peers.add_argument("--nodes", type=int, default=None,
                       help="emulated nodes (network namespaces, needs root); default: local ranks")
    peers.add_argument("--link", default="1gbit", help="inter-node link rate per node with --nodes (tc tbf)")
    peers.add_argument("--iters", type=int, default=8, help="timed iterations per row (after 2 warm-up)")
    peers.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    peers.add_argument("--out", default=None, help="also write the rows as JSON lines to this file")
    gemm = sub.add_parser("gemm", help="gain of GEMM tuning per matmul shape and pass")
    gemm.add_argument("--json", action="store_true", help="one JSON object per row")


def run(args: argparse.Namespace) -> int:
    if args.bench == "gemm":
        from par4d.bench.gemm import run_bench_gemm

        return run_bench_gemm(args)
    if args.bench == "peers":
        from par4d.bench.peers import run_bench_peers

        return run_bench_peers(args)
    from par4d.bench.grid import run_bench_grid

    return run_bench_grid(args)
