"""`par4d train` end to end: run directory contents, exact resume, CLI errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import par4d
from par4d.bench.faults import RESTART, plan_faults
from par4d.cli import _parser, main
from par4d.cli.configure import configure
from par4d.cli.train import _finish
from par4d.grid import default_grid
from tests.helpers import SMALL, checked_config, run_losses, train_alone, train_in_pool, train_pooled, train_subprocess


def test_resume_continues_the_exact_trajectory_and_overlap_changes_no_bit(tmp_path, capsys, pool4):
    """4 ranks on x=2, z=2: 10 steps straight and synchronous (--overlap none) vs 5 steps with
    every overlap and recomputation, stop, resume to 10: the same losses, bit for bit."""
    grid = ["--grid", "x=2,z=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_pooled(pool4, *grid, *SMALL, "--steps", "10", "--out", str(straight), "--overlap", "none")
    printed = capsys.readouterr().out
    train_pooled(pool4, *grid, *SMALL, "--steps", "5", "--out", str(split), "--overlap", "all", "--recompute", "auto")
    assert len(run_losses(split)) == 5
    train_pooled(pool4, "--resume", str(split), "--steps", "10")

    assert run_losses(split) == run_losses(straight)   # bit for bit: same grid, same batches, same state
    overlapped = json.loads((split / "summary.json").read_text())
    assert (overlapped["overlap"], overlapped["recompute_every"]) == ("all", 1)
    assert "in flight" in printed and "exposed" in printed
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["tokens_per_s"] > 0 and r["comm_bytes"] > 0 for r in rows)
    assert (straight / "loss.png").stat().st_size > 1000
    assert (straight / "checkpoints" / (straight / "checkpoints" / "latest").read_text() / "meta.json").is_file()
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["grid"] == {"x": 2, "y": 1, "z": 2, "data": 1, "pipe": 1}
    assert (summary["device"], summary["backend"]) == ("cpu", "gloo") and "(4 ranks, cpu, gloo)" in printed
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["overlap"] == "none" and summary["comm_exposed_s_per_step"] > 0
    # every step of x=2,z=2 gathers and reduces: its time in flight and waited is measured, never left at 0
    assert all(r["comm_exposed_s"] > 0 and r["comm_issued_s"] > 0 for r in rows)
    for field in ("parameters", "tokens/s", "model FLOP/s", "Eq 3", "300 B tokens", "% of peak", "loss",
                  "communication", "step holds"):
        assert field in printed, field
    # What each rank's step held (measured on the first step) is what the planner predicts, within 10%.
    from par4d.models.config import GPTConfig
    from par4d.plan.cost import memory_bytes
    from par4d.plan.workload import GPTSpec

    cfg = summary["config"]
    spec = GPTSpec.from_config("run", GPTConfig(vocab_size=256, block_size=cfg["seq_len"], n_layer=cfg["n_layer"],
                                                n_head=cfg["n_head"], n_embd=cfg["n_embd"]), cfg["batch_size"])
    held = summary["footprint_per_rank"]
    assert len(held) == 4 and all(h["activations"] > 0 and h["gradients"] == h["parameters"] for h in held)
    predicted = memory_bytes(spec, dict(x=2, y=1, z=2, data=1), 4, False, 1, None, None)
    assert max(h["total"] for h in held) == pytest.approx(predicted, rel=0.10)


def test_default_grids():
    assert default_grid(4) == {"x": 2, "z": 2}
    assert default_grid(8) == {"x": 2, "z": 2, "y": 2}
    assert default_grid(16) == {"x": 2, "z": 2, "y": 2, "data": 2}
    assert default_grid(6) == {"x": 3, "z": 2}
    assert default_grid(1) == {"x": 1}


@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--grid", "x=3"], "x=3 * y=1 * z=1 * data=1 * pipe=1 = 3 ranks, but the job has world size 4"),
    (["--nproc", "4", "--grid", "w=4"], "unknown grid axis 'w'; valid axes are x, y, z, data, pipe"),
    (["--nproc", "4", "--grid", "z=2,data=2", "--batch-size", "6"],
     "--batch-size 6 is not divisible by data * z = 2 * 2 = 4"),
    (["--nproc", "4", "--grid", "x=4", "--n-head", "2", "--n-embd", "32"], "n_head=2 is not divisible by x=4"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--data", "/nonexistent/file.txt"], "--data /nonexistent/file.txt: no such file"),
    (["--overlap", "oar,fast"], "--overlap 'oar,fast': unknown 'fast'; give all, none, or a comma list of "
                                "oar, ors, oag, cache, dp"),
    (["--overlap", "oag,cache"], "--overlap oag,cache: the cache keeps gathered weights for recomputation; "
                                 "add --recompute auto (or N), or leave cache out of --overlap (e.g. --overlap oag)"),
    (["--recompute", "3", "--n-layer", "4"], "--recompute 3: the 4 blocks do not split into segments of 3; "
                                             "give a divisor of 4: 1, 2, 4"),
    (["--recompute", "sometimes"], "--recompute 'sometimes': give none, auto, or a block count N >= 1"),
])
def test_cli_errors_before_any_process_starts(tmp_path, capsys, args, message):
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "run").exists()


def test_cli_never_overwrites_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert main(["train", "--out", str(run), "--nproc", "1", "--steps", "1", *SMALL]) == 2
    assert "already holds files; pass --resume" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert main(["train", "--resume", str(tmp_path / "missing")]) == 2
    assert "missing: no such folder" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert f"--resume {tmp_path} is not a par4d run folder (it has no checkpoints/ folder)" in capsys.readouterr().err
    assert main(["train", "--out", str(run / "metrics.jsonl")]) == 2
    assert "metrics.jsonl is a file; give a folder" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"\x7fELF\x02\x01\x01\x00\xd0\xff" * 400, "is not UTF-8 text (byte 0xd0 at offset 8)"),
    (b"text\x00" * 400, "holds NUL bytes (offset 4): not a text file"),
    (b"short text", "has 10 bytes; --seq-len 16 needs at least 180"),
])
def test_data_is_checked_before_any_process_starts(tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    assert main(["train", "--data", str(data), *SMALL, "--out", str(tmp_path / "run")]) == 2
    assert f"--data {data} {message}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "nan", "--lr must be a finite number > 0, got nan"),
    ("--lr", "inf", "--lr must be a finite number > 0, got inf"),
    ("--grad-clip", "nan", "--grad-clip must be a finite number >= 0 (0 disables), got nan"),
    ("--save-every", "-1", "--save-every must be >= 0 (0: only at the end), got -1"),
    ("--bucket-mb", "0", "--bucket-mb must be a finite size of at least one byte (2**-20 MB), got 0.0"),
    ("--bucket-mb", "nan", "--bucket-mb must be a finite size of at least one byte (2**-20 MB), got nan"),
    ("--bucket-mb", "inf", "--bucket-mb must be a finite size of at least one byte (2**-20 MB), got inf"),
    ("--offload-optimizer", "64", "--offload-optimizer 64: needs --precision bf16 or fp16 (got fp32)"),
    ("--pipeline-limit", "2", "--pipeline-limit 2: give a count >= 1 of microbatches in flight, on a grid with "
                              "pipe > 1 (this grid has pipe=1)"),
])
def test_settings_are_checked_before_any_process_starts(tmp_path, capsys, flag, value, message):
    assert main(["train", flag, value, *SMALL, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err


def _counting_buckets(config) -> tuple[dict, list[tuple[int, int]]]:
    """`par4d train` on a pool's rank: (rank 0's summary, (cap in bytes, buckets) of every run of gradients the
    data-parallel sync cut into buckets)."""
    from unittest import mock

    from par4d.optim import data_parallel

    with mock.patch.object(data_parallel, "_buckets", wraps=data_parallel._buckets) as cut:
        summary = train_in_pool(config)
    return summary, [(c.args[1], len(data_parallel._buckets(*c.args))) for c in cut.call_args_list]


def test_bucket_mb_sizes_the_syncs_buckets_and_a_resume_keeps_or_changes_it(tmp_path, capsys, pool4):
    """--bucket-mb is the sync's bucket size (DDP's bucket_cap_mb). On data=2, x=2 every sum has two terms, whose
    order cannot round otherwise: 1 KB buckets train the same bits as the default 25 MB ones, in more buckets.
    The run's config.toml and summary keep the size; a resume keeps it, or takes a new one."""
    grid = ["--grid", "data=2,x=2", *SMALL, "--steps", "3"]
    default, small = tmp_path / "default", tmp_path / "small"
    runs = {}
    for out, flags in ((default, []), (small, ["--bucket-mb", "0.0009765625"])):     # 2**-10 MB: 1 KB
        summary, cuts = pool4.run(_counting_buckets, checked_config(*grid, *flags, "--out", str(out), world=4))[0]
        assert _finish(summary) == 0
        runs[out] = cuts
    printed = capsys.readouterr().out
    assert {cap for cap, _ in runs[default]} == {25 * 2**20} and {cap for cap, _ in runs[small]} == {1024}
    assert sum(n for _, n in runs[small]) > sum(n for _, n in runs[default]) >= 1
    assert run_losses(small) == run_losses(default) and len(run_losses(small)) == 3
    assert "bucket_mb = 0.0009765625" in (small / "config.toml").read_text()
    assert json.loads((small / "summary.json").read_text())["config"]["bucket_mb"] == 2**-10
    assert "gradient buckets of 0.000976562 MB" in printed and printed.count("gradient buckets of") == 1
    assert checked_config("--resume", str(small), "--steps", "5", world=4).bucket_mb == 2**-10
    assert checked_config("--resume", str(small), "--steps", "5", "--bucket-mb", "4", world=4).bucket_mb == 4
    planned = []

    def planner(world: int, **choices):      # what --grid auto plans with, then no further
        planned.append(choices["bucket_mb"])
        raise ValueError("planned")

    for flags, size in (([], 2**-10), (["--bucket-mb", "4"], 4)):
        args = _parser().parse_args(["train", "--resume", str(small), "--steps", "5", "--grid", "auto", *flags])
        with pytest.raises(ValueError, match="planned"):
            configure(args, 4, inside=False, planner=planner)
        assert planned.pop() == size


