"""``par4d bench faults``: a soak test of runs that survive dead ranks and damaged files.

Runs of ``par4d train`` with the same settings: one uninterrupted; one whose ranks are
killed with SIGKILL at random steps (a random rank each time, one kill per attempt,
through the ``PAR4D_FAULTS`` hook) under ``--max-restarts``; and three file-level
faults, each followed by ``par4d train --resume``:

* **corrupt newest**: half the run, then one bit of its newest checkpoint flipped;
* **disk full**: the run in a tmpfs that has room for two checkpoints and a half, so a
  save fails with ENOSPC; the tmpfs is then grown (needs root to mount; else the row
  says it was skipped);
* **SIGKILL in a save**: every process of the run killed the moment a checkpoint folder
  appears (a node lost mid-save).

Reported per fault: whether the run finished, checkpoints lost (the intact ones the run
should hold at its end, ``--keep`` of them, less those that verify; a checkpoint set
aside as corrupt must still be there: must be 0), the steps computed twice, and whether
the final parameters and AdamW state are bit for bit the uninterrupted run's.

The restarts are torch's elastic agent's, the same a torchrun user gets; what par4d
adds is the checkpoint the ranks resume from (``par4d bench checkpoint`` compares its
cost with torch.distributed.checkpoint's), so there is no separate torch row here.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from par4d import checkpoint
from par4d.bench.common import emit
from par4d.folder import Folder
from par4d.train.config import default
from par4d.train.faults import FAULT_ENV
from par4d.train.run_files import METRICS, SUMMARY, read_metrics

KEEP = default("keep")     # the intact checkpoints a run holds at its end (par4d train's default --keep)

RESTART = re.compile(r"restart (\d+): resuming .* from (?:step (\d+)|the start)")


def plan_faults(count: int, steps: int, nproc: int, seed: int) -> list[tuple[int, int]]:
    """``count`` kills (rank, step) at distinct random steps in 1..steps-1, in step order: attempt
    k dies at a later step than attempt k-1, so every attempt gets further than the last."""
    if not 1 <= count < steps:
        raise ValueError(f"--faults must be between 1 and --steps - 1 = {steps - 1}, got {count}")
    rng = random.Random(seed)
    return [(rng.randrange(nproc), step) for step in sorted(rng.sample(range(1, steps), count))]


def _command(args: argparse.Namespace, out: Path, steps: int, resume: bool = False,
             restarts: int = 0) -> list[str]:
    command = [sys.executable, "-m", "par4d.cli", "train", "--steps", str(steps), "--no-progress"]
    if resume:
        return command + ["--resume", str(out)]
    command += ["--nproc", str(args.nproc), "--save-every", str(args.save_every), "--n-layer", str(args.n_layer),
                "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--batch-size", str(args.batch_size),
                "--seq-len", str(args.seq_len), "--out", str(out), "--max-restarts", str(restarts)]
    return command + (["--grid", args.grid] if args.grid else [])


def _train(args: argparse.Namespace, out: Path, faults: list[tuple[int, int]], steps: int | None = None,
           resume: bool = False, check: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds and result of one ``par4d train`` run (``check``: raise unless it succeeded)."""
    command = _command(args, out, steps or args.steps, resume, len(faults))
    env = dict(os.environ, **{FAULT_ENV: ",".join(f"{rank}:{step}" for rank, step in faults)})
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if check and result.returncode != 0:
        raise RuntimeError(f"par4d train ({'with' if faults else 'without'} faults) failed with status "
                           f"{result.returncode}:\n{result.stderr[-3000:]}")
    return seconds, result


