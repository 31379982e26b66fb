"""``par4d inspect DIR``: what a run, a checkpoint or a dataset folder holds, verified, on one screen
(:mod:`par4d.cli.inspect_run`). Reads only.

Exit status: 0 everything checked is whole; 1 something is damaged or changed (an unusable checkpoint, a
run's data or tokenizer changed or missing, a dataset's tokenizer or shard), each named on its line; 2 not
a folder par4d can inspect (the CLI's error line)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="what a run, checkpoint or dataset folder holds (checksums verified; "
                                              "exit status 1 when something is damaged)")
    p.add_argument("folder", metavar="DIR", help="a run folder, one of its checkpoints/step-N, or a dataset folder")


def run(args: argparse.Namespace) -> int:
    from par4d.cli.inspect_run import inspect

    report = inspect(Path(args.folder))
    print("\n".join(report.lines))
    return 1 if report.damaged else 0
