"""``par4d inspect DIR``: what a run, a checkpoint or a dataset folder holds, verified, on one screen
(:mod:`par4d.cli.inspect_run`). Reads only."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="what a run, checkpoint or dataset folder holds (checksums verified)")
    p.add_argument("folder", metavar="DIR", help="a run folder, one of its checkpoints/step-N, or a dataset folder")


def run(args: argparse.Namespace) -> int:
    from par4d.cli.inspect_run import inspect

    print("\n".join(inspect(Path(args.folder))))
    return 0
