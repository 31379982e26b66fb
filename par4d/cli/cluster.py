"""``par4d cluster run|clean``: run a par4d command on every rank of an emulated multi-node cluster (network
namespaces joined by rate-limited links; needs root), or delete the namespaces a killed run left behind."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cluster", help="run a par4d command on an emulated multi-node cluster (root)")
    sub = p.add_subparsers(dest="cluster", required=True)
    run_parser = sub.add_parser("run", help="par4d cluster run --nodes 2 --nproc 2 -- train --grid x=2,data=2")
    run_parser.add_argument("--nodes", type=int, required=True)
    run_parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    run_parser.add_argument("--link", default="1gbit", help="inter-node link rate per node (tc tbf)")
    run_parser.add_argument("argv", nargs=argparse.REMAINDER, help="the par4d command each rank runs")
    sub.add_parser("clean", help="delete namespaces left by a killed par4d cluster")


def run(args: argparse.Namespace) -> int:
    import subprocess

    from par4d.launch.cluster import ClusterSpec, EmulatedCluster, leftover_namespaces

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
