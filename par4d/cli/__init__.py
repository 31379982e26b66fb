"""``par4d``: the command line. One module per command, each with ``add_parser(subparsers)`` and ``run(args)``;
this one builds the top-level parser from them, dispatches, and turns a ``ValueError`` into an error line and
exit status 2.

    par4d train [--nproc N] [--grid x=2,z=2] [--steps N] [--out DIR | --resume DIR] ...
    par4d export --run DIR --to hf OUT [--force]
    par4d plan --model gpt-20b --gpus 32 [--machine perlmutter] [--top 10] [--json]
    par4d bench grid [--nproc N] [--json]

Outside a launcher, ``--nproc N`` local ranks are started with torchrun's elastic agent; inside torchrun or srun
the command joins the job instead. Command modules import torch only inside ``run``: ``par4d plan`` needs none.

Exit status: 0 done; 1 a rank failed (one line names it; ``train`` keeps the traceback in the run's
``logs/``), or ``inspect`` found something damaged or changed; 2 bad input, found before anything started;
128 + N stopped by signal N (``train`` saved its step; a rank killed by signal N is named with it); 141
(128 + SIGPIPE, as ``git`` or ``cat`` end) the reader of the output went away (``| head``), quietly.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from par4d.cli import bench, calibrate, cluster, data, export, generate, inspect, phantom, plan, train
from par4d.launch import Interrupted, RankFailed
from par4d.launch.cluster import ClusterUnavailable

# In the order `par4d --help` lists them; each module's name is its command's.
COMMANDS = (train, data, generate, inspect, export, plan, calibrate, cluster, phantom, bench)
# Library errors name a call's parameter (``hierarchical='on'``); where the command line has it as a flag, the
# user reads the flag (``--hierarchical 'on'``).
_AS_FLAG = re.compile(r"\b(hierarchical|keep|microbatches)=")


def as_flags(message: str) -> str:
    """``message`` with the library's parameter names that are also flags written as those flags."""
    return _AS_FLAG.sub(lambda m: f"--{m.group(1)} ", message)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="par4d", description="4D hybrid parallel training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = next(c for c in COMMANDS if c.__name__.rpartition(".")[2] == args.command)
    try:
        return command.run(args)
    except (ValueError, ClusterUnavailable) as error:   # bad input: nothing started, or nothing was lost
        print(f"par4d {args.command}: error: {as_flags(str(error))}", file=sys.stderr)
        return 2
    except RankFailed as error:   # killed by a signal: 128 + N, as a shell says it
        print(f"par4d {args.command}: error: {as_flags(str(error))}", file=sys.stderr)
        return 128 + error.signum if error.signum else 1
    except Interrupted as error:
        print(f"par4d {args.command}: {error}", file=sys.stderr)
        return 128 + error.signum
    except KeyboardInterrupt:   # Ctrl-C before any rank started (checks, hashing, measuring the peak)
        print(f"par4d {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 128 + signal.SIGPIPE


def _drop_stdout() -> None:
    """The reader of stdout is gone: what is still buffered goes to /dev/null, so the flush at
    exit raises no second BrokenPipeError (Python's documented way, see its signal module)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