def _on_two_nodes(config) -> dict:
    """`par4d train` on a pool's rank, as if ranks 0-1 and 2-3 were two nodes (the ranks find their nodes from
    par4d.hierarchy.node_key)."""
    from unittest import mock

    import torch.distributed as dist

    with mock.patch("par4d.hierarchy.node_key", return_value=f"node-{dist.get_rank() // 2}"):
        return train_in_pool(config)


def test_the_summary_names_the_groups_summed_in_stages_across_nodes(tmp_path, capsys, pool4):
    """Which collectives go in stages decides the order of summation, and under --hierarchical auto a probe at start
    decides: the summary says which groups went so. data=4 over two nodes of 2, staged: "data"; on one node, none."""
    from dataclasses import replace

    flags = ["--grid", "data=4", *SMALL, "--steps", "2"]
    two = replace(checked_config(*flags, "--out", str(tmp_path / "two"), world=4), hierarchical="on")   # (the CLI
    summary = pool4.run(_on_two_nodes, two)[0]                            # refuses on for its own one-node ranks)
    assert _finish(summary) == 0 and summary["staged"] == ["data"]
    assert "; staged across nodes over data (--hierarchical on)" in capsys.readouterr().out
    one = train_pooled(pool4, *flags, "--out", str(tmp_path / "one"))
    assert one["staged"] == [] and "staged across nodes" not in capsys.readouterr().out


