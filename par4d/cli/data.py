"""``par4d data prepare``: tokenize text into a dataset folder that ``par4d train --data DIR`` streams
(:mod:`par4d.data.prepare`). One process; ``tokenizers`` encodes on all cores."""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("data", help="prepare tokenized datasets for par4d train --data")
    sub = p.add_subparsers(dest="action", required=True)
    q = sub.add_parser("prepare", help="tokenize .txt, .jsonl and .parquet files (or folders of them) into DIR")
    q.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt (a document per paragraph), .jsonl, .parquet "
                                                              "files, or folders of them")
    q.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="a Hugging Face tokenizer.json, or a folder holding one (copied into DIR)")
    q.add_argument("--out", required=True, metavar="DIR",
                   help="the dataset folder; an unfinished one made from the same inputs is gone on with")
    q.add_argument("--field", default="text", help="the text field of .jsonl records and .parquet columns "
                                                   "(default: text)")
    q.add_argument("--val-share", type=float, default=0.05, metavar="S",
                   help="the share of documents for validation, chosen by each document's SHA-256 (default 0.05)")
    q.add_argument("--shard-tokens", type=int, default=1 << 27, metavar="N",
                   help="tokens per shard file (default 134,217,728: 256 MiB of uint16)")
    q.add_argument("--force", action="store_true", help="replace par4d's dataset in DIR, finished or not (only the "
                                                        "files its index.json or progress.json lists)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from par4d.data.prepare import prepare
    from par4d.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    began = time.perf_counter()
    index = prepare(args.inputs, tokenizer, args.out, field=args.field, val_share=args.val_share,
                    shard_tokens=args.shard_tokens, force=args.force, progress=not args.no_progress,
                    say=lambda line: print(line, file=sys.stderr))
    seconds = time.perf_counter() - began
    splits = index["splits"]
    tokens = sum(s["tokens"] for s in splits.values())
    size = sum(i["size"] for i in index["inputs"])
    print(f"prepared {args.out}: {splits['train']['documents']:,} train and {splits['val']['documents']:,} "
          f"validation documents, {splits['train']['tokens']:,} and {splits['val']['tokens']:,} tokens "
          f"({index['dtype']}, vocabulary {index['tokenizer']['vocab']:,}) from {size / 1e6:,.1f} MB in "
          f"{seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    return 0
