"""Validation on real text and images: ``par4d train`` on one rank and on two 4-rank grids with the same seed
(so the same initial weights and the same batches in the same order), for Hugging Face's GPT-2 on Python's
bundled documentation and for par4d's U-Net on its generated images. Writes ``<out>/validation.md`` and one
figure per model, ``<out>/figures/validation-<model>.png`` (an existing one is refused unless --force).

    .venv/bin/python scripts/validate.py [--steps 300] [--out docs] [--runs DIR] [--force]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from par4d.cli.files import check_new_file
from par4d.train.data import Images

REPO = Path(__file__).resolve().parent.parent
GRIDS = (None, "x=2,z=2", "y=2,data=2")     # None: one rank; each 4-rank grid is compared with it
# Small enough that 300 steps of all six runs take minutes on 2 cores.
SIZES = {"hf-gpt2": ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64", "--batch-size", "8"],
         "unet": ["--n-embd", "32", "--n-layer", "3", "--image-size", "16", "--batch-size", "8"]}
TITLES = {"hf-gpt2": "Hugging Face's GPT-2 (made parallel by par4d.parallelize) on text",
          "unet": "par4d's U-Net on generated images"}
DATA = {"hf-gpt2": "Python's bundled documentation (`pydoc_data.topics`, `par4d train`'s default `--data`), one "
                   "byte per token, 90% for training, 10% for validation",
        "unet": "4 x 16 x 16 images generated from the seed (`par4d.train.data.Images`: a colour gradient with three "
                "discs or squares); input = image + Gaussian noise of standard deviation 0.2, target = the image "
                "(returning the input scores 0.04)"}
UNITS = {"hf-gpt2": "cross-entropy, nats/byte", "unet": "mean squared error"}
# What a model scores without learning anything.
BASELINES = {"hf-gpt2": (math.log(256), "guessing uniformly over 256 bytes"),
             "unet": (Images.NOISE ** 2, "returning the noisy input")}
ULP = 2.0 ** -23   # fp32's spacing relative to a number in [1, 2)
EARLY = 10   # the first steps, whose largest difference is reported apart from the whole run's


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def _name(grid: str | None) -> str:
    return "1 rank" if grid is None else grid


def _command(model: str, grid: str | None, steps: int, out: Path) -> list[str]:
    ranks = ["--nproc", "1"] if grid is None else ["--grid", grid]
    return ["par4d", "train", "--model", model, *SIZES[model], *ranks, "--steps", str(steps), "--no-progress",
            "--out", str(out)]


def _train(command: list[str]) -> float:
    """Run ``par4d train`` (as ``python -m par4d.cli``, one thread per rank); its wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "par4d.cli", *command[1:]], env=env, cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"validate: {shlex.join(command)} failed (exit {result.returncode}):\n"
                         f"{result.stderr[-3000:]}")
    return time.perf_counter() - began


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _largest(losses: list[float], reference: list[float]) -> tuple[float, int]:
    """The largest relative difference |loss - reference| / reference over all steps, and its step (from 1)."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    step = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[step], step + 1


def _plot(model: str, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    one = runs[None]["losses"]
    for (grid, run), style, marker in zip(runs.items(), ("-", "--", ":"), ("", "o", "s")):
        steps = range(1, len(run["losses"]) + 1)
        top.plot(steps, run["losses"], style, lw=1.4, label=_name(grid))
        if grid is not None:   # equal losses (a difference of 0) have no place on a log scale: not drawn
            diffs = [(step, abs(a - b) / abs(b)) for step, a, b in zip(steps, run["losses"], one) if a != b]
            bottom.semilogy(*zip(*diffs), marker, ms=2.5, alpha=0.7, label=f"{grid} vs 1 rank")
    level, label = BASELINES[model]
    top.axhline(level, color="grey", lw=0.8, ls="-.", label=f"{label} ({level:.2f})")
    if model == "unet":
        top.set_yscale("log")
    top.set_ylabel(f"training loss ({UNITS[model]})")
    top.set_title(f"{model}: par4d train, same seed, 1 rank and two 4-rank grids")
    top.legend()
    bottom.set_ylabel("relative difference\n(0 not drawn)")
    bottom.set_xlabel("step")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdict(model: str, runs: dict) -> str:
    """What the numbers say, in words (computed, so the report cannot claim more than was measured)."""
    one = runs[None]["losses"]
    count = min(EARLY, len(one))
    early = max(_largest(run["losses"][:count], one[:count])[0] for grid, run in runs.items() if grid is not None)
    worst = max(run["largest"][0] for grid, run in runs.items() if grid is not None)
    equal = sum(a == b for grid, run in runs.items() if grid is not None for a, b in zip(run["losses"], one))
    level, label = BASELINES[model]
    val = runs[None]["summary"]["val_loss"]
    learnt = (f"The model learnt: its validation loss is {val:.4f}, against {level:.4f} for {label}. " if val < level
              else f"The validation loss, {val:.4f}, is not below the {level:.4f} of {label} yet. ")
    first = (f"Over the first {count} steps the 4-rank losses are the one-rank losses to at most {early:.1e} "
             f"(relative), and {equal} of the {2 * len(one)} 4-rank losses are bit for bit the one-rank ones")
    if worst <= 1e-5:
        return (f"{learnt}{first}; over all {len(one)} steps they differ by at most {worst:.1e}, "
                f"{worst / ULP:.0f} units of fp32's last place ({ULP:.1e} relative): the rounding of sums that 4 "
                f"ranks add in another order, carried from step to step in the weights. The trajectories stay "
                f"together for all {len(one)} steps: the parallel paths train the same model.")
    return (f"{learnt}{first}. Over all {len(one)} steps the largest difference is {worst:.1e}, more than "
            f"rounding within one step: each step starts from weights that earlier rounding made slightly "
            f"different, and training can amplify that; the lower panel shows at which steps it grew. A parallel "
            f"path that computed something else (a missing reduction, a wrong shard) would differ at the first "
            f"step by far more than rounding.")


def _step_seconds(run: Path) -> float:
    """The median seconds of a training step (start-up, checkpoint and validation excluded)."""
    seconds = sorted(json.loads(line)["s_per_step"] for line in (run / "metrics.jsonl").read_text().splitlines())
    return seconds[len(seconds) // 2]


def _report(results: dict, steps: int, started: str, total: float, runs_dir: Path, load: tuple) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    import torch

    version = commit.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")
    cores = os.cpu_count() or 1
    lines = [
        "# Validation: one rank and 4-rank grids train the same",
        "",
        f"Generated by `scripts/validate.py --steps {steps}` on {started} (par4d {version}, torch "
        f"{torch.__version__}, {cores} CPU cores, {platform.machine()}); all runs took {total / 60:.1f} minutes, "
        f"one after another, load average {load[0]:.1f} at the start and {load[1]:.1f} at the end.",
        "",
        "Each model is trained by `par4d train` three times with the same seed, so with the same initial weights "
        "and the same batches in the same order: on one rank, and on 4 ranks as `x=2,z=2` (weights and activations "
        "split over x, weights and samples over z) and `y=2,data=2` (the other tensor axis, and data parallelism). "
        f"Each run is a subprocess with `OMP_NUM_THREADS=1`; the run folders are under `{_shown(runs_dir)}`.",
        "",
        "The relative difference of a step is |loss on 4 ranks - loss on 1 rank| / loss on 1 rank; the largest is "
        "taken over all steps. Run times are wall seconds of the whole command (start-up, training, checkpoint, "
        f"validation), and a step's is the median over the run; 4 ranks share {cores} cores here, so neither says "
        "anything about speed-up.",
    ]
    for model, runs in results.items():
        lines += ["", f"## {model}: {TITLES[model]}", "", f"Data: {DATA[model]}. Loss: {UNITS[model]}.", "",
                  f"![{model}: the loss on 1 rank, x=2,z=2 and y=2,data=2](figures/validation-{model}.png)", "",
                  "| run | parameters | run time | s/step | first loss | final loss | validation loss | "
                  "largest relative difference to 1 rank (step) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for grid, run in runs.items():
            summary = run["summary"]
            diff = "-" if grid is None else f"{run['largest'][0]:.2e} (step {run['largest'][1]})"
            lines.append(f"| {_name(grid)} | {summary['params']:,} | {run['seconds']:.0f} s | {run['step_s']:.3f} | "
                         f"{run['losses'][0]:.4f} | {run['losses'][-1]:.4f} | {summary['val_loss']:.4f} | {diff} |")
        lines += ["", _verdict(model, runs), "", "```", *(shlex.join(run["command"]) for run in runs.values()), "```"]
    lines += ["", "What this does not show: speed (2 shared cores), larger models or other grids than these two, "
                  "and mixed precision (all runs fp32)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of every run (default 300)")
    parser.add_argument("--out", default="docs", help="folder of validation.md and figures/ (default docs)")
    parser.add_argument("--runs", default=None, help="folder for the six runs (default runs/validation-<time>)")
    parser.add_argument("--force", action="store_true", help="replace an existing report and figures")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report, figures = out / "validation.md", {model: out / "figures" / f"validation-{model}.png" for model in SIZES}
    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        for path in (report, *figures.values()):   # before any run: a refusal costs nothing
            check_new_file(path, "--out", args.force, label=str(path))
    except ValueError as error:
        print(f"validate: error: {error}", file=sys.stderr)
        return 2
    runs_dir = Path(args.runs or REPO / "runs" / f"validation-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    started, began, load = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter(), os.getloadavg()[0]
    results = {}
    for model in SIZES:
        runs = {}
        for grid in GRIDS:
            folder = runs_dir / f"{model}-{'1rank' if grid is None else grid.replace('=', '').replace(',', '-')}"
            command = _command(model, grid, args.steps, _shown(folder))   # run in REPO
            print(f"validate: {shlex.join(command)}", flush=True)
            seconds = _train(command)
            runs[grid] = {"command": command, "seconds": seconds, "losses": _losses(folder),
                          "step_s": _step_seconds(folder), "summary": json.loads((folder / "summary.json").read_text())}
            print(f"validate:   {seconds:.0f} s, final loss {runs[grid]['losses'][-1]:.4f}", flush=True)
        for grid, run in runs.items():
            if grid is not None:
                run["largest"] = _largest(run["losses"], runs[None]["losses"])
                print(f"validate: {model} {grid}: largest relative difference to 1 rank {run['largest'][0]:.2e} "
                      f"(step {run['largest'][1]})", flush=True)
        _plot(model, runs, figures[model])
        results[model] = runs
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(_report(results, args.steps, started, time.perf_counter() - began, runs_dir,
                              (load, os.getloadavg()[0])))
    print(f"validate: wrote {report} and {', '.join(map(str, figures.values()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