def _torchrun(*args: str, faults: str = "", restarts: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PAR4D_FAULTS=faults)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", str(restarts), "-m", "par4d.cli", "train", "--grid", "x=2", *SMALL, *args],
        capture_output=True, text=True, timeout=240, env=env)


def test_joins_a_torchrun_job_and_survives_its_restarts(tmp_path):
    """Under torchrun, `par4d train` joins the job instead of launching its own ranks. Rank 1
    killed after step 3 (checkpoints every 2): torchrun restarts both, which go on in their
    own --out from step 2. A rank that raises says so in one line of its own."""
    run = tmp_path / "torchrun"
    result = _torchrun("--steps", "5", "--save-every", "2", "--out", str(run), faults="1:3", restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert RESTART.findall(result.stdout) == [("1", "2")], result.stdout[-2000:]
    assert len(run_losses(run)) == 5
    assert json.loads((run / "summary.json").read_text())["grid"]["x"] == 2

    raised = tmp_path / "raised"
    result = _torchrun("--steps", "3", "--out", str(raised), faults="0:1:RAISE")
    assert result.returncode != 0
    assert (f"par4d train: error: rank 0 failed: RuntimeError: fault injected by PAR4D_FAULTS after step 1 "
            f"(traceback in {raised / 'logs' / 'rank-0.log'})") in result.stderr.splitlines()


def test_bench_grid_rows_and_exact_bytes(pool4):
    """`par4d bench grid`'s rows (on the pool's ranks, 4 sequences): every valid grid, and byte counts that must
    agree exactly: data-only par4d and DDP both all-reduce every gradient once."""
    from par4d.bench.grid import BenchSettings, bench_rows
    from par4d.measure.grids import CONFIG, grids

    rows = pool4.run(bench_rows, BenchSettings(nproc=4, iters=1, peak_flops=1e9, warmup=0, batch=4), timeout=240)[0]
    par4d_rows = [r for r in rows if r["name"] == "par4d"]
    assert len(par4d_rows) == len(grids(4)) == 10
    for row in rows:
        assert {"name", "grid", "s_per_iter", "tokens_per_s", "bytes_per_iter"} <= set(row)
        assert row["tokens_per_s"] == pytest.approx(4 * CONFIG.block_size / row["s_per_iter"])   # the 4 sequences'
        assert row["percent_of_peak"] == pytest.approx(100 * CONFIG.flops_per_token() * row["tokens_per_s"] / 1e9)
    grad_bytes_all_ranks = 4 * 4 * CONFIG.num_params()
    ddp = next(r for r in rows if r["name"] == "torch DDP")
    data_only = next(r for r in par4d_rows if r["grid"] == "x=1 y=1 z=1 data=4")
    assert ddp["bytes_per_iter"] == data_only["bytes_per_iter"] == grad_bytes_all_ranks
    # z only, per rank: all-gather of each weight's shard (W/4) and reduce-scatter of
    # its full gradient (W); one all-reduce of the biases and norm gains (B).
    from par4d.models import ReferenceGPT

    params = list(ReferenceGPT(CONFIG, init=False).parameters())
    weights = sum(p.numel() for p in params if p.dim() == 2)
    vectors = sum(p.numel() for p in params if p.dim() == 1)
    z_only = next(r for r in par4d_rows if r["grid"] == "x=1 y=1 z=4 data=1")
    assert z_only["bytes_per_iter"] == 4 * 4 * (weights // 4 + weights + vectors)
    # Every par4d row reports what its step holds; data-only holds every parameter with AdamW's two moments.
    assert all(r["held_bytes_per_rank"] == r["held"]["total"] > 0 for r in par4d_rows)
    assert data_only["held"]["parameters"] == data_only["held"]["gradients"] == 4 * CONFIG.num_params()
    assert data_only["held"]["optimizer"] >= 2 * 4 * CONFIG.num_params()
    assert ddp["held_bytes_per_rank"] is None


def test_resume_on_another_grid_and_rank_count(tmp_path, capsys, pool2, pool4):
    """4 steps on 2 ranks (x=2), then resumed on 4 ranks at z=2,data=2 up to 6: the run goes on
    from its checkpoint, says the grid changed, and follows a one-rank run to fp32 rounding."""
    run, alone = tmp_path / "moved", tmp_path / "alone"
    train_alone(checked_config("--nproc", "1", *SMALL, "--steps", "6", "--out", str(alone), world=1))
    train_pooled(pool2, "--grid", "x=2", *SMALL, "--steps", "4", "--out", str(run))
    capsys.readouterr()
    train_pooled(pool4, "--resume", str(run), "--grid", "z=2,data=2", "--steps", "6")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert run_losses(run) == pytest.approx(run_losses(alone), rel=1e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["grid_changed"] and summary["resumed_from"]["grid"]["x"] == 2
    assert summary["grid"] == {"x": 1, "y": 1, "z": 2, "data": 2, "pipe": 1}
    printed = capsys.readouterr().out
    assert "saved on grid x=2 y=1 z=1 data=1 pipe=1: the grid changed" in printed
    # the run's --peak-flops (SMALL's) was for 2 ranks: measured again for 4, and said
    assert "the run's --peak-flops 1e+11 was for 2 ranks: measured again on 4" in printed
    assert summary["matmul_peak_flops_per_s"] != 1e11 and "(fp32, every core; measured at start-up)\n" in printed


def _final_tensors(run: Path) -> dict:
    from safetensors.torch import load_file

    folder = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update({f"{file.name}/{k}": v for k, v in load_file(file).items()})
    return tensors


def test_a_killed_rank_and_a_preempted_run_end_as_an_uninterrupted_one(tmp_path, pool2):
    """One run of 14 steps (checkpoints every 5), stopped and resumed: its launcher gets SIGTERM after step 7:
    every rank saves step 7 and exits (status 143); resumed, rank 1 alone gets SIGTERM after step 9: every rank
    saves step 9 and stops, read as a stop with the rank and signal named; resumed again, rank 1 is killed with
    SIGKILL after step 12: the agent restarts both ranks, which resume from step 10. It ends with the
    parameters, AdamW state and losses of an uninterrupted run (on the pool), bit for bit."""
    common = ["--grid", "x=2", *SMALL, "--steps", "14", "--save-every", "5"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train_pooled(pool2, *common, "--out", str(straight))
    result = train_subprocess("--nproc", "2", *common, "--out", str(run), env_extra={"PAR4D_FAULTS": "0:7:TERM"},
                              status=143)
    assert f"stopped by SIGTERM: step 7 is saved; continue with: par4d train --resume {run}" in result.stdout
    assert len(run_losses(run)) == 7 and not (run / "summary.json").exists()

    result = train_subprocess("--resume", str(run), "--nproc", "2", env_extra={"PAR4D_FAULTS": "1:9:TERM_RANK"},
                              status=143)
    assert (f"stopped by SIGTERM (sent to rank 1): step 9 is saved; continue with: par4d train --resume {run}"
            in result.stdout)
    assert len(run_losses(run)) == 9 and "failed" not in result.stderr

    result = train_subprocess("--resume", str(run), "--nproc", "2", "--max-restarts", "1",
                              env_extra={"PAR4D_FAULTS": "1:12"})
    assert RESTART.findall(result.stdout) == [("1", "10")], result.stdout[-2000:]   # what bench faults reads
    assert json.loads((run / "summary.json").read_text())["start_step"] == 10
    assert run_losses(run) == run_losses(straight)
    want, got = _final_tensors(straight), _final_tensors(run)
    assert set(got) == set(want) and all(torch_equal(got[k], want[k]) for k in want)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_resume_keeps_the_model_and_data_takes_the_schedule(tmp_path, capsys, monkeypatch):
    """A resume refuses a different model, batch, seed, --out or data file (its checksum is
    recorded, so a resume from another folder or of an edited file is caught), and takes a
    new --lr and step count."""
    data = tmp_path / "corpus.txt"
    data.write_text("par4d trains on this line of text. " * 40)
    run = tmp_path / "run"
    train_alone(checked_config("--nproc", "1", *SMALL, "--steps", "3", "--data", str(data), "--out", str(run), world=1))
    saved = json.loads((run / "summary.json").read_text())["config"]
    assert saved["data"] == str(data.resolve()) and len(saved["data_sha256"]) == 64

    monkeypatch.chdir(tmp_path.parent)   # the recorded path is absolute: resuming from elsewhere finds the file
    for args, message in [
        (["--batch-size", "16"], "--batch-size 16 differs from the run's 8; a resumed run keeps its model"),
        (["--n-embd", "64"], "--n-embd 64 differs from the run's 32"),
        (["--seed", "1"], "--seed 1 differs from the run's 0"),
        (["--out", str(tmp_path / "other")], f"--out {tmp_path / 'other'} names another"),
        (["--data", str(tmp_path / "other.txt")], f"--data {tmp_path / 'other.txt'} is not the run's data"),
    ]:
        assert main(["train", "--resume", str(run), "--steps", "5", *args]) == 2
        assert message in capsys.readouterr().err, args
    data.write_text("par4d trains on this line of text! " * 40)
    assert main(["train", "--resume", str(run), "--steps", "5"]) == 2
    assert "is not the text this run started on" in capsys.readouterr().err
    data.write_text("par4d trains on this line of text. " * 40)

    capsys.readouterr()
    train_alone(checked_config("--resume", str(run), "--nproc", "1", "--steps", "5", "--lr", "0.001",
                               "--batch-size", "8", "--peak-flops", "2e11", world=1))
    printed = capsys.readouterr().out
    assert "--lr 0.001 replaces the run's 0.003 from step 3" in printed
    assert "--peak-flops 2e+11 replaces the run's 1e+11 from step 3" in printed     # not 200000000000.0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["lr"] == pytest.approx(0.001 * 4 / 20) and rows[2]["lr"] == pytest.approx(0.003 * 3 / 20)


def test_an_error_inside_a_rank_is_one_line_and_a_nan_loss_stops_the_run(tmp_path):
    """A learning rate of 1e30 turns the loss NaN at step 2: the run stops before recording it,
    the user reads one line naming the rank and the cause, and the traceback is in the run's log."""
    run = tmp_path / "run"
    result = train_subprocess("--nproc", "2", "--grid", "x=2", *SMALL, "--steps", "10", "--lr", "1e30",
                              "--grad-clip", "0", "--out", str(run), status=1)
    lines = result.stderr.strip().splitlines()
    rank = lines[0].removeprefix("par4d train: error: rank ")[0]   # both ranks fail; the first to is named
    log = run / "logs" / f"rank-{rank}.log"
    assert lines == [f"par4d train: error: rank {rank} failed: FloatingPointError: the loss is nan at step 2 "
                     f"(learning rate 1e+29): the run stops here without recording it (try a lower --lr, or "
                     f"--grad-clip; a resume takes both) (traceback in {log})"]
    assert "Traceback (most recent call last)" in log.read_text() and "FloatingPointError" in log.read_text()
    assert len(run_losses(run)) == 1


def test_bench_faults_plans_one_kill_per_attempt_each_further_on():
    kills = plan_faults(5, 60, 4, seed=3)
    steps = [step for _, step in kills]
    assert len(kills) == 5 and steps == sorted(set(steps)) and all(1 <= s < 60 for s in steps)
    assert all(0 <= rank < 4 for rank, _ in kills) and kills == plan_faults(5, 60, 4, seed=3)
    with pytest.raises(ValueError, match="--faults must be between 1 and --steps - 1 = 9, got 10"):
        plan_faults(10, 10, 4, seed=0)


def test_an_error_on_one_rank_tears_the_job_down(tmp_path):
    """Rank 1 of 2 raises after step 3 while rank 0 waits for it in a collective: nobody hangs (the
    subprocess timeout is the hang detector), the user reads one line naming rank 1, not rank 0's echo of
    its peer gone (which rank a message names: tests/test_errors.py), and its traceback is in the run's log.
    (Under --max-restarts a failed rank's run goes on from its checkpoint:
    test_a_killed_rank_and_a_preempted_run_end_as_an_uninterrupted_one, the peers' path the same.)"""
    run = tmp_path / "run"
    common = [*SMALL, "--steps", "6", "--save-every", "2"]
    result = train_subprocess("--nproc", "2", "--grid", "x=2", *common, "--out", str(run),
                              env_extra={"PAR4D_FAULTS": "1:3:RAISE"}, status=1, timeout=120)
    assert result.stderr.strip().splitlines() == [
        f"par4d train: error: rank 1 failed: RuntimeError: fault injected by PAR4D_FAULTS after step 3 "
        f"(traceback in {run / 'logs' / 'rank-1.log'})"]
    assert "RuntimeError: fault injected" in (run / "logs" / "rank-1.log").read_text()


def test_a_run_exported_to_transformers_starts_another_run_on_another_grid(tmp_path, capsys, pool2, pool4):
    """3 steps on x=2 (2 ranks), `par4d export` to a Hugging Face folder, then a new run on
    z=2,data=2 (4 ranks) with `--init-from hf`: its first loss (before its first update) is the
    loss transformers computes for the exported model on that run's first batch."""
    import torch
    from transformers import GPT2LMHeadModel

    from par4d.train.data import Batches, as_tokens, read_corpus

    first, exported, second = tmp_path / "first", tmp_path / "hf", tmp_path / "second"
    train_pooled(pool2, "--grid", "x=2", *SMALL, "--steps", "3", "--out", str(first))
    assert main(["export", "--run", str(first), "--to", "hf", str(exported)]) == 0
    capsys.readouterr()
    train_pooled(pool4, "--grid", "z=2,data=2", "--init-from", "hf", str(exported), "--batch-size", "8", "--steps", "2",
                 "--seed", "5", "--no-progress", "--out", str(second))   # shape from config.json, other batches
    assert re.search(rf"started from +{re.escape(str(exported))}\n", capsys.readouterr().out)
    summary = json.loads((second / "summary.json").read_text())
    assert (summary["config"]["n_embd"], summary["config"]["seq_len"]) == (32, 16)

    model = GPT2LMHeadModel.from_pretrained(exported).eval()
    inputs, targets = Batches(as_tokens(read_corpus(None, 16)), 16, 8, seed=5).train_batch(0)
    with torch.no_grad():
        logits = model(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)).item()
    assert run_losses(second)[0] == pytest.approx(want, abs=1e-5)
    assert main(["train", "--resume", str(second), "--init-from", "hf", str(exported), "--steps", "3"]) == 2


def test_the_pipeline_trains_as_one_rank_and_resumes_across_pipe(tmp_path, capsys, pool4):
    """`--grid pipe=2,x=2 --microbatches 4 --pipeline-limit 1` for 4 steps, resumed on pipe=4 to 6: the losses of a
    one-rank run to fp32 rounding. A stage that raises ends the job with one line, no hang."""
    common = ["--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "16",
              "--no-progress", "--peak-flops", "1e11"]
    alone, piped = tmp_path / "alone", tmp_path / "piped"
    train_alone(checked_config("--nproc", "1", *common, "--steps", "6", "--out", str(alone), world=1))
    train_pooled(pool4, "--grid", "pipe=2,x=2", "--microbatches", "4", "--pipeline-limit", "1", *common, "--steps", "4",
                 "--out", str(piped))
    capsys.readouterr()
    train_pooled(pool4, "--resume", str(piped), "--grid", "pipe=4", "--steps", "6")
    assert "saved on grid x=2 y=1 z=1 data=1 pipe=2: the grid changed" in capsys.readouterr().out
    assert run_losses(piped) == pytest.approx(run_losses(alone), rel=1e-5)
    # Rank 0 is the first stage: it sends each step's activations forward, 8 x 16 x 32 fp32 values.
    rows = [json.loads(line) for line in (piped / "metrics.jsonl").read_text().splitlines()]
    assert [r["p2p_sent_bytes"] for r in rows] == [8 * 16 * 32 * 4] * 6
    assert json.loads((piped / "summary.json").read_text())["grid"]["pipe"] == 4

    failed = tmp_path / "failed"
    result = train_subprocess("--grid", "pipe=2", *common, "--steps", "6", "--out", str(failed),
                              env_extra={"PAR4D_FAULTS": "1:2:RAISE"}, status=1, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("par4d train: error: rank 1 failed: RuntimeError: fault"), lines


def test_mixed_precision_run_resumes_in_another_precision(tmp_path, capsys, pool4):
    """fp16 with the optimizer offloaded on pipe=2,x=2 for 4 steps (metrics carry the loss scale
    and skipped steps), resumed in
    fp32 to 6 from the fp32 masters its checkpoint holds; its losses follow an fp32 run to 1e-2."""
    common = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "16",
              "--no-progress", "--peak-flops", "1e11"]
    half, full = tmp_path / "half", tmp_path / "full"
    train_alone(checked_config("--nproc", "1", *common, "--steps", "6", "--out", str(full), world=1))
    capsys.readouterr()
    train_pooled(pool4, "--grid", "pipe=2,x=2", "--precision", "fp16", "--offload-optimizer", "100", *common,
                 "--steps", "4", "--out", str(half))
    assert ("AdamW offloaded to CPU memory in buckets of 100 elements, stepping after the whole all-reduce "
            "(gradient clipping needs the global norm)") in capsys.readouterr().out
    rows = [json.loads(line) for line in (half / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss_scale"], r["skipped_steps"]) for r in rows] == [(2.0 ** 16, 0)] * 4
    train_pooled(pool4, "--resume", str(half), "--precision", "fp32", "--steps", "6")
    assert "--precision fp32 replaces the run's fp16 from step 4" in capsys.readouterr().out
    assert run_losses(half) == pytest.approx(run_losses(full), rel=1e-2)


def test_hugging_face_models_train_as_one_rank(tmp_path, capsys, pool4):
    """`--model hf-gpt2` on x=2,z=2 and on pipe=2,x=2 (its head tied to the embeddings on both stages) resumed
    on x=2,z=2, and `--model hf-llama` on x=2,y=2, resumed on z=2,data=2: the losses of the one-rank runs to
    fp32 rounding (par4d.parallelize inside the loop; its checkpoint moves between grids like the GPT's). One
    rank runs in this process, 4 on the pool."""
    common = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--batch-size", "8", "--seq-len", "16",
              "--no-progress", "--peak-flops", "1e11"]
    runs = {name: tmp_path / name for name in ("gpt2-1", "gpt2-4", "gpt2-piped", "llama-1", "llama-4")}
    train_alone(checked_config("--model", "hf-gpt2", "--nproc", "1", *common, "--steps", "6",
                               "--out", str(runs["gpt2-1"]), world=1))
    assert "hf-gpt2: Hugging Face's, made parallel by par4d.parallelize" in capsys.readouterr().out
    pool4.run(train_in_pool, checked_config("--model", "hf-gpt2", "--grid", "x=2,z=2", *common, "--steps", "4",
                                            "--out", str(runs["gpt2-4"]), world=4))
    assert run_losses(runs["gpt2-4"]) == pytest.approx(run_losses(runs["gpt2-1"])[:4], rel=1e-5)
    pool4.run(train_in_pool, checked_config("--model", "hf-gpt2", "--grid", "pipe=2,x=2", *common, "--steps", "4",
                                            "--out", str(runs["gpt2-piped"]), world=4))
    pool4.run(train_in_pool, checked_config("--resume", str(runs["gpt2-piped"]), "--grid", "x=2,z=2", "--steps", "6",
                                            "--no-progress", world=4))
    assert run_losses(runs["gpt2-piped"]) == pytest.approx(run_losses(runs["gpt2-1"]), rel=1e-5)
    train_alone(checked_config("--model", "hf-llama", "--nproc", "1", *common, "--steps", "6",
                               "--out", str(runs["llama-1"]), world=1))
    pool4.run(train_in_pool, checked_config("--model", "hf-llama", "--grid", "x=2,y=2", *common, "--steps", "4",
                                            "--out", str(runs["llama-4"]), world=4))
    resumed = pool4.run(train_in_pool, checked_config("--resume", str(runs["llama-4"]), "--grid", "z=2,data=2",
                                                      "--steps", "6", "--no-progress", world=4))[0]
    assert resumed["grid_changed"] and resumed["start_step"] == 4
    assert run_losses(runs["llama-4"]) == pytest.approx(run_losses(runs["llama-1"]), rel=1e-5)
    # Exported as its own GPT-2 and started from on one rank: its first loss is what transformers computes
    import torch
    from transformers import GPT2LMHeadModel

    from par4d.train.data import Batches, as_tokens, read_corpus

    exported, again = tmp_path / "exported", tmp_path / "again"
    assert main(["export", "--run", str(runs["gpt2-4"]), "--to", "hf", str(exported)]) == 0
    train_alone(checked_config("--model", "hf-gpt2", "--init-from", "hf", str(exported), "--nproc", "1",
                               "--batch-size", "8", "--seq-len", "16", "--steps", "1", "--seed", "5", "--no-progress",
                               "--out", str(again), world=1))
    model = GPT2LMHeadModel.from_pretrained(exported).eval()
    inputs, targets = Batches(as_tokens(read_corpus(None, 16)), 16, 8, seed=5).train_batch(0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(inputs).logits.reshape(-1, 256), targets.reshape(-1)).item()
    assert run_losses(again)[0] == pytest.approx(want, abs=1e-5)


def test_a_hugging_face_model_too_big_for_the_machine_is_refused_with_its_own_count(tmp_path, capsys):
    """Its parameters counted on the meta device (the gated MLP's three matrices, grouped key/value heads),
    not par4d's GPT formula, before any rank starts."""
    import torch

    from par4d.train.config import TrainConfig
    from par4d.train.recipes.hf import hf_lm

    sizes = ["--n-layer", "64", "--n-embd", "16384", "--n-head", "16", "--seq-len", "16"]
    with torch.device("meta"):
        lm = hf_lm(TrainConfig(grid={}, out=None, model="hf-llama", n_layer=64, n_embd=16384, n_head=16, seq_len=16))
    count = sum(p.numel() for p in lm.parameters())
    assert main(["train", "--model", "hf-llama", *sizes, "--nproc", "1", "--out", str(tmp_path / "run")]) == 2
    assert f"the model (hf-llama, n_layer=64, n_embd=16384, n_head=16, seq_len=16) has {count:,} parameters" in (
        capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_hugging_face_models_refuse_what_is_for_the_gpt(tmp_path, capsys):
    assert main(["train", "--model", "hf-llama", "--grid", "pipe=4", "--nproc", "4", *SMALL, "--n-layer", "2",
                 "--out", str(tmp_path / "run")]) == 2
    assert "pipe=4: each stage needs at least one of the n_layer=2 blocks" in capsys.readouterr().err
    assert main(["train", "--model", "hf-llama", "--mlp", "phantom", "--nproc", "1", *SMALL,
                 "--out", str(tmp_path / "run")]) == 2
    assert "--model hf-llama: --mlp phantom is for par4d's GPT (--model gpt)" in capsys.readouterr().err
    assert main(["train", "--model", "hf-llama", "--recompute", "2", "--nproc", "1", *SMALL, "--n-layer", "4",
                 "--out", str(tmp_path / "run")]) == 2
    assert "--recompute 2: a Hugging Face model recomputes each decoder layer on its own" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


UNET = ["--model", "unet", "--n-embd", "16", "--n-layer", "2", "--image-size", "8", "--batch-size", "8",
        "--no-progress"]


def test_unet_trains_as_one_rank_and_resumes_on_another_grid(tmp_path, capsys, pool4):
    """`--model unet`: one rank (this process) for 6 steps; x=2,z=2 (a pool's ranks) for 3, resumed on y=2,data=2
    to 6: the same losses to fp32 rounding, with a validation loss, checkpoints and a summary as the GPT's.
    What does not apply to the U-Net is refused by name."""
    alone, split = tmp_path / "alone", tmp_path / "split"
    train_alone(checked_config(*UNET, "--nproc", "1", "--steps", "6", "--out", str(alone), world=1))
    printed = capsys.readouterr().out
    assert "unet: par4d's U-Net" in printed and "pixels/s" in printed and "Eq 3" not in printed, printed
    pool4.run(train_in_pool, checked_config(*UNET, "--grid", "x=2,z=2", "--steps", "3", "--out", str(split), world=4))
    resumed = pool4.run(train_in_pool, checked_config("--resume", str(split), "--grid", "y=2,data=2", "--steps", "6",
                                                      "--no-progress", world=4))[0]
    assert resumed["grid_changed"] and resumed["start_step"] == 3
    assert run_losses(split) == pytest.approx(run_losses(alone), rel=1e-5)
    one = json.loads((alone / "summary.json").read_text())
    assert resumed["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    assert one["overlap"] == resumed["overlap"] == "oar,ors,oag,dp,xy,ep,cp"   # all but the cache (no recompute)
    assert one["params"] == 19_220 and one["data"].startswith("generated images")

    for args, message in ((["--seq-len", "64"], "--model unet: --seq-len 64 does not apply (the U-Net's sizes"),
                          (["--data", "README.md"], "--model unet: --data README.md is text for the language models"),
                          (["--grid", "pipe=2", "--nproc", "2"], "--model unet: --grid pipe=2 is for par4d's GPT"),
                          (["--image-size", "12", "--n-layer", "4"], "--image-size 12 is not divisible by 2 ** "
                                                                     "(--n-layer - 1) = 8")):
        assert main(["train", *UNET, *args, "--out", str(tmp_path / "refused")]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--image-size", "8", "--out", str(tmp_path / "refused")]) == 2
    assert "--model gpt: --image-size 8 does not apply (it is for unet)" in capsys.readouterr().err


def test_the_overlaps_asked_for_reach_every_model_and_a_pipeline_reports_what_ran(capsys):
    """The layer overlaps (OAR, ORS, OAG) reach the U-Net and the Hugging Face models as they reach par4d's
    GPT (tests/test_overlap_models.py proves them bitwise): what is asked is what the model gets, silently."""
    from par4d.grid import Grid
    from par4d.train.recipes import build_model

    for args in (UNET, ["--model", "hf-gpt2", *SMALL]):
        config = checked_config(*args, "--overlap", "oar,ors,dp", "--out", "unused", world=1)
        assert config.overlap_settings().names == ("oar", "ors", "dp") and capsys.readouterr().out == ""
        model = build_model(config, Grid.virtual({"x": 1, "y": 1, "z": 1, "data": 1, "pipe": 1}))
        assert par4d.state(model).overlap == config.overlap_settings() and par4d.state(model).runtime is not None
        assert config.overlap_run() == config.overlap_settings()
    # A pipeline's stages run outside the model's forward and the step's own backward: only OAR, xy and ep (inside a
    # layer's forward) act, and the run says so before it starts; what it reports is what ran.
    piped = checked_config(*SMALL, "--n-layer", "2", "--grid", "pipe=2", "--overlap", "all", "--out", "unused", world=2)
    assert piped.overlap_run().names == ("oar", "xy", "ep", "cp")
    assert piped.overlap_settings().names == ("oar", "ors", "oag", "dp", "xy", "ep", "cp")
    assert ("--grid pipe=2: --overlap ors,oag,dp do not act with a pipeline yet" in capsys.readouterr().out)
