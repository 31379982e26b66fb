"""``par4d generate``: sample text from a run's newest intact checkpoint (one process, a key/value cache;
:mod:`par4d.cli.generate_run`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from par4d.cli.values import number


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("--run", required=True, metavar="DIR",
                   help="a par4d run folder (its newest intact checkpoint) or one of its checkpoints/step-N folders")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to sample (default 64)")
    p.add_argument("--temperature", type=number(0, above=False), default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="draw from the k most likely tokens (0: all; default 40)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from par4d.cli.generate_run import Sampling, generate

    try:    # bytes of another encoding reach Python as surrogates, which no tokenizer takes
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(args.prompt[error.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(f"--prompt is not UTF-8 text ({what} at character {error.start}): give the prompt in "
                         f"UTF-8") from None
    sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.seed)
    text, _ = generate(Path(args.run), args.prompt, sampling, report=lambda line: print(line, file=sys.stderr))
    print(args.prompt + text)
    return 0
