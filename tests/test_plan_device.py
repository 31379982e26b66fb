"""``par4d plan device``: each measured term beside the machine's prediction for it, computed as the planner
computes it, and one-rank steps of par4d (on-device and offloaded optimizer) and of plain PyTorch whose memory the
planner predicts. Run here on the CPU in fp32; on a GPU (docs/planner.md, "On a GPU") in bf16."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from par4d.launch.peak import job_peak
from par4d.measure.calibrate import ComputeShapes
from par4d.measure.device import (
    OFFLOAD_BSIZE,
    ONE,
    StepCase,
    attention_rows,
    builtin_for,
    check_device,
    gemm_rows,
    report,
)
from par4d.models import GPTConfig
from par4d.plan.compute import gemm_seconds, optimizer_seconds, stage_seconds
from par4d.plan.machines import BUILTIN, Machine
from par4d.plan.workload import GPTSpec
from tests.conftest import pool

CPU = Machine("cpu-test", devices_per_node=1, peak_flops=50e9, memory_bytes=8e9, beta_intra=1e9, beta_inter=1e9,
              efficiency=0.9, kernel_latency=5e-6, bytes_per_element=4, memory_bandwidth=10e9,
              attention_efficiency=0.5, host_bandwidth=5e9)
TINY = ComputeShapes(rows=(16, 64), sides=(32, 64), attention=((4, 64, 16),), elements=1 << 16)
STEP = StepCase("gpt-2x64", GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64), batch=4)


def test_gemms_are_predicted_by_the_roofline_and_attention_at_its_efficiency():
    measured = [{"m": 512, "n": 1024, "k": 4096, "seconds": 2e-5}, {"m": 16, "n": 32, "k": 32, "seconds": 1e-5}]
    h200 = BUILTIN["h200"]
    for row, given in zip(gemm_rows(measured, h200), measured):
        assert row["predicted"] == gemm_seconds(given["m"], given["n"], given["k"], h200)
        assert row["ratio"] == row["predicted"] / given["seconds"]
        assert row["tflops"] == pytest.approx(2 * given["m"] * given["n"] * given["k"] / given["seconds"] / 1e12)
    # 512 x 4096 x 1024 at 0.75 of 989 TFLOP/s: 5.79 us of FLOPs beats 13.6 MB / 4,349 GB/s = 3.13 us; + 6.2 us
    assert gemm_rows(measured, h200)[0]["predicted"] == pytest.approx(2 * 512 * 1024 * 4096 / (989e12 * 0.75) + 6.2e-6)
    (row,) = attention_rows([{"flops": 1e12, "seconds": 4e-3}], h200)
    assert row["predicted"] == pytest.approx(1e12 / (989e12 * 0.52)) and row["efficiency"] == pytest.approx(1 / 3.956)


def test_a_gpu_is_matched_to_its_built_in_machine(monkeypatch):
    def props(name, memory):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
            name=name, total_memory=memory))

    cuda = torch.device("cuda", 0)
    for name, memory, machine in (("NVIDIA H200", 150e9, "h200"), ("NVIDIA H100 80GB HBM3", 85e9, "h100"),
                                  ("NVIDIA A100-SXM4-80GB", 85e9, "a100-80gb"), ("NVIDIA A100-SXM4-40GB", 42e9,
                                                                                  "perlmutter")):
        props(name, memory)
        assert builtin_for(cuda) is BUILTIN[machine]
    for name, memory in (("NVIDIA GeForce RTX 4090", 25e9), ("NVIDIA H100 PCIe", 85e9), ("NVIDIA H100 NVL", 100e9),
                         ("NVIDIA GH200 480GB", 102e9), ("NVIDIA A100-PCIE-40GB", 42e9), ("NVIDIA H200", 100e9)):
        props(name, memory)          # another form or size than the built-ins': no built-in describes it
        assert builtin_for(cuda) is None, name
    assert builtin_for(torch.device("cpu")) is None


def test_a_profile_of_another_precision_is_refused_before_measuring():
    with pytest.raises(ValueError, match="machine 'h200' trains in 2-byte elements.*float32"):
        check_device(BUILTIN["h200"], torch.device("cpu"), threads=1)


def _check_on_the_cpu():
    return check_device(CPU, torch.device("cpu"), threads=1, iters=2, shapes=TINY, steps=(STEP,), compile="aot_eager")


def test_the_cpu_check_measures_every_term_and_the_planner_predicts_the_steps_memory():
    (result,) = pool(1).run(_check_on_the_cpu, timeout=300)
    assert (result["machine"], result["device"], result["dtype"]) == ("cpu-test", "cpu", "float32")
    assert [(r["m"], r["n"], r["k"]) for r in result["gemms"]] == [(m, n, k) for m in (16, 64) for n in (32, 64)
                                                                   for k in (32, 64)]
    assert all(r["seconds"] > 0 and r["ratio"] == r["predicted"] / r["seconds"] for r in result["gemms"])
    assert 0 < result["fitted"]["efficiency"] <= 1 and result["memory_bandwidth"] > 0
    spec = GPTSpec.from_config(STEP.name, STEP.config, STEP.batch)
    device, offloaded, peer, compiled, compiled_peer = result["steps"]
    assert [r["framework"] for r in result["steps"]] == ["par4d", "par4d", "torch", "par4d", "torch"]
    assert "offloaded" in offloaded["name"] and "PyTorch" in peer["name"]
    # Compiled (--compile aot_eager): each block of both models, the compiling step timed apart
    assert "compiled (aot_eager)" in compiled["name"] and "PyTorch, compiled" in compiled_peer["name"]
    assert compiled["par4d_over_torch"] == compiled["s_per_iter"] / compiled_peer["s_per_iter"]
    assert all(r["compile_s"] is None for r in (device, offloaded, peer))
    assert all(r["compile_s"] > 0 for r in (compiled, compiled_peer)) and compiled["held_bytes"] > 0
    # One device communicates nothing: the prediction is the compute model's and AdamW's pass, exactly; offloaded,
    # its copies over the profile's host link too.
    t_stage = stage_seconds(spec, ONE, CPU, checkpointing=False)
    assert device["predicted_s"] == t_stage + optimizer_seconds(spec, ONE, CPU)
    offloaded_optimizer = optimizer_seconds(spec, ONE, CPU, OFFLOAD_BSIZE)
    assert offloaded["predicted_s"] == t_stage + offloaded_optimizer > device["predicted_s"]
    link = result["host_link"]       # measured: copies of one bucket each way, and their harmonic mean
    assert link["bytes"] == 4 * OFFLOAD_BSIZE and link["to_device"] > 0 and link["to_host"] > 0
    assert link["host_bandwidth"] == pytest.approx(2 / (1 / link["to_device"] + 1 / link["to_host"]), rel=1e-12)
    assert result["fitted"]["host_bandwidth"] == link["host_bandwidth"]
    assert device["par4d_over_torch"] == device["s_per_iter"] / peer["s_per_iter"]
    # What a step holds, as the footprint counts it, is what the planner predicts: on the device, and with the
    # masters and AdamW state in CPU memory (the device keeps the fp32 parameters and gradients and one bucket).
    for row in (device, offloaded):
        assert row["predicted_bytes"] == pytest.approx(row["held_bytes"], rel=0.15), row
    assert offloaded["predicted_bytes"] - 2 * 4 * spec.params() == 16 * (1 << 22) + (
        device["predicted_bytes"] - spec.params() * (2 * 4 + 8))
    text = report(result)
    assert "| gpt-2x64 one rank | par4d |" in text and "GEMMs, 8 shapes" in text


def test_the_cpu_peak_is_every_cores_fp32_whatever_the_ranks():
    peak, what = job_peak(torch.device("cpu"), torch.float32, devices=4)
    assert what == "fp32, every core"
    assert 0.5 < job_peak(torch.device("cpu"), torch.float32, devices=1)[0] / peak < 2    # not times the ranks


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: plan device would check it")
def test_plan_device_without_a_gpu_says_so():
    result = subprocess.run([sys.executable, "-m", "par4d.cli", "plan", "device"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "plan device checks a GPU, and none is visible here" in result.stderr and "calibrate" in result.stderr
