"""``par4d export``: write a trained run's model in another framework's format; for now Hugging Face
``transformers``' GPT-2 (``--to hf DIR``: ``config.json`` + ``model.safetensors``). One process, no ranks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = ("hf",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a run's model for Hugging Face transformers (GPT-2)")
    p.add_argument("--run", required=True, metavar="DIR",
                   help="a par4d run folder (its newest intact checkpoint) or one of its checkpoints/step-N folders")
    p.add_argument("--to", required=True, nargs=2, metavar=("FORMAT", "OUT"),
                   help="hf OUT: a folder transformers.GPT2LMHeadModel.from_pretrained reads (a non-empty one is "
                        "refused unless --force)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT, replacing its config.json and model.safetensors")


def run(args: argparse.Namespace) -> int:
    kind, out = args.to
    if kind not in FORMATS:
        raise ValueError(f"--to {kind}: unknown format; valid: {', '.join(FORMATS)}")
    from par4d.train.hf import export_hf

    folder, meta = export_hf(Path(args.run), Path(out), args.force, report=lambda line: print(line, file=sys.stderr))
    print(f"exported {folder} (step {meta.get('step')}) to {out}; load it with "
          f"transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})")
    return 0
