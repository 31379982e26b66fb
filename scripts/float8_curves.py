"""Float8 against bf16 on one device, side by side: ``par4d train`` twice on the same model, batch and steps
(bf16 compute, fp32 masters), the second with ``--float8 RECIPE``; then tokens/s and the loss every N steps of
both, and the float8 run's share of the bf16 run's time (docs/planner.md, "On a GPU": the issue's float8 check).
On a CPU float8 is emulated and slower: this measures speed on a GPU with float8 (Hopper); on a CPU, with a
tiny shape, it checks only that both runs go through.

    .venv/bin/python scripts/float8_curves.py --out runs/float8 [--recipe tensorwise] [--steps 200]
        [--n-layer 24 --n-embd 1024 --n-head 16 --seq-len 1024 --batch-size 16] [--peak-flops 989e12]

Writes OUT/bf16 and OUT/float8-RECIPE (run folders) and OUT/curves.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _train(out: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    """One ``par4d train`` run on one rank; its summary and every step's loss."""
    command = [sys.executable, "-m", "par4d.cli", "train", "--nproc", "1", "--grid", "data=1", "--precision", "bf16",
               "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--no-progress", "--no-tensorboard", "--out", str(out), *extra]
    if args.peak_flops:
        command += ["--peak-flops", str(args.peak_flops)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a new folder for both runs and curves.json")
    parser.add_argument("--recipe", default="tensorwise", help="torchao's recipe (par4d train --float8)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25, help="print the losses every N steps")
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--peak-flops", type=float, default=None, help="the device's bf16 peak (FLOP/s)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    runs = {"bf16": _train(out / "bf16", args, []),
            f"float8 {args.recipe}": _train(out / f"float8-{args.recipe}", args, ["--float8", args.recipe])}
    (out / "curves.json").write_text(json.dumps({name: {"tokens_per_s": run["summary"]["tokens_per_s"],
                                                        "percent_of_peak": run["summary"]["percent_of_peak"],
                                                        "losses": run["losses"]} for name, run in runs.items()}))
    (bf16, float8) = runs.values()
    print(f"\n{'':<20} {'tokens/s':>12} {'% of peak':>10}")
    for name, run in runs.items():
        print(f"{name:<20} {run['summary']['tokens_per_s']:>12,.0f} {run['summary']['percent_of_peak']:>9.1f}%")
    print(f"float8 takes {bf16['summary']['tokens_per_s'] / float8['summary']['tokens_per_s']:.3f}x bf16's time "
          f"a step\n\n{'step':>6} {'bf16 loss':>10} {'float8 loss':>12} {'difference':>11}")
    for step in [*range(0, args.steps, args.every), args.steps - 1]:
        a, b = bf16["losses"][step], float8["losses"][step]
        print(f"{step + 1:>6} {a:>10.4f} {b:>12.4f} {b - a:>+11.4f}")


if __name__ == "__main__":
    main()
