"""``par4d bench gemm``: the gain of GEMM tuning per matmul shape and pass.

For each Linear layer of a workload (default: ``par4d bench grid``'s GPT on one
rank) and each pass (forward, input-gradient, weight-gradient), the median time of
every equivalent form (``par4d.nn.gemm.FORMS``) and the gain of the fastest over the
default form ``a @ b``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from par4d.launch.host import cpu_cores
from par4d.nn.gemm import FORMS, apply, distinct_forms


def _time(form: int, a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    apply(form, a, b)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply(form, a, b)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def gemm_rows(shapes: list[tuple[str, int, int, int]], repeats: int = 21) -> list[dict]:
    rows = []
    for name, m, k, n in shapes:
        x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        for pass_name, a, b in (("forward", x, w.t()), ("input-grad", g, w), ("weight-grad", g.t(), x)):
            forms = distinct_forms(a, b)
            seconds = [_time(form, a, b, repeats) if form in forms else float("inf") for form in range(len(FORMS))]
            best = min(range(len(FORMS)), key=lambda i: seconds[i])
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            rows.append({"layer": name, "pass": pass_name, "m": a.shape[0], "k": a.shape[1], "n": b.shape[1],
                         "default_s": seconds[0], "best_form": FORMS[best], "best_s": seconds[best],
                         "gain": seconds[0] / seconds[best], "default_gflops": flops / seconds[0] / 1e9})
    return rows


def run_bench_gemm(args: argparse.Namespace) -> int:
    from par4d.measure.validate import SPEC  # the bench GPT as the planner sees it

    torch.set_num_threads(cpu_cores())
    rows = gemm_rows([(layer.name, layer.m, layer.k, layer.n) for layer in SPEC.layers()])
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print("| layer | pass | m x k x n | default s | default GFLOP/s | best form | gain |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: |")
    for r in rows:
        print(f"| {r['layer']} | {r['pass']} | {r['m']}x{r['k']}x{r['n']} | {r['default_s'] * 1e3:.3f} ms | "
              f"{r['default_gflops']:.1f} | {r['best_form']} | {r['gain']:.2f}x |")
    return 0
