"""``par4d phantom compare``: phantom vs tensor parallelism on the paper's synthetic task.

A benchmark against the peer a user would pick instead (tensor parallelism), so it
lives with the benchmarks, on top of the training step it shares with every other
caller, not in :mod:`par4d.phantom` (the layers it compares).

For each rank count p and ghost count k (and the TP baseline), train a depth-L FFN
of width n on ``y = σ(W σ(x))`` and measure per-iteration time, communication time
and bytes (ledger), parameter memory per rank, and, with a target loss, iterations,
time and energy to reach it. Energy: measured where a power sensor exists (the
monitor integrates the training phase only), otherwise the model ``e = A α + B β``
(losses are measured on a fixed held-out batch of 256 samples after every step)
with this machine's CPU estimate, labelled as such. The run's own collective
timings are fitted to ``c1 log2 p + c2 m + c3``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

CPU_PROFILE = "cpu-core-estimate"
EVAL_BATCH = 256


@dataclass(frozen=True)
class CompareSettings:
    n: int
    depth: int
    p: int
    ks: tuple[int, ...]
    batch: int = 32
    lr: float = 1e-3
    max_iters: int = 200
    iters: int = 20
    target_loss: float | None = None
    seed: int = 0


def _global_loss(local_sum: torch.Tensor, grid, sharded: bool, denominator: float) -> float:
    from par4d import comm

    value = local_sum.detach().clone().reshape(1)
    if sharded:
        comm.all_reduce(grid, value, "x")
    return value.item() / denominator


def _run_scheme(settings: CompareSettings, grid, scheme: str, k: int | None) -> tuple[dict, list]:
    from par4d.layout import placement_of, shard_features
    from par4d.phantom import PhantomFFN, TensorParallelFFN
    from par4d.phantom.data import SyntheticTeacher
    from par4d.phantom.energy import PROFILES, EnergyMonitor
    from par4d.train.step import train_step

    n, p = settings.n, settings.p
    if scheme == "tp":
        model = TensorParallelFFN(n, settings.depth, grid=grid, seed=settings.seed)
        sharded = model.output_sharded
    else:
        model = PhantomFFN(n, settings.depth, k, grid=grid, seed=settings.seed)
        sharded = True
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    teacher = SyntheticTeacher(n, settings.seed)
    limit = settings.max_iters if settings.target_loss is not None else settings.iters
    # A fixed held-out batch decides "reached the target" (one training batch's loss is too noisy).
    eval_x, eval_y = teacher.batch(-1, EVAL_BATCH)
    eval_y = eval_y / n**0.5
    eval_inp = eval_x if scheme == "tp" else shard_features(grid, eval_x, "x")
    eval_target = shard_features(grid, eval_y, "x") if sharded else eval_y

    def mse(inp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This rank's part of the mean squared error over the global batch."""
        return ((model(inp) - target) ** 2).sum() / (settings.batch * n)

    def evaluate() -> float:
        with torch.no_grad():
            return _global_loss(((model(eval_inp) - eval_target) ** 2).sum(), grid, sharded, EVAL_BATCH * n)

    times, comm_s, comm_b, losses, entries = [], [], [], [], []
    evaluate_before = evaluate()
    monitor = EnergyMonitor().start()
    reached = None
    for step in range(limit):
        x, y = teacher.batch(step, settings.batch)
        y = y / n**0.5                                         # targets O(1): y = σ(W σ(x)) / sqrt(n)
        inp = x if scheme == "tp" else shard_features(grid, x, "x")
        target = shard_features(grid, y, "x") if sharded else y
        dist.barrier()
        start, waited, sent = time.perf_counter(), grid.ledger.total_seconds(), grid.ledger.total_bytes()
        with grid.ledger.capture() as captured:
            train_step(model, opt, grid, (inp, target), loss=mse)
        times.append(time.perf_counter() - start)
        comm_s.append(grid.ledger.total_seconds() - waited)
        comm_b.append(grid.ledger.total_bytes() - sent)
        entries += [(e.kind, grid.size(*e.axes), e.bytes, e.seconds) for e in captured]
        losses.append(evaluate())
        if settings.target_loss is not None and losses[-1] <= settings.target_loss:
            reached = step + 1
            break
    measured_j = monitor.stop()
    # Each parameter once: a tensor replicated over x (a transposed layer's bias) counts 1/p per rank.
    params = torch.tensor([sum(t.numel() / (1 if "x" in placement_of(t).sharded else p) for t in model.parameters())],
                          dtype=torch.float64)
    dist.all_reduce(params, group=grid.group("x"))
    mem = torch.tensor([4.0 * sum(t.numel() * t.element_size() for t in model.parameters())])  # param, grad, m, v
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    busy = torch.tensor([sum(t - c for t, c in zip(times, comm_s)), sum(comm_s)], dtype=torch.float64)
    dist.all_reduce(busy)                                   # summed over the p devices
    profile = PROFILES[CPU_PROFILE]
    steady = times[2:] if len(times) > 4 else times
    run_iters = len(times)
    row = {"scheme": scheme, "p": p, "k": k, "params": round(params.item()), "s_per_iter": statistics.median(steady),
           "comm_s_per_iter": statistics.median(comm_s[2:] if len(comm_s) > 4 else comm_s),
           "comm_bytes_per_iter": int(statistics.median(comm_b)), "mem_bytes": int(mem.item()),
           "iters_run": run_iters, "iters_to_target": reached, "time_to_target": sum(times) if reached else None,
           "final_loss": losses[-1], "first_loss": evaluate_before, "loss_curve": [evaluate_before, *losses],
           "energy_j": profile.energy(busy[0].item(), busy[1].item()),
           "energy_source": f"model estimate ({profile.name}: A={profile.busy_watts} W, B={profile.idle_watts} W)"}
    if measured_j is not None:
        row["energy_j"], row["energy_source"] = measured_j, f"measured ({monitor.source}, the whole node)"
    if not reached and settings.target_loss is not None:
        row["energy_j"] = None          # no energy "to target" when the target was not reached
    return row, entries


