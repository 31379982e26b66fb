"""``par4d export``: write a trained run's model in another framework's format; for now Hugging Face
``transformers``' (``--to hf DIR``: ``config.json`` and safetensors weights, as ``save_pretrained`` writes
them): par4d's GPT as GPT-2, a ``--model hf-llama`` / ``hf-gpt2`` run as its own model. One process, no ranks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = ("hf",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a run's model for Hugging Face transformers")
    p.add_argument("--run", required=True, metavar="DIR",
                   help="a par4d run folder (its newest intact checkpoint) or one of its checkpoints/step-N folders")
    p.add_argument("--to", required=True, nargs=2, metavar=("FORMAT", "OUT"),
                   help="hf OUT: a folder transformers.AutoModelForCausalLM.from_pretrained reads (a non-empty one "
                        "is refused unless --force)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT, replacing its config.json and weights files (model.safetensors, "
                        "its index and shards) and leaving the rest")
    p.add_argument("--max-shard-mb", type=float, default=None, metavar="MB",
                   help="the largest weights file, in MB (10^6 bytes); more goes into shards named by "
                        "model.safetensors.index.json (default 5000, as transformers' 5GB)")


def run(args: argparse.Namespace) -> int:
    kind, out = args.to
    if kind not in FORMATS:
        raise ValueError(f"--to {kind}: unknown format; valid: {', '.join(FORMATS)}")
    from par4d.train.recipes import MAX_SHARD_BYTES, export_hf

    if args.max_shard_mb is not None and not args.max_shard_mb > 0:
        raise ValueError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    limit = MAX_SHARD_BYTES if args.max_shard_mb is None else max(1, int(args.max_shard_mb * 10**6))
    folder, meta = export_hf(Path(args.run), Path(out), args.force, report=lambda line: print(line, file=sys.stderr),
                             shard_bytes=limit)
    print(f"exported {folder} (step {meta.get('step')}) to {out}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
