"""``par4d plan device``: the planner's compute model checked, term by term, on this machine's device.

What a machine profile predicts for one device (par4d/plan/compute.py) beside what the device measures:
every GEMM of a grid of shapes, causal attention forward and backward, the memory bandwidth; then
one-rank training steps of a GPT, where the full model's step time and memory are set beside par4d's
measured step (mixed precision, as ``par4d train --precision bf16`` runs it) and beside plain PyTorch's on
the same model, batch and precision (autocast, fused AdamW), which is what a one-device user runs instead.
The GEMMs are also fitted (:func:`par4d.measure.calibrate.fit_gemms`) at the profile's peak: what a profile
calibrated on this device would carry. On a GPU it runs in bf16 at GPU sizes; on a CPU in fp32 at the sizes
``par4d calibrate`` times, with every core.

On one device there is no communication: this checks compute and memory, which every grid's prediction
is built on, with AdamW's pass over the states (:func:`par4d.plan.compute.optimizer_seconds`), and, offloaded,
its masters' and moments' copies over the host link, whose bandwidth each way it measures too (pinned copies of
one offload bucket).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par4d.measure.calibrate import (
    GPU_SHAPES,
    ComputeShapes,
    finish,
    fit_attention,
    fit_gemms,
    measure_compute,
    measure_host_link,
)
from par4d.measure.grids import compile_seconds
from par4d.models import GPTConfig
from par4d.plan.compute import gemm_seconds
from par4d.plan.machines import BUILTIN, Machine
from par4d.plan.workload import GPTSpec

ONE = dict(x=1, y=1, z=1, data=1)


@dataclass(frozen=True)
class StepCase:
    """A GPT and a batch (sequences of ``config.block_size`` tokens) timed for one training step."""
    name: str
    config: GPTConfig
    batch: int


# GPT-2 medium's shape (0.41B parameters with untied embeddings) at a 16K-token batch, and a wider, shallower
# model (0.81B) with 2K-token sequences.
GPU_STEPS = (StepCase("gpt-24x1024", GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16,
                                            n_embd=1024), batch=16),
             StepCase("gpt-12x2048", GPTConfig(vocab_size=50304, block_size=2048, n_layer=12, n_head=16,
                                            n_embd=2048), batch=8))
CPU_STEPS = (StepCase("gpt-4x128", GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
                      batch=8),)


def builtin_for(device: torch.device) -> Machine | None:
    """The built-in machine whose devices are ``device``, by its CUDA name and memory; None for any other (a
    PCIe or NVL card, a GH200, another size: their peaks, bandwidths or memory differ from the built-ins')."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    name, memory = props.name, props.total_memory
    if any(form in name for form in ("PCIe", "PCIE", "NVL", "GH200")):
        return None
    if "H200" in name and memory > 135e9:
        return BUILTIN["h200"]
    if "H100" in name and 78e9 < memory < 90e9:
        return BUILTIN["h100"]
    if "A100" in name and "SXM" in name:
        return BUILTIN["a100-80gb" if memory > 50e9 else "perlmutter"]
    if "MI250X" in name:
        return BUILTIN["frontier"]
    return None


def gemm_rows(measured: list[dict], machine: Machine) -> list[dict]:
    """Each measured GEMM with the seconds ``machine`` predicts for it and the ratio predicted / measured."""
    rows = []
    for r in measured:
        predicted = gemm_seconds(r["m"], r["n"], r["k"], machine)
        rows.append(dict(r, predicted=predicted, ratio=predicted / r["seconds"],
                         tflops=2 * r["m"] * r["n"] * r["k"] / r["seconds"] / 1e12))
    return rows


def attention_rows(measured: list[dict], machine: Machine) -> list[dict]:
    """Each measured attention with the seconds ``machine`` predicts (its FLOPs at ``attention_efficiency``)."""
    efficiency = machine.attention_efficiency or machine.efficiency
    return [dict(r, predicted=r["flops"] / (machine.peak_flops * efficiency),
                 ratio=r["flops"] / (machine.peak_flops * efficiency) / r["seconds"],
                 efficiency=r["flops"] / r["seconds"] / machine.peak_flops) for r in measured]


def _timed(step, device: torch.device, iters: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        step()
    finish(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        finish(device)
        times.append(time.perf_counter() - start)
    return times


def _batch(case: StepCase, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, case.config.vocab_size, (case.batch, case.config.block_size + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _compiled(model: torch.nn.Module, compile: str, step, device: torch.device) -> float | None:
    """With ``compile`` a backend: ``model``'s blocks compiled (par4d.compiled) and ``step`` called once, its
    seconds returned (the compiling step, to set beside a later one); None for none."""
    from par4d.compiled import compile_afresh

    if compile_afresh(model, compile) is None:
        return None
    start = time.perf_counter()
    step()
    finish(device)
    return time.perf_counter() - start


def _par4d_step(case: StepCase, device: torch.device, dtype: torch.dtype, iters: int,
                offload_bsize: int | None = None, compile: str = "none") -> dict:
    """par4d's GPT on a one-rank grid, as ``par4d train`` steps it (mixed precision below fp32; with
    ``offload_bsize``, its masters and AdamW state in CPU memory, stepped that many elements at a time; with
    ``compile`` a backend, its blocks compiled as ``--compile`` compiles them)."""
    from par4d.launch import init
    from par4d.models import GPT
    from par4d.optim.precision import FullPrecision, MixedPrecision, fused_adamw
    from par4d.train.footprint import measure_footprint
    from par4d.train.step import train_step

    fresh = not dist.is_initialized()
    grid = init()
    try:
        if grid.device.type != device.type:
            raise ValueError(f"plan device: the rank's device is {grid.device}, the check's {device}")
        model = GPT(case.config, grid=grid)

        def adamw(params):       # as par4d train's
            return torch.optim.AdamW(params, lr=1e-4, fused=fused_adamw(device, offload_bsize is not None))

        precision = (MixedPrecision(model, grid, dtype, adamw, offload_bsize=offload_bsize)
                     if dtype != torch.float32 or offload_bsize
                     else FullPrecision(model, grid, adamw(model.parameters())))
        x, y = _batch(case, grid.device)

        def step():
            return train_step(model, precision, grid, (x, y))

        first = _compiled(model, compile, step, grid.device)
        times = _timed(step, grid.device, iters)
        held = measure_footprint(model, precision, step).row()
        return {"s_per_iter": statistics.median(times), "held_bytes": held["total"],
                "device_peak": held["device_peak"], "compile_s": compile_seconds(first, times)}
    finally:
        grid.close()
        if fresh:          # the one-rank job this step started
            dist.destroy_process_group()


def _torch_step(case: StepCase, device: torch.device, dtype: torch.dtype, iters: int, compile: str = "none") -> dict:
    """The same GPT in plain PyTorch (par4d's single-process reference model): fp32 parameters, autocast to
    ``dtype`` below fp32, AdamW fused on a GPU; with ``compile`` a backend, its blocks compiled as par4d's."""
    from par4d.models.reference import ReferenceGPT
    from par4d.optim.precision import fused_adamw

    model = ReferenceGPT(case.config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw(device))
    x, y = _batch(case, device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = _compiled(model, compile, step, device)
    times = _timed(step, device, iters)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"s_per_iter": statistics.median(times), "device_peak": peak, "compile_s": compile_seconds(first, times)}


# The offloaded optimizer's bucket (``par4d train --offload-optimizer``'s default).
OFFLOAD_BSIZE = 1 << 22


def step_rows(case: StepCase, machine: Machine, device: torch.device, dtype: torch.dtype, iters: int,
              compile: str = "none") -> list[dict]:
    """par4d's measured step of ``case`` (its optimizer on the device, then offloaded) and PyTorch's, beside the
    full model's prediction (compute and memory on one device), each with its model FLOPs as a share of the
    machine's peak; with ``compile`` a backend, both again with their blocks compiled; rows as ``par4d bench``
    writes them."""
    from par4d.plan.cost import predict

    spec = GPTSpec.from_config(case.name, case.config, case.batch)
    flops = spec.flops_per_iteration(checkpointing=False)
    rows = []
    for name, offload in ((f"{case.name} one rank", None),
                          (f"{case.name} one rank, optimizer offloaded (bsize {OFFLOAD_BSIZE:,})", OFFLOAD_BSIZE)):
        prediction = predict(spec, ONE, machine, "full", microbatches=1, offload_bsize=offload)
        measured = _par4d_step(case, device, dtype, iters, offload)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({"model": case.name, "framework": "par4d", "name": name, "tokens": spec.tokens,
                     "predicted_s": prediction.ranking_time("full"), "predicted_bytes": prediction.mem_bytes,
                     **measured, "peak_share": flops / measured["s_per_iter"] / machine.peak_flops})
    peer = _torch_step(case, device, dtype, iters)
    rows.append(dict(rows[0], framework="torch", name=f"{case.name} plain PyTorch (autocast, fused AdamW)",
                     held_bytes=None, **peer, peak_share=flops / peer["s_per_iter"] / machine.peak_flops))
    rows[0]["par4d_over_torch"] = rows[0]["s_per_iter"] / peer["s_per_iter"]
    if compile != "none":       # the same two, each block compiled (par4d.compiled)
        mine = _par4d_step(case, device, dtype, iters, None, compile)
        peer = _torch_step(case, device, dtype, iters, compile)
        rows.append(dict(rows[0], name=f"{case.name} one rank, compiled ({compile})", **mine,
                         peak_share=flops / mine["s_per_iter"] / machine.peak_flops,
                         par4d_over_torch=mine["s_per_iter"] / peer["s_per_iter"]))
        rows.append(dict(rows[2], name=f"{case.name} plain PyTorch, compiled ({compile})", **peer,
                         peak_share=flops / peer["s_per_iter"] / machine.peak_flops))
    return rows


def check_device(machine: Machine, device: torch.device, threads: int, iters: int = 5,
                 shapes: ComputeShapes | None = None, steps: tuple[StepCase, ...] | None = None,
                 compile: str = "none") -> dict:
    """Every measurement of the module docstring on ``device`` (bf16 on a GPU, fp32 on a CPU) against
    ``machine``. ``shapes`` and ``steps`` default to the device's (GPU or CPU) sizes; ``compile``: a backend
    that also times the steps with their blocks compiled (par4d.compiled), par4d's and plain PyTorch's."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    if machine.bytes_per_element != dtype.itemsize:
        raise ValueError(f"machine {machine.name!r} trains in {machine.bytes_per_element}-byte elements; this "
                         f"check runs in {dtype} ({dtype.itemsize} bytes): give a profile of this precision")
    shapes = shapes or (GPU_SHAPES if gpu else ComputeShapes())
    steps = steps if steps is not None else (GPU_STEPS if gpu else CPU_STEPS)
    measured = measure_compute(threads, device, dtype, shapes)
    fitted = fit_gemms(measured["gemms"], machine.peak_flops, measured["memory_bandwidth"], dtype.itemsize)
    attention = attention_rows(measured["attention"], machine)
    fitted["attention_efficiency"] = fit_attention(measured["attention"], machine.peak_flops)
    link = measure_host_link(device, OFFLOAD_BSIZE)
    fitted["host_bandwidth"] = link["host_bandwidth"]
    return {"machine": machine.name, "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "memory_bandwidth": measured["memory_bandwidth"],
            "host_link": link, "machine_host_bandwidth": machine.host_bandwidth,
            "gemms": gemm_rows(measured["gemms"], machine), "attention": attention, "fitted": fitted,
            "steps": [row for case in steps for row in step_rows(case, machine, device, dtype, iters, compile)]}


def _spread(ratios: list[float]) -> str:
    return f"median {statistics.median(ratios):.2f}, {min(ratios):.2f} to {max(ratios):.2f}"


def _measured(title: str, shape: tuple[str, ...], rate: tuple[str, str, str], rows: list[dict]) -> list[str]:
    """A term's rows as a Markdown table: the ``shape`` columns, measured ms, the ``rate`` column (heading, key,
    format), predicted ms and the ratio, under a line with the ratios' spread."""
    heading, key, form = rate
    names = {"heads": "batch x heads", "seq": "sequence", "width": "head width"}
    out = [f"{title}: predicted / measured {_spread([r['ratio'] for r in rows])}", "",
           "| " + " | ".join(names.get(c, c) for c in shape) + f" | measured ms | {heading} | predicted ms | "
           "predicted / measured |", "|" + " ---: |" * (len(shape) + 4)]
    out += ["| " + " | ".join(str(r[c]) for c in shape) + f" | {r['seconds'] * 1e3:.4f} | {r[key]:{form}} | "
            f"{r['predicted'] * 1e3:.4f} | {r['ratio']:.2f} |" for r in rows]
    return out + [""]


def report(result: dict) -> str:
    """:func:`check_device`'s result as Markdown: each term's measured value beside the machine's prediction
    (ratios predicted / measured: 1.00 is exact, above 1 the model is pessimistic)."""
    gemms, attention, fitted = result["gemms"], result["attention"], result["fitted"]
    link, profile = result["host_link"], result["machine_host_bandwidth"]
    out = [f"# {result['device']} ({result['dtype']}) against the machine profile '{result['machine']}'", "",
           f"memory bandwidth: {result['memory_bandwidth'] / 1e9:,.0f} GB/s measured (an element-wise sum)", "",
           f"host link ({link['bytes'] / 2**20:.0f} MiB copies): {link['to_device'] / 1e9:.1f} GB/s to the device, "
           f"{link['to_host'] / 1e9:.1f} GB/s back, {link['host_bandwidth'] / 1e9:.1f} GB/s a step moving both "
           f"(the profile's: {'not given' if profile is None else f'{profile / 1e9:.1f} GB/s'})", ""]
    out += _measured(f"GEMMs, {len(gemms)} shapes", ("m", "n", "k"), ("TFLOP/s", "tflops", ".1f"), gemms)
    out += _measured("Causal attention, forward and backward", ("heads", "seq", "width"),
                     ("of peak", "efficiency", ".2f"), attention)
    out += [f"Fitted to these measurements at the profile's peak: GEMM efficiency {fitted['efficiency']:.2f}, "
                f"{fitted['kernel_latency'] * 1e6:.1f} us per GEMM (median error {fitted['median_error']:.0%}), "
                f"attention {fitted['attention_efficiency']:.2f} of peak", "",
            "| run | framework | tokens | s/step | predicted s | predicted / measured | model FLOPs of peak | "
            "held GB | device peak GB | predicted GB | par4d / torch | compiling s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["steps"]:
        held = f"{r['held_bytes'] / 1e9:.2f}" if r.get("held_bytes") else "-"
        peak = f"{r['device_peak'] / 1e9:.2f}" if r.get("device_peak") else "-"
        ratio = f"{r['par4d_over_torch']:.2f}" if "par4d_over_torch" in r else ""
        out.append(f"| {r['name']} | {r['framework']} | {r['tokens']:,} | {r['s_per_iter']:.4f} | "
                   f"{r['predicted_s']:.4f} | {r['predicted_s'] / r['s_per_iter']:.2f} | {r['peak_share']:.1%} | "
                   f"{held} | {peak} | {r['predicted_bytes'] / 1e9:.2f} | {ratio} | "
                   f"{'' if r.get('compile_s') is None else format(r['compile_s'], '.1f')} |")
    out += ["", "predicted s: compute and AdamW's pass on the device (one device communicates nothing), and offloaded "
                "its states' copies over the profile's host link; "
                "held: par4d's footprint of a step (par4d/train/footprint.py); device peak: the allocator's "
                "(torch.cuda.max_memory_allocated); predicted: the full model's, one rank; compiling s: the first "
                "compiled step's seconds beyond a later one's"]
    return "\n".join(out)
