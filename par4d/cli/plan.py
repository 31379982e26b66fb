"""``par4d plan``: rank every grid configuration of a workload on a machine (no torch), and ``par4d plan validate``:
measure every grid on local ranks and score the ranking against the measurements."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import replace

from par4d.cli.files import check_new_file
from par4d.cli.values import number
from par4d.parallel import COMPILE_BACKENDS
from par4d.plan import context as long_sequences
from par4d.plan.cost import VARIANTS, priced, rank_configurations
from par4d.plan.experts import MOE_MODELS, batch_of, moe_spec, rank_grids
from par4d.plan.machines import BUILTIN, load_machine
from par4d.plan.search import Space, search, search_top
from par4d.plan.workload import GPT_MODELS, gpt_spec

DEFAULT_BATCH_TOKENS = 32768   # the paper's running example: 16 sequences of 2048 tokens


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="rank every grid configuration of a workload")
    p.add_argument("action", nargs="?", choices=["validate", "paper", "device"],
                   help="validate: measure every grid on --nproc local ranks and score the model's ranking; "
                        "paper: the planner's answers beside the 4D paper's Table III (built-in perlmutter, "
                        "GEMMs at the one efficiency fitted to the table); device: measure this machine's GPU "
                        "(GEMMs by shape, attention, memory bandwidth, one-rank GPT steps beside plain PyTorch) "
                        "against what --machine predicts (default: the built-in machine of this GPU)")
    p.add_argument("--model", default="gpt-20b", help=f"built-in GPT: {', '.join(GPT_MODELS)}; or mixture of experts: "
                                                       f"{', '.join(MOE_MODELS)} (ranks x, z, data and expert); or "
                                                       f"long sequences: {', '.join(long_sequences.LONG_MODELS)} "
                                                       f"(ranks x, z, context and data)")
    p.add_argument("--imbalance", type=number(1, above=False), default=None,
                   help="a mixture's busiest rank's load over the mean (default 1: balanced; ranking of mixtures)")
    p.add_argument("--gpus", type=int, default=None, help="number of devices (ranking)")
    p.add_argument("--nproc", type=int, default=None, help="local ranks (validate; default 4)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per grid (validate) or step (device)")
    p.add_argument("--compile", nargs="?", const="inductor", choices=COMPILE_BACKENDS, default=None,
                   help="device: also par4d's and plain PyTorch's steps with every block compiled (inductor when "
                        "given alone; the compiling step timed apart)")
    p.add_argument("--passes", type=int, default=None,
                   help="validate: measure every grid this many times, round robin; also reports how well "
                        "the passes agree with each other (default 1)")
    p.add_argument("--plot", default=None,
                   help="validate: write the ranking plot (PNG) here (an existing file is refused unless --force)")
    p.add_argument("--force", action="store_true", help="validate: overwrite an existing --plot file")
    p.add_argument("--nodes", type=int, default=None,
                   help="validate on an emulated cluster of this many nodes, --nproc ranks each (needs root)")
    p.add_argument("--link", default=None, help="emulated inter-node link rate (with --nodes; default 1gbit)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the machine's)")
    p.add_argument("--machine", default=None,
                   help=f"{', '.join(BUILTIN)} or a TOML profile (default: perlmutter; validate: calibrate now)")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS, help="global batch in tokens")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--variant", choices=VARIANTS, default="full",
                   help="model used for the ranking: full searches every choice below and ranks by step time; "
                        "agnostic and aware rank the grids (x, y, z, data) by communication time, as the paper")
    p.add_argument("--train-tokens", type=number(0), default=None, help="also estimate days to train on N tokens")
    choices = p.add_argument_group("choices the full model searches (auto) or is given")
    choices.add_argument("--pipe", default="auto", metavar="auto|N", help="pipeline stages (default auto)")
    choices.add_argument("--microbatches", default="auto", metavar="auto|M",
                         help="microbatches per step: gradient accumulation, and the pipeline's (default auto)")
    choices.add_argument("--recompute", choices=["auto", "on", "off"], default="auto",
                         help="activation recomputation (default auto)")
    choices.add_argument("--overlap", default=None, metavar="auto|all|none|LIST",
                         help="overlap switches (oar, ors, oag, dp, cache): ranking default auto (the fastest set "
                              "that fits); validate measures with these (default all)")
    choices.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                         help="the data-parallel sync's gradient buckets (as par4d train's; default 25): ranking and "
                              "validate")
    choices.add_argument("--offload-optimizer", dest="offload_bsize", nargs="?", type=int, const=1 << 22,
                         default=None, metavar="BSIZE",
                         help="masters and AdamW state in CPU memory, stepped BSIZE elements at a time (default "
                              "4194304): 4 bytes per parameter and 16 per BSIZE element on the device")
    p.add_argument("--fit", action="store_true",
                   help="paper: fit the one constant (the GEMMs' fraction of peak) to Table III again and print it")
    p.add_argument("--write", default=None, metavar="MARKDOWN",
                   help="paper: replace the table between <!-- plan paper --> markers in this file (docs/planner.md)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true", help="one JSON object per configuration")


def _overlap(args: argparse.Namespace):
    from par4d.overlap import Overlap

    return replace(Overlap.parse(args.overlap or "all"), bucket_mb=_bucket_mb(args))


def _bucket_mb(args: argparse.Namespace) -> float:
    """``--bucket-mb``, checked (naming the flag), else DDP's 25 MB."""
    from par4d.overlap import BUCKET_MB, check_bucket_mb

    return BUCKET_MB if args.bucket_mb is None else check_bucket_mb(args.bucket_mb)