def compare_worker(settings: CompareSettings) -> dict:
    from par4d.launch import init
    from par4d.launch.host import threads_per_rank

    torch.set_num_threads(threads_per_rank(settings.p))
    grid = init(x=settings.p)
    rows, entries = [], []
    for scheme, k in [("tp", None)] + [("phantom", k) for k in settings.ks]:
        row, seen = _run_scheme(settings, grid, scheme, k)
        rows.append(row)
        entries += seen
    dist.destroy_process_group()
    return {"rows": rows, "entries": entries}


def fit_collectives(entries: list[tuple]) -> dict:
    from par4d.measure.calibrate import fit

    rows = [{"kind": kind, "p": p, "bytes": b, "seconds": s} for kind, p, b, s in entries if p > 1]
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        try:
            fitted = fit(mine)[kind]
        except ValueError as exc:   # e.g. one message size only: nothing to fit the slope to
            out[kind] = {"skipped": str(exc).split(";")[0]}
            continue
        if "c1" in fitted:
            out[kind] = {key: fitted[key] for key in ("c1", "c2", "c3", "points")}
    return out


def run_compare(n: int, depth: int, nprocs: list[int], ks: list[int], *, batch: int, lr: float, iters: int,
                max_iters: int, target_loss: float | None, seed: int) -> tuple[list[dict], dict]:
    from par4d.launch import launch_local

    for p in nprocs:
        if p < 1:
            raise ValueError(f"--nproc {p}: every rank count must be >= 1")
        if n % p:
            raise ValueError(f"--nproc {p}: the width n={n} must be divisible by every rank count")
    rows, entries = [], []
    for p in nprocs:
        settings = CompareSettings(n, depth, p, tuple(ks), batch, lr, max_iters, iters, target_loss, seed)
        result = launch_local(p, compare_worker, (settings,), run_id=f"par4d-phantom-{p}")[0]
        rows += result["rows"]
        entries += result["entries"]
    return rows, fit_collectives(entries)