def final_state(run: Path) -> dict:
    """Every tensor of the run's newest intact checkpoint, keyed by file and name."""
    from safetensors.torch import load_file

    folder = checkpoint.choose(run)
    return {f"{f.name}/{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def lost_checkpoints(run: Path, final_step: int, save_every: int, set_aside: int = 0) -> int:
    """Checkpoints a run at ``final_step`` should hold intact (its newest ``KEEP`` saves), less those that verify;
    plus those that should be set aside as corrupt (``set_aside``) and are not there."""
    folder = run / checkpoint.FOLDER
    expected = sorted({final_step, *range(save_every, final_step, save_every)}, reverse=True)[:KEEP]
    intact = 0
    for step in expected:
        try:
            checkpoint.verify(folder / checkpoint.step_name(step))
            intact += 1
        except ValueError:
            pass
    kept_aside = len(list(folder.glob(f"{checkpoint.CORRUPT}step-*")))
    return len(expected) - intact + max(0, set_aside - kept_aside)


def _flip_newest(run: Path) -> int:
    """Flip one bit in the middle of the newest checkpoint's first piece; returns its step."""
    newest = checkpoint.choose(run)
    piece = sorted(newest.glob("rank-*.safetensors"))[0]
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 1
    piece.write_bytes(bytes(data))
    return checkpoint.step_of(newest.name)


def _resumed_from(run: Path, result: subprocess.CompletedProcess) -> int | None:
    """The step a resumed run went on from (its summary's), or None if it did not finish."""
    return Folder(run).read_json(SUMMARY)["start_step"] if result.returncode == 0 else None


def _redone(reached: int, resumed: int | None) -> int | None:
    return None if resumed is None else reached - resumed


def _steps_reached(run: Path) -> int:
    return max((r["step"] for r in read_metrics(Folder(run))), default=0) if Folder(run).exists(METRICS) else 0


def _corrupt_newest(args: argparse.Namespace, work: Path) -> dict:
    run, half = work / "corrupt", args.steps // 2
    _train(args, run, [], steps=half)
    flipped = _flip_newest(run)
    _, result = _train(args, run, [], resume=True, check=False)
    resumed = _resumed_from(run, result)
    return {"finished": result.returncode == 0, "fault": f"bit flipped in step {flipped}",
            "resumed_from": [resumed], "steps_redone": _redone(half, resumed),
            "lost": lost_checkpoints(run, args.steps, args.save_every, set_aside=1), "run": run}


def _mount_tmpfs(where: Path, size: int, remount: bool = False) -> bool:
    options = f"{'remount,' if remount else ''}size={size}"
    command = ["mount", "-o", options, where] if remount else ["mount", "-t", "tmpfs", "-o", options, "tmpfs", where]
    return subprocess.run(command, capture_output=True).returncode == 0


def _disk_full(args: argparse.Namespace, work: Path, checkpoint_bytes: int) -> dict:
    """The run on a tmpfs with room for 2.5 checkpoints: the third save fails with ENOSPC; grown, it resumes."""
    mount = work / "tmpfs"
    mount.mkdir()
    if not _mount_tmpfs(mount, int(2.5 * checkpoint_bytes)):
        return {"finished": None, "fault": "skipped: mounting a tmpfs needs root", "lost": None}
    try:
        run = mount / "run"
        _, failed = _train(args, run, [], check=False)
        message = failed.stderr.strip().splitlines()[-1] if failed.stderr.strip() else ""
        reached = _steps_reached(run)
        _mount_tmpfs(mount, 64 * checkpoint_bytes + (64 << 20), remount=True)
        _, result = _train(args, run, [], resume=True, check=False)
        resumed = _resumed_from(run, result)
        lost = lost_checkpoints(run, args.steps, args.save_every)
        finished = result.returncode == 0 and failed.returncode != 0
        kept = work / "disk-full"
        shutil.copytree(run, kept)
        return {"finished": finished, "fault": f"ENOSPC at step {reached}: {message[:160]}",
                "resumed_from": [resumed], "steps_redone": _redone(reached, resumed), "lost": lost, "run": kept}
    finally:
        subprocess.run(["umount", mount], capture_output=True)


def _killed_in_save(args: argparse.Namespace, work: Path) -> dict:
    """Every process of the run SIGKILLed the moment the folder of the save at mid-run appears."""
    run = work / "killed"
    target = (args.steps // 2 // args.save_every) * args.save_every or args.save_every
    folder = run / checkpoint.FOLDER / checkpoint.step_name(target)
    process = subprocess.Popen(_command(args, run, args.steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    while process.poll() is None and not folder.exists():
        time.sleep(0.0005)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    mid_save = folder.is_dir() and not (folder / "manifest.json").is_file()
    _, result = _train(args, run, [], resume=True, check=False)
    resumed = _resumed_from(run, result)
    return {"finished": result.returncode == 0,
            "fault": f"SIGKILL {'during' if mid_save else 'just after'} the save of step {target}",
            "resumed_from": [resumed], "steps_redone": _redone(target, resumed),
            "lost": lost_checkpoints(run, args.steps, args.save_every), "run": run}


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _identical(a: Path, b: Path) -> bool:
    import torch

    want, got = final_state(a), final_state(b)
    return set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def _losses(run: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(Folder(run))]


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
        faulted_s, result = _train(args, faulted, faults)
        resumed = [(int(k), int(step or 0)) for k, step in RESTART.findall(result.stdout)]
        identical = _identical(straight, faulted) and _losses(straight) == _losses(faulted)
        faulted_lost = lost_checkpoints(faulted, args.steps, args.save_every)
        files = []
        for name, scenario in (("corrupt newest", lambda: _corrupt_newest(args, Path(work))),
                               ("disk full", lambda: _disk_full(args, Path(work), _folder_bytes(
                                   checkpoint.choose(straight)))),
                               ("SIGKILL in a save", lambda: _killed_in_save(args, Path(work)))):
            print(f"file fault: {name} ...", file=sys.stderr, flush=True)
            outcome = scenario()
            run = outcome.pop("run", None)
            outcome["final_model_identical"] = (run is not None and outcome["finished"] is True
                                                and _identical(straight, run) and _losses(straight) == _losses(run))
            files.append((name, outcome))
    recomputed = sum(step - resume for (_, step), (_, resume) in zip(faults, resumed))
    common = {"framework": "par4d", "nproc": args.nproc, "grid": args.grid or "default", "steps": args.steps,
              "save_every": args.save_every,
              "workload": f"GPT {args.n_layer}x{args.n_embd}, batch {args.batch_size}x{args.seq_len}"}
    rows = [
        dict(common, name="uninterrupted", s_per_iter=clean_s / args.steps, wall_s=clean_s),
        dict(common, name="faults", s_per_iter=faulted_s / args.steps, wall_s=faulted_s,
             kills=[f"{r}:{s}" for r, s in faults], restarts_survived=len(resumed),
             resumed_from=[step for _, step in resumed], steps_recomputed=recomputed,
             final_model_identical=identical, wall_ratio=faulted_s / clean_s,
             finished=True, checkpoints_lost=faulted_lost),
        *(dict(common, name=name, s_per_iter=None, fault=o["fault"], finished=o["finished"],
               checkpoints_lost=o["lost"], resumed_from=o.get("resumed_from"), steps_recomputed=o.get("steps_redone"),
               final_model_identical=o["final_model_identical"]) for name, o in files),
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
        print()
        print(f"{'fault':<20} {'finished':>8} {'lost':>5} {'redone':>6}  {'bit for bit':>11}  what happened")
        for row in rows[1:]:
            name = "rank kills" if row["name"] == "faults" else row["name"]
            done = "-" if row["finished"] is None else "yes" if row["finished"] else "NO"
            lost = "-" if row["checkpoints_lost"] is None else row["checkpoints_lost"]
            redone = "-" if row["steps_recomputed"] is None else row["steps_recomputed"]
            same = "yes" if row["final_model_identical"] else "-" if row["finished"] is None else "NO"
            what = row.get("fault") or f"{len(faults)} ranks killed, {row['restarts_survived']} restarts"
            print(f"{name:<20} {done:>8} {lost!s:>5} {redone!s:>6}  {same:>11}  {what}")
    ran = [row for row in rows[1:] if row["finished"] is not None]
    good = all(row["finished"] and row["checkpoints_lost"] == 0 and row["final_model_identical"] for row in ran)
    return 0 if good and len(resumed) == len(faults) else 1