def _auto(text: str, flag: str) -> int | None:
    """``auto`` (None: searched) or a count >= 1."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{flag} {text!r}: give auto or a whole number >= 1")
    return value


def _space(args: argparse.Namespace, world: int) -> Space:
    """What the search may choose, from the flags (each checked, naming the flag)."""
    from par4d.overlap import Overlap

    pipe = _auto(args.pipe, "--pipe")
    if pipe is not None and world % pipe:
        raise ValueError(f"--pipe {pipe} does not divide --gpus {world}")
    overlap = None if (args.overlap or "auto").strip().lower() == "auto" else Overlap.parse(args.overlap)
    if args.offload_bsize is not None and args.offload_bsize < 1:
        raise ValueError(f"--offload-optimizer {args.offload_bsize}: give a bucket size >= 1 element")
    return Space(pipe=pipe, microbatches=_auto(args.microbatches, "--microbatches"),
                 checkpointing={"auto": None, "on": True, "off": False}[args.recompute], overlap=overlap,
                 offload_bsize=args.offload_bsize, bucket_mb=_bucket_mb(args))


def _paper(args: argparse.Namespace) -> int:
    from par4d.plan.paper import PAPER_EFFICIENCY, answers, fit_efficiency, markdown, misfit

    if args.fit:
        print("fitting the GEMMs' fraction of peak to Table III's par4d column ...", file=sys.stderr)
        fitted = fit_efficiency()
        print(f"fitted efficiency {fitted:.2f}: {misfit(fitted):.1f} points RMS over the five rows "
              f"(the code's PAPER_EFFICIENCY is {PAPER_EFFICIENCY:.2f})")
        return 0
    table = markdown(answers())
    if args.write is not None:
        write_between_markers(args.write, "plan paper", table)
        print(f"wrote the table into {args.write}")
        return 0
    print(table)
    return 0


def write_between_markers(path: str, marker: str, text: str) -> None:
    """Replace what lies between ``<!-- marker -->`` and ``<!-- /marker -->`` in the regular file ``path``."""
    from pathlib import Path

    file = Path(path)
    if file.is_symlink() or not file.is_file():
        raise ValueError(f"--write {path}: not a regular file")
    document = file.read_text(encoding="utf-8")
    start, end = f"<!-- {marker} -->\n", f"\n<!-- /{marker} -->"
    if document.count(start) != 1 or document.count(end) != 1 or document.index(start) > document.index(end):
        raise ValueError(f"--write {path}: needs one {start.strip()} line and one {end.strip()} line after it")
    head, rest = document.split(start)
    _, tail = rest.split(end)
    file.write_text(head + start + text + end + tail, encoding="utf-8")


# flag (its argparse destination) -> the action it belongs to: given to another, it would be silently unused
ONLY_FOR = {"nproc": "validate", "passes": "validate", "plot": "validate", "nodes": "validate", "link": "validate",
            "fit": "paper", "write": "paper", "compile": "device"}


def _applies(args: argparse.Namespace) -> None:
    """Refuse a flag of another action (``par4d plan --nodes 2`` would rank without any cluster), and fill in
    the defaults of those that apply."""
    for name, action in ONLY_FOR.items():
        given = getattr(args, name)
        if given is not None and given is not False and args.action != action:   # (0 is given: --nodes 0)
            command = "par4d plan" + (f" {args.action}" if args.action else "")
            raise ValueError(f"--{name}: a setting of par4d plan {action}; {command} does not use it")
    if args.link is not None and args.nodes is None:
        raise ValueError(f"--link {args.link}: the link between emulated nodes; give --nodes too")
    for name, default in (("nproc", 4), ("passes", 1), ("link", "1gbit")):
        if getattr(args, name) is None:
            setattr(args, name, default)


def run(args: argparse.Namespace) -> int:
    _applies(args)
    if args.action == "validate":
        return _validate(args)
    if args.action == "paper":
        return _paper(args)
    if args.action == "device":
        return _device(args)
    if args.gpus is None:
        raise ValueError("--gpus is required to rank configurations (e.g. --gpus 32)")
    if args.gpus < 1 or args.top < 1:
        raise ValueError(f"--gpus and --top must be >= 1 (got {args.gpus}, {args.top})")
    if args.batch_tokens < 1 or args.seq_len < 1:
        raise ValueError(f"--batch-tokens and --seq-len must be >= 1 (got {args.batch_tokens}, {args.seq_len})")
    if args.batch_tokens % args.seq_len:
        raise ValueError(f"--batch-tokens {args.batch_tokens} is not a multiple of --seq-len {args.seq_len}")
    machine = load_machine(args.machine or "perlmutter")
    if args.gpus_per_node is not None:
        machine = replace(machine, devices_per_node=args.gpus_per_node)
    if args.model in MOE_MODELS:
        return _mixture(args, machine)
    if args.model in long_sequences.LONG_MODELS:
        return _long(args, machine)
    if args.imbalance is not None:
        raise ValueError(f"--imbalance: a setting of a mixture of experts ({', '.join(MOE_MODELS)}); --model "
                         f"{args.model} has none")
    spec = gpt_spec(args.model).with_batch(args.batch_tokens // args.seq_len, args.seq_len)
    if args.variant != "full" and (args.pipe, args.microbatches, args.recompute, args.overlap, args.bucket_mb,
                                   args.offload_bsize) != ("auto", "auto", "auto", None, None, None):
        raise ValueError(f"--variant {args.variant} ranks (x, y, z, data) by communication time only; "
                         f"--pipe, --microbatches, --recompute, --overlap, --bucket-mb and --offload-optimizer are "
                         f"the full model's")
    space = _space(args, args.gpus) if args.variant == "full" else None
    began = time.perf_counter()
    # The paper's models rank grids by communication alone: no choices to search. The table times only what
    # can reach its top rows; --json gives every grid.
    if space is None:
        ranked, excluded = rank_configurations(spec, args.gpus, machine, args.variant, checkpointing=True)
        fitting = len(ranked)
    elif args.json:
        ranked, excluded = search(spec, args.gpus, machine, space)
        fitting = len(ranked)
    else:
        ranked, excluded, fitting = search_top(spec, args.gpus, machine, space, args.top)
    seconds = time.perf_counter() - began
    if args.json:
        for position, pred in enumerate(ranked, 1):
            print(json.dumps({"rank": position, **pred.row(), **_days(pred, spec, args)}))
        for pred in excluded:
            print(json.dumps({"rank": None, **pred.row()}))
        return 0 if ranked else 1
    print(f"{spec.name}: {spec.params() / 1e9:.1f}B parameters, batch {spec.tokens:,} tokens "
          f"({spec.global_batch} x {spec.seq_len}), {args.gpus} x {machine.name} "
          f"({machine.devices_per_node} per node), model '{args.variant}'"
          + (f", offloaded optimizer (bsize {args.offload_bsize:,})" if args.offload_bsize else ""))
    header = (f"{'#':>3}  {'x':>4} {'y':>4} {'z':>4} {'data':>5} {'pipe':>4} {'M':>5} {'rc':>3} {'overlap':<19}"
              f"{'t_x':>7} {'t_y':>7} {'t_z':>7} {'t_data':>7} {'t_pipe':>7}  {'comm s':>7} {'exposed':>7} "
              f"{'compute s':>9} {'iter s':>7}  {'mem GB':>6} {'% peak':>6}")
    print(header)
    for position, p in enumerate(ranked[:args.top], 1):
        t = p.t_comm_axes
        days = _days(p, spec, args)
        exposed = p.t_comm if p.t_exposed is None else p.t_exposed
        timed = (f"{exposed:>7.3f} {p.t_compute:>9.3f} {p.t_iter:>7.3f}  {p.mem_bytes / 1e9:>6.1f} "
                 f"{p.percent_of_peak:>6.1f}" if args.variant == "full"   # the paper's models time communication only
                 else f"{'-':>7} {'-':>9} {'-':>7}  {'-':>6} {'-':>6}")
        print(f"{position:>3}  {p.sizes['x']:>4} {p.sizes['y']:>4} {p.sizes['z']:>4} {p.sizes['data']:>5} "
              f"{p.sizes.get('pipe', 1):>4} {p.microbatches:>5} {'on' if p.checkpointing else 'off':>3} "
              f"{p.overlap or 'none':<19}{t['x']:>7.3f} {t['y']:>7.3f} {t['z']:>7.3f} {t['data']:>7.3f} "
              f"{t.get('pipe', 0.0):>7.3f}  {p.t_comm:>7.3f} {timed}"
              + (f"  {days['days_to_train']:.1f} days" if days else ""))
    total = fitting + len(excluded)
    what = "grids, each with its fastest choice that fits" if args.variant == "full" else "grids"
    print(f"{fitting} of {total} {what}; showing the top {min(args.top, len(ranked))}; ranked in "
          f"{seconds:.2f} s.")
    if excluded:
        reasons = Counter(_reason_kind(p.excluded) for p in excluded)
        print("excluded: " + "; ".join(f"{count} {kind}" for kind, count in reasons.most_common()))
        if not ranked:
            best = min((p for p in excluded if p.mem_bytes), key=lambda p: p.mem_bytes, default=None)
            if best is not None:
                grid = " ".join(f"{a}={best.sizes[a]}" for a in best.sizes)
                print(f"nothing fits: the smallest footprint is {best.mem_bytes / 1e9:.1f} GB at {grid} with "
                      f"{best.microbatches} microbatches; try a smaller --batch-tokens, --offload-optimizer, or "
                      f"more devices")
    if not ranked:   # an empty table is not a plan: the exit status says so (1, as grep finding nothing)
        print(f"par4d plan: no grid of {args.gpus:,} devices runs {spec.name} with this batch; see the reasons "
              f"above", file=sys.stderr)
        return 1
    return 0


def _mixture(args: argparse.Namespace, machine) -> int:
    """Rank the (x, z, data, expert) grids of a built-in mixture of experts (par4d.plan.experts)."""
    given = [f"--{name.replace('_', '-')}" for name, default in (("pipe", "auto"), ("microbatches", "auto"),
                                                                  ("recompute", "auto"), ("overlap", None),
                                                                  ("bucket_mb", None), ("offload_bsize", None),
                                                                  ("variant", "full"),
                                                                  ("train_tokens", None))
             if getattr(args, name) != default]
    if given:
        raise ValueError(f"{given[0]}: the planner ranks a mixture of experts' x, z, data and expert sizes only (its "
                         f"pipeline, overlaps and offloading are not priced yet); leave it out")
    spec = batch_of(moe_spec(args.model), args.batch_tokens, args.seq_len)
    imbalance = 1.0 if args.imbalance is None else args.imbalance
    ranked, excluded = rank_grids(spec, args.gpus, machine, imbalance)
    if args.json:
        return _json_rows(ranked, excluded)
    print(f"{spec.name}: {spec.params() / 1e9:.1f}B parameters ({spec.active_matmul_params() / 1e9:.1f}B matmul "
          f"weights a token meets), batch {spec.tokens:,} tokens ({spec.global_batch} x {spec.seq_len}), "
          f"{args.gpus} x {machine.name} ({machine.devices_per_node} per node), imbalance {imbalance:g}")
    print(f"{'#':>3}  {'x':>4} {'z':>4} {'data':>5} {'expert':>6} {'rc':>3}  {'a2a GB':>7} {'a2a s':>7} {'x,z s':>7} "
          f"{'sync s':>7} {'compute s':>9} {'iter s':>7}  {'mem GB':>6} {'tok/s/dev':>9} {'MFU':>5}")
    for position, p in enumerate(ranked[:args.top], 1):
        g = p.sizes
        print(f"{position:>3}  {g['x']:>4} {g['z']:>4} {g['data']:>5} {g['expert']:>6} "
              f"{'on' if p.recompute else 'off':>3}  "
              f"{p.exchange_bytes / 1e9:>7.2f} {p.t_exchange:>7.3f} {p.t_tensor:>7.3f} {p.t_sync:>7.3f} "
              f"{p.t_compute:>9.3f} {p.t_iter:>7.3f}  {p.mem_bytes / 1e9:>6.1f} {p.tokens_per_s_per_device:>9.0f} "
              f"{p.mfu:>5.1%}")
    return _said(ranked, excluded, args, spec.name)


def _long(args: argparse.Namespace, machine) -> int:
    """Rank the (x, z, context, data) grids of a built-in long-sequence model (par4d.plan.context)."""
    given = [f"--{name.replace('_', '-')}" for name, default in (("pipe", "auto"), ("microbatches", "auto"),
                                                                  ("recompute", "auto"), ("overlap", None),
                                                                  ("bucket_mb", None), ("offload_bsize", None),
                                                                  ("variant", "full"),
                                                                  ("train_tokens", None), ("imbalance", None))
             if getattr(args, name) != default]
    if given:
        raise ValueError(f"{given[0]}: the planner ranks a long sequence's x, z, context and data sizes only (its "
                         f"pipeline, overlaps and offloading are not priced yet); leave it out")
    spec = long_sequences.long_spec(args.model).with_batch(args.batch_tokens // args.seq_len, args.seq_len)
    ranked, excluded = long_sequences.rank_grids(spec, args.gpus, machine)
    if args.json:
        return _json_rows(ranked, excluded)
    print(f"{spec.name}: {spec.params() / 1e9:.2f}B parameters, batch {spec.tokens:,} tokens ({spec.global_batch} x "
          f"{spec.seq_len}), {args.gpus} x {machine.name} ({machine.devices_per_node} per node)")
    print(f"{'#':>3}  {'x':>4} {'z':>4} {'ctx':>4} {'data':>5} {'rc':>3} {'form':>6}  {'ring GB':>8} {'ring s':>7} "
          f"{'x,z s':>7} "
          f"{'sync s':>7} {'compute s':>9} {'iter s':>7}  {'mem GB':>6} {'tok/s/dev':>9} {'MFU':>5}")
    for position, p in enumerate(ranked[:args.top], 1):
        g = p.sizes
        print(f"{position:>3}  {g['x']:>4} {g['z']:>4} {g['context']:>4} {g['data']:>5} "
              f"{'on' if p.recompute else 'off':>3} {p.form:>6}  {p.ring_bytes / 1e9:>8.2f} {p.t_ring:>7.3f} "
              f"{p.t_tensor:>7.3f} "
              f"{p.t_sync:>7.3f} {p.t_compute:>9.3f} {p.t_iter:>7.3f}  {p.mem_bytes / 1e9:>6.1f} "
              f"{p.tokens_per_s_per_device:>9.0f} {p.mfu:>5.1%}")
    return _said(ranked, excluded, args, spec.name)


def _json_rows(ranked: list, excluded: list) -> int:
    """A mixture's or long sequence's ranking as JSON lines (the excluded ones last, rank null)."""
    for position, pred in enumerate(ranked, 1):
        print(json.dumps({"rank": position, **pred.row()}))
    for pred in excluded:
        print(json.dumps({"rank": None, **pred.row()}))
    return 0 if ranked else 1


def _said(ranked: list, excluded: list, args: argparse.Namespace, name: str) -> int:
    """A ranking's last lines (how many fit, why the others do not) and its exit status (1: none fits)."""
    print(f"{len(ranked)} of {len(ranked) + len(excluded)} grids fit; showing the top {min(args.top, len(ranked))}")
    if excluded:
        reasons = Counter(_reason_kind(p.excluded) for p in excluded)
        print("excluded: " + "; ".join(f"{count} {kind}" for kind, count in reasons.most_common()))
    if not ranked:
        print(f"par4d plan: no grid of {args.gpus:,} devices runs {name} with this batch; see the reasons above",
              file=sys.stderr)
        return 1
    return 0


