"""``par4d phantom compare``: phantom against tensor parallelism on the synthetic FFN task, as a table, JSON rows
or a markdown report with figures; the experiment itself lives in ``par4d.bench.phantom``."""

from __future__ import annotations

import argparse
from pathlib import Path

from par4d.cli.files import check_new_file


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("phantom", help="phantom parallelism experiments")
    sub = p.add_subparsers(dest="phantom", required=True)
    compare = sub.add_parser("compare", help="phantom vs tensor parallelism on the synthetic FFN task")
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
    compare.add_argument("--report", default=None,
                         help="write a markdown report with figures (e.g. docs/phantom.md, its figure "
                              "docs/figures/phantom.png); an existing report or figure is refused unless --force")
    compare.add_argument("--force", action="store_true", help="overwrite an existing --report and its figure")


def run(args: argparse.Namespace) -> int:
    if args.report:     # before any rank starts; the figure's path is par4d.bench.phantom.write_report's
        report = Path(args.report)
        check_new_file(report, "--report", args.force)
        figure = report.parent / "figures" / f"{report.stem}.png"
        check_new_file(figure, "--report", args.force, label=f"--report {report}: its figure {figure}")
    from par4d.bench.phantom import main

    return main(args)
