"""What a training run gets from the planner under ``--grid auto``: the full search's first choice for the run's
model on a machine profile (the five axes, microbatches, recomputation and overlap switches), for every choice
the user did not fix with a flag; the fixed default from the world size is :func:`par4d.grid.default_grid`.
No torch here unless a machine must be found (this machine's GPUs) or calibrated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from par4d.models.config import GPTConfig
from par4d.overlap import BUCKET_MB, Overlap
from par4d.plan.experts import gpt_spec, rank_grids
from par4d.plan.machines import Machine, load_machine
from par4d.plan.search import Space, search
from par4d.plan.workload import GPTSpec
from par4d.train.config import VOCAB_BYTES


@dataclass(frozen=True)
class Plan:
    """The planner's choices, as ``par4d train``'s settings: ``grid`` (axes of size > 1), ``microbatches`` (None:
    the default, one per step without a pipeline), ``recompute`` (``none`` or ``1``: every block, as the model
    counts it), ``overlap`` (a ``--overlap`` value); ``peak``: the machine's matmul peak where it was calibrated
    here (so training need not measure it again)."""

    grid: dict[str, int]
    microbatches: int | None
    recompute: str
    overlap: str
    peak: float | None = None


def planned_run(world: int, *, machine: str | None, inside: bool, n_layer: int, n_embd: int, n_head: int,
                seq_len: int, batch_size: int, microbatches: int | None = None, recompute: str | None = None,
                overlap: str | None = None, offload_bsize: int | None = None, bucket_mb: float = BUCKET_MB,
                mlp: str = "dense", experts: int = 1, top_k: int = 1, shared_experts: int = 0,
                report: Callable[[str], None] = print) -> Plan:
    """The planner's first choice for training par4d's GPT on ``world`` ranks: dense, or with ``mlp="moe"`` a
    mixture of ``experts`` (:func:`planned_mixture`). ``microbatches``, ``recompute``
    (``none`` or a ``--recompute`` value), ``overlap`` (a ``--overlap`` value) and ``offload_bsize``: the choices
    the user made with flags (None: searched); the search keeps them. ``bucket_mb``: the data-parallel sync's
    buckets (``--bucket-mb``), in every overlap set it times. An overlap with the cache and no
    ``recompute`` given means recomputation (the cache keeps weights only for it; ``all`` includes it only under
    recomputation, as ``par4d train`` reads it).

    ``machine`` names a profile (built-in or TOML); ``None`` takes the built-in machine of this machine's GPUs
    where there are GPUs (:func:`par4d.measure.device.builtin_for`, as many per node as are visible), else calibrates
    this CPU machine first, which needs ranks of its own and so cannot happen ``inside`` a launched job.
    ``report`` gets one line before a calibration or a GPU's built-in, and one
    naming the choice and the runner-up with their predicted step times.
    """
    profile, peak = _machine(world, machine, inside, report)
    if mlp == "moe":
        config = GPTConfig(vocab_size=VOCAB_BYTES, block_size=seq_len, n_layer=n_layer, n_embd=n_embd,
                           n_head=n_head, mlp=mlp, experts=experts, top_k=top_k, shared_experts=shared_experts)
        return planned_mixture(world, profile, config, batch_size, microbatches, recompute, peak, report)
    spec = GPTSpec("train", n_layer=n_layer, hidden=n_embd, heads=n_head, seq_len=seq_len, global_batch=batch_size,
                   vocab=VOCAB_BYTES)
    settings = None if overlap is None else Overlap.parse(overlap)
    checkpointing = None if recompute is None else recompute.strip().lower() != "none"
    if settings is not None and settings.cache and overlap.strip().lower() != "all" and checkpointing is None:
        checkpointing = True            # the cache named (not "all", which means it only under recomputation)
    ranked, excluded = search(spec, world, profile, Space(microbatches=microbatches, checkpointing=checkpointing,
                                                          overlap=settings, offload_bsize=offload_bsize,
                                                          bucket_mb=bucket_mb))
    if not ranked:
        reasons = "; ".join(sorted({p.excluded for p in excluded}))
        raise ValueError(f"--grid auto: no grid of {world} ranks runs this model ({reasons})")
    ranked = settle_ties(ranked)
    best = ranked[0]
    report(f"--grid auto chose {describe(best)} on {profile.name}: " + why(ranked))
    pipe = best.sizes.get("pipe", 1)
    return Plan(grid={a: s for a, s in best.sizes.items() if s > 1} or {"x": 1},
                # par4d train's default is one microbatch per step without a pipeline, P with one
                microbatches=None if best.microbatches == (pipe if pipe > 1 else 1) else best.microbatches,
                recompute="1" if best.checkpointing else "none", overlap=best.overlap or "none", peak=peak)


def _machine(world: int, machine: str | None, inside: bool, report: Callable[[str], None]
             ) -> tuple[Machine, float | None]:
    """(the machine profile to plan for, its matmul peak where it was calibrated here): see :func:`planned_run`."""
    peak = None
    gpus = None if machine is not None else _this_gpu()
    if machine is not None:
        profile = load_machine(machine)
    elif gpus is not None:
        profile = gpus
        report(f"--grid auto: this machine's GPUs are {profile.name}'s ({profile.devices_per_node} per node); "
               f"--machine PROFILE plans for another")
    elif inside:
        raise ValueError("--grid auto under torchrun/srun needs --machine PROFILE (make one with par4d calibrate)")
    else:
        # torch: imported only when there is something to measure
        import tempfile
        from pathlib import Path

        from par4d.measure.calibrate import calibrate

        report(f"calibrating this machine on {world} ranks for --grid auto ...")
        calibration = calibrate(world, Path(tempfile.mkdtemp()) / "local.toml")
        profile, peak = calibration["machine"], calibration["peak_total"]
    return profile, peak


def planned_mixture(world: int, profile: Machine, config: GPTConfig, batch_size: int, microbatches: int | None,
                    recompute: str | None, peak: float | None, report: Callable[[str], None]) -> Plan:
    """The mixture planner's first choice of x, z, data and expert (par4d.plan.experts: y and the pipe axis are
    not priced for mixtures) among the grids the model can be built on, recomputing where the activations do
    not fit unless ``recompute`` says; microbatches and overlaps as given, else the defaults."""
    spec = gpt_spec(config, batch_size)
    forced = None if recompute is None else recompute.strip().lower() != "none"
    ranked, excluded = rank_grids(spec, world, profile, recompute=forced)
    built = [p for p in ranked if config.grid_problem({**p.sizes, "y": 1}) is None]
    if not built:
        reasons = sorted({p.excluded for p in excluded} | {config.grid_problem({**p.sizes, "y": 1}) for p in ranked})
        raise ValueError(f"--grid auto: no grid of {world} ranks runs this mixture ({'; '.join(reasons)})")
    best = built[0]
    line = (f"predicted {best.t_iter:.3f} s/step ({best.t_compute:.3f} s compute, {best.t_exchange:.3f} s token "
            f"exchange, {best.t_tensor:.3f} s tensor-parallel traffic)")
    named = [" ".join(f"{a}={p.sizes[a]}" for a in ("x", "z", "data", "expert")) for p in built[:2]]
    if len(built) > 1:
        line += f"; next {named[1]} at {built[1].t_iter:.3f} s/step"
    report(f"--grid auto chose {named[0]}, recompute "
           f"{'every block' if best.recompute else 'none'} on {profile.name}: {line}")
    grid = {a: s for a, s in best.sizes.items() if s > 1} or {"x": 1}
    return Plan(grid=grid, microbatches=microbatches, recompute="1" if best.recompute else "none", overlap="all",
                peak=peak)


def _this_gpu():
    """The built-in machine of this machine's GPUs with as many per node as are visible; None without CUDA
    (a CPU machine is calibrated); an error for a GPU no built-in describes (calibrate measures CPUs only)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from dataclasses import replace

    from par4d.measure.device import builtin_for

    device = torch.device("cuda", 0)
    machine = builtin_for(device)
    if machine is None:
        raise ValueError(f"--grid auto: no built-in machine describes this GPU ({torch.cuda.get_device_name(device)});"
                         f" give --machine PROFILE (a TOML profile: par4d plan --help)")
    return replace(machine, devices_per_node=torch.cuda.device_count())