def _reason_kind(reason: str | None) -> str:
    if reason is None:
        return "other"
    return "do not fit in memory" if reason.startswith("needs") else "do not divide the model"


def _days(pred, spec, args) -> dict:
    if args.train_tokens is None or pred.t_iter <= 0:
        return {}
    return {"days_to_train": args.train_tokens / spec.tokens * pred.t_iter / 86400}


def _device(args: argparse.Namespace) -> int:
    import torch

    from par4d.launch.host import cpu_cores
    from par4d.measure.device import builtin_for, check_device, report

    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if not torch.cuda.is_available():
        # A CPU profile describes one rank of those sharing the cores; calibrate measures its terms as such.
        raise ValueError("plan device checks a GPU, and none is visible here; on CPUs, par4d calibrate measures "
                         "the same terms for one rank (GEMMs by shape, attention, memory bandwidth)")
    device = torch.device("cuda", torch.cuda.current_device())
    machine = load_machine(args.machine) if args.machine is not None else builtin_for(device)
    if machine is None:
        raise ValueError(f"plan device: no built-in machine describes this GPU ({torch.cuda.get_device_name(device)}"
                         f"); give --machine, a TOML profile of it (its peak_flops and memory_bandwidth are checked)")
    result = check_device(machine, device, cpu_cores(), args.iters, compile=args.compile or "none")
    if args.json:
        for row in result["steps"]:
            print(json.dumps(row))
        return 0
    print(report(result))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from par4d.measure.validate import memory_check, report, validate

    cluster = None
    if args.nodes is not None:
        from par4d.launch.cluster import ClusterSpec

        cluster = ClusterSpec(args.nodes, args.nproc, args.link)
    elif args.nproc < 2:
        raise ValueError(f"--nproc must be >= 2 for validate, got {args.nproc}")
    if args.plot:
        check_new_file(args.plot, "--plot", args.force)
    if args.passes < 1:
        raise ValueError(f"--passes must be >= 1, got {args.passes}")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if args.machine is None:
        import tempfile

        from par4d.measure.calibrate import calibrate

        profile = Path(tempfile.mkdtemp()) / "local.toml"
        machine = calibrate(args.nproc, profile, cluster=cluster)["machine"]
    else:
        machine = load_machine(args.machine)
    if args.gpus_per_node is not None:
        machine = replace(machine, devices_per_node=args.gpus_per_node)
    overlap = _overlap(args)   # parsed before anything is measured
    measured, scores = validate(args.nproc, machine, args.iters, Path(args.plot) if args.plot else None, cluster,
                                args.passes, overlap)
    print(report(measured, scores, args.json, memory_check(measured, machine, priced(overlap))))
    return 0
