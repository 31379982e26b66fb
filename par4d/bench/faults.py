"""``par4d bench faults``: a soak test of runs that survive dead ranks.

Two runs of ``par4d train`` with the same settings: one uninterrupted, one whose ranks
are killed with SIGKILL at random steps (a random rank each time, one kill per attempt,
through the ``PAR4D_FAULTS`` hook) under ``--max-restarts``. Reported: the restarts the
run survived, the steps it computed twice (from each restart's resume point, as the
run itself prints it), the wall time against the uninterrupted run, and whether the
final parameters and AdamW state are bit for bit the uninterrupted run's.

The restarts are torch's elastic agent's, the same a torchrun user gets; what par4d
adds is the checkpoint the ranks resume from (``par4d bench checkpoint`` compares its
cost with torch.distributed.checkpoint's), so there is no separate torch row here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from par4d.bench.common import emit
from par4d.train.faults import FAULT_ENV

RESTART = re.compile(r"restart (\d+): resuming .* from (?:step (\d+)|the start)")


def plan_faults(count: int, steps: int, nproc: int, seed: int) -> list[tuple[int, int]]:
    """``count`` kills (rank, step) at distinct random steps in 1..steps-1, in step order: attempt
    k dies at a later step than attempt k-1, so every attempt gets further than the last."""
    if not 1 <= count < steps:
        raise ValueError(f"--faults must be between 1 and --steps - 1 = {steps - 1}, got {count}")
    rng = random.Random(seed)
    return [(rng.randrange(nproc), step) for step in sorted(rng.sample(range(1, steps), count))]


def _train(args: argparse.Namespace, out: Path, faults: list[tuple[int, int]]) -> tuple[float, str]:
    """Wall seconds and stdout of one ``par4d train`` run."""
    command = [sys.executable, "-m", "par4d.cli", "train", "--nproc", str(args.nproc), "--steps", str(args.steps),
               "--save-every", str(args.save_every), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
               "--n-head", str(args.n_head), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--out", str(out), "--no-progress", "--max-restarts", str(len(faults))]
    if args.grid:
        command += ["--grid", args.grid]
    env = dict(os.environ, **{FAULT_ENV: ",".join(f"{rank}:{step}" for rank, step in faults)})
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if result.returncode != 0:
        raise RuntimeError(f"par4d train ({'with' if faults else 'without'} faults) failed with status "
                           f"{result.returncode}:\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def final_state(run: Path) -> dict:
    """Every tensor of the run's newest checkpoint, keyed by file and name."""
    from safetensors.torch import load_file

    folder = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return {f"{f.name}/{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _identical(a: Path, b: Path) -> bool:
    import torch

    want, got = final_state(a), final_state(b)
    return set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_bench_faults(args: argparse.Namespace) -> int:
    if args.save_every < 1:
        raise ValueError(f"--save-every must be >= 1 (the checkpoints restarts resume from), got {args.save_every}")
    faults = plan_faults(args.faults, args.steps, args.nproc, args.seed)
    with tempfile.TemporaryDirectory(prefix="par4d-bench-faults-") as work:
        straight, faulted = Path(work) / "straight", Path(work) / "faulted"
        print(f"uninterrupted run: {args.steps} steps on {args.nproc} ranks ...", file=sys.stderr, flush=True)
        clean_s, _ = _train(args, straight, [])
        print(f"run with {len(faults)} kills (rank:step {', '.join(f'{r}:{s}' for r, s in faults)}) ...",
              file=sys.stderr, flush=True)
        faulted_s, stdout = _train(args, faulted, faults)
        resumed = [(int(k), int(step or 0)) for k, step in RESTART.findall(stdout)]
        identical = _identical(straight, faulted) and _losses(straight) == _losses(faulted)
    recomputed = sum(step - resume for (_, step), (_, resume) in zip(faults, resumed))
    common = {"framework": "par4d", "nproc": args.nproc, "grid": args.grid or "default", "steps": args.steps,
              "save_every": args.save_every,
              "workload": f"GPT {args.n_layer}x{args.n_embd}, batch {args.batch_size}x{args.seq_len}"}
    rows = [
        dict(common, name="uninterrupted", s_per_iter=clean_s / args.steps, wall_s=clean_s),
        dict(common, name="faults", s_per_iter=faulted_s / args.steps, wall_s=faulted_s,
             kills=[f"{r}:{s}" for r, s in faults], restarts_survived=len(resumed),
             resumed_from=[step for _, step in resumed], steps_recomputed=recomputed,
             final_model_identical=identical, wall_ratio=faulted_s / clean_s),
    ]
    if not emit(rows, args.out, args.json):
        row = rows[1]
        print(f"{args.steps} steps, checkpoint every {args.save_every}, {args.nproc} ranks, {common['workload']}")
        print(f"kills (rank:step)        {', '.join(row['kills'])}")
        print(f"restarts survived        {row['restarts_survived']} of {len(faults)}")
        print(f"resumed from steps       {', '.join(map(str, row['resumed_from']))}")
        print(f"steps computed twice     {recomputed} (at most {args.save_every} per kill)")
        print(f"wall time                {faulted_s:.1f} s vs {clean_s:.1f} s uninterrupted "
              f"({row['wall_ratio']:.2f}x)")
        print(f"final model identical    {'yes, bit for bit' if identical else 'NO'}")
    return 0 if identical and len(resumed) == len(faults) else 1