TIE = 0.02
"""Predicted steps within 2% are a tie: closer than the model's own error (docs/planner.md)."""


def settle_ties(ranked: list) -> list:
    """``ranked`` (fastest first) with the grids that tie the first put in order of the communication they
    predict, least first: hidden communication is not free (on CPUs its copies and sums take the cores the
    compute needs; everywhere it takes memory bandwidth), and the model does not charge for it."""
    if not ranked:
        return ranked
    tied = [p for p in ranked if p.t_iter <= ranked[0].t_iter * (1 + TIE)]
    rest = [p for p in ranked if p.t_iter > ranked[0].t_iter * (1 + TIE)]
    return sorted(tied, key=lambda p: p.t_comm) + rest


def _grid(pred) -> str:
    return " ".join(f"{a}={pred.sizes.get(a, 1)}" for a in ("x", "y", "z", "data", "pipe"))


def describe(pred) -> str:
    """A choice in one phrase: the grid, microbatches, recomputation and overlaps."""
    return (f"{_grid(pred)}, {pred.microbatches} microbatch{'es' if pred.microbatches > 1 else ''}, recompute "
            f"{'every block' if pred.checkpointing else 'none'}, overlap {pred.overlap or 'none'}")


def why(ranked: list) -> str:
    """Why the first of ``ranked`` (after :func:`settle_ties`) won, in one line: its predicted step, split into
    compute and the communication left exposed, against the runner-up's; a tie says it was settled by the
    communication."""
    best = ranked[0]
    exposed = best.t_exposed if best.t_exposed is not None else best.t_comm
    line = (f"predicted {best.t_iter:.3f} s/step ({best.t_compute:.3f} s compute, {exposed:.3f} s of "
            f"{best.t_comm:.3f} s communication left exposed)")
    if len(ranked) > 1:
        second = ranked[1]
        line += f"; runner-up {describe(second)} at {second.t_iter:.3f} s/step ({second.t_iter / best.t_iter:.2f}x"
        if second.t_iter <= best.t_iter * (1 + TIE):
            line += f", a tie: {best.t_comm:.3f} s of communication against {second.t_comm:.3f} s"
        line += ")"
    return line + f"; {len(ranked)} grids ranked"
