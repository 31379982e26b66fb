"""What only a GPU can show; skipped without one (``pytest -m cuda`` selects these). Each runs
``par4d train`` in its own process with the GPUs visible (the rest of the suite hides them:
tests/devices.py) against the same run on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.devices import gpu_env

pytestmark = pytest.mark.cuda

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "16", "--steps", "6",
         "--no-progress"]


def _train(out: Path, *args: str, gpu: bool) -> dict:
    env = gpu_env(OMP_NUM_THREADS="1") if gpu else None      # None: this process's, GPUs hidden
    result = subprocess.run([sys.executable, "-m", "par4d.cli", "train", *SMALL, "--out", str(out), *args],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["losses"] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary


def test_one_gpu_follows_the_cpu(tmp_path):
    """One rank on the GPU (NCCL) against one on the CPU (gloo): the same losses to fp32 rounding
    (cuBLAS sums in another order; TF32 is off for fp32 matmuls unless asked for)."""
    cpu = _train(tmp_path / "cpu", "--nproc", "1", gpu=False)
    gpu = _train(tmp_path / "gpu", "--nproc", "1", gpu=True)
    assert (cpu["device"], cpu["backend"], gpu["device"], gpu["backend"]) == ("cpu", "gloo", "cuda", "nccl")
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-4)


@pytest.mark.cuda(gpus=2)
def test_two_gpus_on_x_follow_one_cpu_rank(tmp_path):
    cpu = _train(tmp_path / "cpu", "--nproc", "1", gpu=False)
    gpu = _train(tmp_path / "gpu", "--nproc", "2", "--grid", "x=2", gpu=True)
    assert (gpu["device"], gpu["backend"], gpu["world_size"]) == ("cuda", "nccl", 2)
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-4)


def test_bf16_with_the_offloaded_optimizer_trains_on_the_gpu(tmp_path):
    """bf16 compute, fp32 masters and AdamW state in CPU memory stepped in buckets of 1,000: the
    loss falls as the fp32 run's does, within bf16's rounding of it."""
    cpu = _train(tmp_path / "cpu", "--nproc", "1", gpu=False)
    half = _train(tmp_path / "bf16", "--nproc", "1", "--precision", "bf16", "--offload-optimizer", "1000", gpu=True)
    assert half["device"] == "cuda" and "offloaded" in half["optimizer"]
    assert half["losses"] == pytest.approx(cpu["losses"], rel=2e-2) and half["final_loss"] < half["initial_loss"]


def test_a_gpu_run_resumes_with_the_fused_optimizer(tmp_path):
    """On a GPU AdamW is fused, and keeps its step count on the device: a run stopped after 3 steps and resumed
    to 6 follows the straight 6-step run (the checkpoint's state is loaded into device tensors)."""
    straight = _train(tmp_path / "straight", "--nproc", "1", gpu=True)
    _train(tmp_path / "split", "--nproc", "1", "--steps", "3", "--save-every", "3", gpu=True)
    result = subprocess.run([sys.executable, "-m", "par4d.cli", "train", "--resume", str(tmp_path / "split"),
                             "--steps", "6", "--no-progress"], capture_output=True, text=True, timeout=600,
                            env=gpu_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert straight["device"] == "cuda" and len(losses) == 6
    assert losses == pytest.approx(straight["losses"], rel=1e-5)
