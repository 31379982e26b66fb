"""What ``par4d train`` prints at the end of a run: rank 0's ``summary.json``, as a table."""

from __future__ import annotations


def _resumed(summary: dict) -> str:
    source = summary.get("resumed_from")
    if not source:
        return ""
    from par4d.grid import describe

    if summary.get("grid_changed"):
        return f"  (resumed from step {source['step']} saved on grid {describe(source['grid'])}: the grid changed)"
    return f"  (resumed from step {source['step']}, same grid)"


def _every(blocks: int) -> str:
    return f"every {blocks} blocks" if blocks else "none"


def buckets(config: dict) -> str:
    """", gradient buckets of N MB" where a run's ``--bucket-mb`` changed the sync's bucket size, else nothing (a
    run from before the flag has none): for its summary, and ``par4d inspect``."""
    from par4d.overlap import BUCKET_MB

    size = config.get("bucket_mb", BUCKET_MB)
    return "" if size == BUCKET_MB else f", gradient buckets of {size:g} MB"


def _communication(summary: dict) -> str:
    issued, exposed, step = (summary[k] for k in ("comm_issued_s_per_step", "comm_exposed_s_per_step", "s_per_step"))
    hidden = 100 * (1 - exposed / issued) if issued > 0 else 0.0
    share = 100 * exposed / step if step > 0 else 0.0
    staged = summary.get("staged")       # (a summary from before it was recorded has none)
    how = {"auto": "--hierarchical auto measured them faster", "on": "--hierarchical on"}
    return (f"in flight {issued * 1e3:.1f} ms, exposed (waited) {exposed * 1e3:.1f} ms per step on rank 0: "
            f"{hidden:.0f}% hidden, exposed = {share:.0f}% of the step"
            + (f"; staged across nodes over {' and '.join(staged)} ({how[summary['config']['hierarchical']]})"
               if staged else ""))


def _rate(flops: float) -> str:
    """FLOP/s in the unit that reads best: GFLOP/s on CPUs, TFLOP/s on GPUs."""
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.2f} GFLOP/s"


def _model_line(summary: dict) -> str:
    from par4d.train.recipes import RECIPES

    model = summary.get("model", "gpt")
    line = RECIPES[model].describe if isinstance(model, str) and model in RECIPES else str(model)
    config = summary.get("config", {})
    if config.get("mlp") == "moe":
        line += f", a mixture of {config.get('experts')} experts in every block (top {config.get('top_k')}"
        line += f"; {config['shared_experts']} shared)" if config.get("shared_experts") else ")"
    return line


def _memory(rss: list[dict]) -> str:
    peak = [r["peak_bytes"] / 2**20 for r in rss]
    files = max(r["file_bytes"] for r in rss) / 2**20
    return (f"peak resident {min(peak):,.0f}-{max(peak):,.0f} MiB per rank (of it file pages now: at most "
            f"{files:,.0f} MiB)")


def _float8(float8: dict, pipe: int) -> str:
    """What --float8 converted (par4d.nn.float8.float8_summary)."""
    where = " on rank 0's pipeline stage" if pipe > 1 else ""
    whole = ", each GEMM whole (one scale over all its rows: no xy row chunks)" if float8["whole_gemms"] else ""
    return f"{float8['recipe']} (torchao): the local GEMMs of {float8['layers']} Linear layers{where}{whole}"


def _compiled(made: dict) -> str:
    """What --compile made (par4d.compiled.Compiled.made), and what it cost on the first step."""
    again = f", {made['recompiled_graphs']} compiled again after the first step" if made["recompiled_graphs"] else ""
    if made.get("evaluation_graphs"):
        again += f", {made['evaluation_graphs']} for evaluation (without gradients)"
    graphs, breaks = made["graphs"], made["graph_breaks_per_block"]
    return (f"{made['blocks']} blocks by {made['backend']}: {graphs} graph{'s' * (graphs != 1)}, "
            f"{breaks:g} graph break{'s' * (breaks != 1)} per block{again}; the first step took "
            f"{made['first_step_extra_s']:.1f} s more than a later one (compiling)")


FOOTPRINT = ("parameters", "gradients", "optimizer", "activations", "buffers", "cached")


def _held(footprints: list[dict]) -> str:
    """What a step held (par4d.train.footprint, the first step), the rank that held the most."""
    most = max(footprints, key=lambda f: f["total"])
    parts = ", ".join(f"{name} {most[name] / 2**20:,.1f}" for name in FOOTPRINT if most.get(name))
    return (f"{most['total'] / 2**20:,.1f} MiB on the rank holding the most ({parts}; MiB; "
            f"activations: what autograd kept at once, measured on the first step)")


def print_summary(summary: dict) -> None:
    from par4d.grid import describe

    grid = describe(summary["grid"])
    text = summary["eq2_days_to_300b_tokens"] is not None    # a language model: the paper's Eq 2 applies
    flops = _rate(summary['model_flops_per_s'])
    eq3 = summary["eq3_flops_per_s"]                          # Eq 3 too, where the model is dense
    rows = [
        ("grid", f"{grid}  ({summary['world_size']} ranks, {summary['device']}, {summary['backend']})"),
        ("model", _model_line(summary)),
        ("parameters", f"{summary['params']:,}"),
        ("steps", f"{summary['start_step']} -> {summary['steps']}" + _resumed(summary)),
        ("tokens/s" if text else "pixels/s", f"{summary['tokens_per_s']:,.0f}"),
        ("model FLOP/s", flops if not text else f"{flops} (par4d's count; the paper's Eq 3: {_rate(eq3)})"
         if eq3 is not None else f"{flops} (par4d's count: the top-k experts a token meets)"),
        *([("300 B tokens", f"{summary['eq2_days_to_300b_tokens']:,.0f} days at this rate (the paper's Eq 2)")]
          if text else []),
        ("matmul peak", f"{_rate(summary['matmul_peak_flops_per_s'])} "
                        f"({summary.get('matmul_peak_of') or 'fp32, every core; measured at start-up'})"),
        ("% of peak", f"{summary['percent_of_peak']:.1f}%"),
        ("overlap", f"{summary['overlap']}, recompute {_every(summary['recompute_every'])}"
                    f"{buckets(summary['config'])}"),
        ("optimizer", summary["optimizer"]),
        *([("compiled", _compiled(summary["compiled"]))] if summary.get("compiled") else []),
        *([("float8", _float8(summary["float8"], summary["grid"].get("pipe", 1)))] if summary.get("float8") else []),
        ("communication", _communication(summary)),
        *([("memory", _memory(summary["rss_per_rank"]))] if summary.get("rss_per_rank") else []),
        *([("step holds", _held(summary["footprint_per_rank"]))] if summary.get("footprint_per_rank") else []),
        ("loss", f"{summary['initial_loss']:.3f} -> {summary['final_loss']:.3f} (train), "
                 f"{summary['val_loss']:.3f} (validation)"),
        *([("experts", f"the busiest expert of the worst layer took {summary['expert_imbalance']:.2f}x the mean "
                       f"tokens at the last step (1.00: balanced; per layer in metrics.jsonl)")]
          if "expert_imbalance" in summary else []),
        ("run directory", summary["config"]["out"]),
        *([("started from", summary["config"]["init_from"])] if summary["config"].get("init_from") else []),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