def write_report(rows: list[dict], fits: dict, command: str, path: Path) -> None:
    """docs/phantom.md: tables, and figures in the shape of the paper's Fig. 5-7."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = path.parent / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    ps = sorted({r["p"] for r in rows})
    schemes = [("tp", None)] + sorted({("phantom", r["k"]) for r in rows if r["scheme"] == "phantom"},
                                      key=lambda s: s[1])

    def series(key, scheme):
        return [next((r[key] for r in rows if r["p"] == p and (r["scheme"], r["k"]) == scheme), None) for p in ps]

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    panels = [("comm_bytes_per_iter", "communication bytes / iteration (per rank)"),
              ("s_per_iter", "seconds / iteration"),
              ("energy_j", "energy (J): to target if given, else for the run")]
    for ax, (key, label) in zip(axes, panels):
        for scheme in schemes:
            values = series(key, scheme)
            name = "TP" if scheme[0] == "tp" else f"PP k={scheme[1]}"
            ax.plot(ps, [v if v is not None else float("nan") for v in values], marker="o", label=name)
        ax.set_xlabel("ranks p")
        ax.set_ylabel(label, fontsize=8)
        ax.set_xticks(ps)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    curves = axes[3]
    for r in rows:
        if r["p"] == ps[-1]:
            curves.plot(r["loss_curve"], lw=1, label="TP" if r["scheme"] == "tp" else f"PP k={r['k']}")
    curves.set_xlabel("iteration")
    curves.set_ylabel(f"held-out MSE (p={ps[-1]})", fontsize=8)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    fig.tight_layout()
    figure = figures / f"{path.stem}.png"
    fig.savefig(figure, dpi=110)
    plt.close(fig)

    lines = ["# Phantom parallelism vs tensor parallelism", "",
             f"Measured with `{command}` on this machine (2 CPU cores, gloo, fp32). Each rank count p is one job;",
             "within it the TP baseline and each k train side by side on the same data. Compare ratios within",
             "a p, not absolute numbers: all p ranks share the same 2 cores.", "",
             "| scheme | p | k | params | s/iter | comm s/iter | comm bytes/iter (rank) | param memory/rank "
             "| iters to target | time to target (s) | energy (J) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        def fmt(v, spec):
            return "—" if v is None else format(v, spec)

        lines.append(f"| {'TP' if r['scheme'] == 'tp' else 'PP'} | {r['p']} | {fmt(r['k'], 'd')} | "
                     f"{r['params'] / 1e6:.2f}M | {r['s_per_iter']:.4f} | {r['comm_s_per_iter']:.4f} | "
                     f"{r['comm_bytes_per_iter']:,} | {r['mem_bytes'] / 1e6:.1f} MB | "
                     f"{fmt(r['iters_to_target'], 'd')} | "
                     f"{fmt(r['time_to_target'], '.2f')} | {fmt(r['energy_j'], '.1f')} |")
    sources = sorted({r["energy_source"] for r in rows})
    lines += ["", f"Energy: {'; '.join(sources)}.", "", f"![phantom vs TP](figures/{figure.name})", ""]
    if fits:
        lines += ["Collective times of this run fitted to `t(m, p) = c1 log2 p + c2 m + c3` (m in bytes):", "",
                  "| collective | c1 (ms) | c2 (s/GB) | c3 (ms) | points |", "| --- | ---: | ---: | ---: | ---: |"]
        for kind, f in fits.items():
            if "skipped" in f:
                lines.append(f"| {kind} | not fitted: {f['skipped']} | | | |")
                continue
            lines.append(f"| {kind} | {f['c1'] * 1e3:.3f} | {f['c2'] * 1e9:.3f} | {f['c3'] * 1e3:.3f} | "
                         f"{f['points']} |")
    path.write_text("\n".join(lines) + "\n")


def main(args) -> int:
    nprocs = [int(v) for v in str(args.nproc).split(",") if v]
    ks = [int(v) for v in str(args.k).split(",") if v]
    if not nprocs or not ks or min(ks) < 1:
        raise ValueError(f"--nproc and --k need comma-separated positive integers (got {args.nproc!r}, {args.k!r})")
    rows, fits = run_compare(args.n, args.depth, nprocs, ks, batch=args.batch, lr=args.lr, iters=args.iters,
                             max_iters=args.max_iters, target_loss=args.target_loss, seed=args.seed)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    if args.report:
        import shlex
        import sys

        write_report(rows, fits, "par4d " + " ".join(shlex.quote(a) for a in sys.argv[1:]), Path(args.report))
        if not args.json:
            print(f"report written to {args.report}")
    if not args.json:
        for r in rows:
            print(f"{r['scheme']:>7} p={r['p']} k={r['k']}: {r['params']:,} params, {r['s_per_iter']:.4f} s/iter, "
                  f"comm {r['comm_bytes_per_iter']:,} B/iter, loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}, "
                  f"iters to target {r['iters_to_target']}")
    return 0
