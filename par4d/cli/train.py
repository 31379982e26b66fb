"""``par4d train``: its arguments; then the run's ``TrainConfig`` (:mod:`par4d.cli.configure`), local ranks
launched or a torchrun/srun job joined, and the summary printed (:mod:`par4d.cli.report`)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from par4d.hierarchy import MODES
from par4d.parallel import COMPILE_BACKENDS, CONTEXT_FORMS, FLOAT8_RECIPES
from par4d.train.config import DEFAULT_NPROC, default
from par4d.train.recipes import MODELS
from par4d.train.recipes.unet import IMAGE_CHANNELS
from par4d.train.say import say

# The flags with a fixed set of values; a --config file's values are held to the same sets.
CHOICES = {"model": MODELS, "mlp": ("dense", "phantom", "moe"), "hierarchical": MODES,
           "precision": ("fp32", "bf16", "fp16"), "grad_reduce": ("fp32", "compute"), "context_form": CONTEXT_FORMS,
           "compile": (*COMPILE_BACKENDS, "none"), "float8": (*FLOAT8_RECIPES, "none")}


def _help(name: str, text: str = "") -> str:
    return f"{text} (default {default(name)})" if text else f"default {default(name)}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train the GPT on text (the main job), or a U-Net on images",
        epilog="SIGTERM (a scheduler's preemption) or Ctrl-C: every rank saves the step it is on and the run exits "
               "with 128 + the signal's number; --resume goes on from there. Exit status 1: a rank failed (its "
               "traceback is in the run's logs/); 2: bad input, found before any rank started.")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML file of these settings in sections (docs/config.md; a run's own config.toml trains "
                        "it again); flags given here override it")
    p.add_argument("--nproc", type=int, default=None,
                   help=f"local ranks to start (default: as many as --grid names, or the resumed run's grid, "
                        f"else {DEFAULT_NPROC}); under torchrun/srun the job's")
    p.add_argument("--grid", default=None,
                   help="axis sizes, e.g. x=2,z=2, or 'auto' for the planner's first choice "
                        "(default: picked from --nproc)")
    p.add_argument("--machine", default=None,
                   help="machine profile for --grid auto (default: calibrate this machine first, ~10 s)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"total optimizer steps (default {default('steps')}; on --resume, the saved run's)")
    p.add_argument("--out", default=None, help="run directory (default: a new folder under runs/)")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run in DIR from its checkpoint, on its grid or another one (--grid)")
    p.add_argument("--init-from", nargs=2, metavar=("hf", "DIR"), default=None,
                   help="start from the weights of a Hugging Face GPT-2 folder (as par4d export writes it); "
                        "the model's shape defaults to its config.json's, each rank reads only its shards")
    p.add_argument("--data", default=None,
                   help="a UTF-8 text file for the language models (default: Python's bundled docs), or a dataset "
                        "folder made by par4d data prepare (streamed: each rank reads its own rows); a resumed "
                        "run checks it is the same")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a Hugging Face tokenizer.json, or a folder holding one: its vocabulary is the model's "
                        "(default: one token per byte; a dataset folder's own); a resumed run refuses another")
    model = p.add_argument_group("model and batch (a resumed run keeps its own: a different value is refused)")
    model.add_argument("--model", choices=CHOICES["model"], default=None,
                       help=_help("model", "par4d's GPT, or Hugging Face's GPT-2 or Llama built from the sizes "
                                           "below and made parallel by par4d.parallelize, all on text; or unet: "
                                           "par4d's U-Net denoising images generated from --seed (mean squared "
                                           "error; its width is --n-embd, its levels --n-layer)"))
    model.add_argument("--batch-size", type=int, default=None,
                       help=_help("batch_size", "global batch, in sequences (unet: images)"))
    model.add_argument("--seq-len", type=int, default=None, help=_help("seq_len"))
    model.add_argument("--document-mask", action="store_const", const=True, default=None,
                       help="attention inside each document of a packed window (a dataset folder of par4d data "
                            "prepare: it records where documents end; par4d's GPT)")
    model.add_argument("--restart-positions", action="store_const", const=True, default=None,
                       help="with --document-mask: each token's position counted from its document's start (or "
                            "the window's, where the document began before it)")
    model.add_argument("--n-layer", type=int, default=None, help=_help("n_layer", "blocks (unet: levels)"))
    model.add_argument("--n-embd", type=int, default=None,
                       help=_help("n_embd", "embedding width (unet: channels inside)"))
    model.add_argument("--n-head", type=int, default=None, help=_help("n_head"))
    model.add_argument("--image-size", type=int, default=None,
                       help=_help("image_size", f"unet: images are {IMAGE_CHANNELS} x N x N, N divisible by "
                                                f"2 ** (levels - 1)"))
    model.add_argument("--mlp", choices=CHOICES["mlp"], default=None,
                       help=_help("mlp", "phantom: phantom layers over x in every MLP (needs y = z = 1); moe: a "
                                         "mixture of experts in every block, spread over --grid ...,expert=E (E "
                                         "dividing data; each expert's GEMMs split over x, y and z as a Linear's; "
                                         "no pipeline or recomputation yet)"))
    model.add_argument("--experts", type=int, default=None, help=_help("experts", "--mlp moe: experts per block"))
    model.add_argument("--top-k", type=int, default=None, help=_help("top_k", "--mlp moe: experts per token"))
    model.add_argument("--shared-experts", type=int, default=None,
                       help=_help("shared_experts", "--mlp moe: experts every token goes through besides the routed "
                                                    "ones (their GEMMs run while the tokens travel)"))
    model.add_argument("--capacity-factor", type=float, default=None,
                       help=_help("capacity_factor", "--mlp moe: each expert takes at most this times its share of a "
                                                     "rank's assignments, the best-scored; the rest are dropped and "
                                                     "counted (0: dropless; per rank, so drops depend on the grid)"))
    model.add_argument("--expert-bias-rate", type=float, default=None,
                       help=_help("expert_bias_rate", "--mlp moe: loss-free balancing (DeepSeek-V3): each expert's "
                                                      "routing bias steps this much towards the mean load per step "
                                                      "(0: off)"))
    model.add_argument("--phantom-k", type=int, default=None,
                       help=_help("phantom_k", "ghost neurons per phantom layer"))
    model.add_argument("--seed", type=int, default=None, help=_help("seed"))
    steps = p.add_argument_group("optimizer and schedule (a resumed run takes these when given)")
    steps.add_argument("--lr", type=float, default=None, help=_help("lr", "peak learning rate"))
    steps.add_argument("--grad-clip", type=float, default=None,
                       help=_help("grad_clip", "clip the global gradient norm to this (0: off)"))
    steps.add_argument("--overlap", default=None, metavar="all|none|LIST",
                       help=_help("overlap", "overlap communication with compute: all, none, or a comma list of "
                                             "oar,ors,oag,cache,dp,xy (cache needs --recompute)"))
    steps.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                       help=_help("bucket_mb", "the data-parallel sync's gradient buckets in MB (DDP's bucket_cap_mb; "
                                               "the first at most 1 MB): each summed as soon as backward fills it. "
                                               "Smaller ones leave less of the sum after backward (across a slow "
                                               "link) for a collective each; where a gradient falls in a bucket "
                                               "decides a ring's order of summing it, so another size may round "
                                               "otherwise"))
    steps.add_argument("--context-form", choices=CHOICES["context_form"], default=None,
                       help=_help("context_form", "attention on a context axis: ring (keys and values around the "
                                                  "context ranks, hidden behind the attention) or gather (gathered "
                                                  "once per layer: for few key heads or short sequences)"))
    steps.add_argument("--compile", nargs="?", const="inductor", choices=CHOICES["compile"], default=None,
                       help=_help("compile", "compile each block as a region with torch.compile: inductor (the "
                                             "default backend), aot_eager (its graphs run eagerly: no C++ compiler) "
                                             "or none; par4d's collectives stay eager, between fused regions"))
    steps.add_argument("--float8", choices=CHOICES["float8"], default=None,
                       help=_help("float8", "run every Linear layer's local GEMMs (but a language model's head) in "
                                            "float8 by this torchao recipe: tensorwise, rowwise, rowwise_with_gw_hp "
                                            "or none; needs torchao, and on a GPU float8 GEMMs (Ada, Hopper); on "
                                            "a CPU they are emulated, slower than fp32"))
    steps.add_argument("--hierarchical", choices=CHOICES["hierarchical"], default=None,
                       help=_help("hierarchical", "collectives over groups that span nodes in stages (inside the node, "
                                                  "across the link once, inside again; gloo): auto where a probe at "
                                                  "start measures them faster, on everywhere, off never"))
    steps.add_argument("--recompute", default=None, metavar="none|auto|N",
                       help=_help("recompute", "recompute activations in backward every N blocks; auto: the divisor "
                                               "of the block count closest to its square root"))
    steps.add_argument("--precision", choices=CHOICES["precision"], default=None,
                       help=_help("precision", "compute dtype; bf16 and fp16 keep fp32 master weights (what "
                                               "checkpoints hold), fp16 with a dynamic loss scale"))
    steps.add_argument("--grad-reduce", choices=CHOICES["grad_reduce"], default=None,
                       help=_help("grad_reduce", "sum gradients over data x z in fp32 or in the compute dtype"))
    steps.add_argument("--offload-optimizer", dest="offload_bsize", nargs="?", type=int, const=1 << 22,
                       default=None, metavar="BSIZE",
                       help="keep fp32 master weights and AdamW state in CPU memory and step them through the "
                            "device BSIZE elements at a time (default 4194304; needs --precision bf16 or fp16)")
    steps.add_argument("--microbatches", type=int, default=None, metavar="M",
                       help="gradient accumulation, on any grid: each data x z shard of the batch runs as M "
                            "microbatches, one microbatch's activations at a time; the data-parallel sync and the "
                            "optimizer run once per step. With pipe > 1 the message-driven pipeline runs them "
                            "(default: pipe, else 1; at most the sequences of a shard, batch / (data * z))")
    steps.add_argument("--pipeline-limit", type=int, default=None,
                       help="with pipe > 1: microbatches the first stage keeps in flight, which bounds every "
                            "stage's activations (stage s holds at most limit - s; default: pipe)")
    steps.add_argument("--save-every", type=int, default=None,
                       help=_help("save_every", "also checkpoint every N steps (0: only at the end)"))
    steps.add_argument("--keep", type=int, default=None,
                       help=_help("keep", "checkpoints kept (the newest; a corrupt one falls back to the one before "
                                          "it)"))
    p.add_argument("--max-restarts", type=int, default=None,
                   help="when a rank dies, restart every rank up to N times from the newest checkpoint "
                        "(--save-every bounds what is recomputed); under torchrun/srun use their own restarts")
    p.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help=_help("eval_every", "the validation loss every N steps too, in metrics.jsonl and TensorBoard "
                                            "(0: at the end only)"))
    p.add_argument("--peak-flops", dest="matmul_peak", type=float, default=None, metavar="FLOPS",
                   help="the matmul peak (FLOP/s, of all the job's devices together) that the summary's %% of peak "
                        "is a share of, instead of measuring it at start-up (which a busy machine lowers)")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_const", const=False, default=None,
                   help="no TensorBoard event files (default: in RUN/tensorboard; tensorboard --logdir RUN)")


def run(args: argparse.Namespace) -> int:
    from par4d.cli.configure import configure, resumable, world_size
    from par4d.launch import Interrupted, RankFailed
    from par4d.measure.choose import planned_run
    from par4d.train.faults import Faults
    from par4d.train.job import as_rank, local_ranks

    if args.config is not None:        # the file's settings where no flag gave one
        from par4d.train.settings_file import apply, read

        apply(args, read(args.config, CHOICES), args.config)
    for name in ("out", "data", "tokenizer", "resume"):      # "" would silently mean the default folder or data
        if getattr(args, name) is not None and not str(getattr(args, name)).strip():
            raise ValueError(f"--{name} {getattr(args, name)!r} names no file or folder (omit --{name} for the "
                             f"default)")
    args.max_restarts = args.max_restarts or 0
    resumed = resumable(args) if args.resume else None
    world, inside = world_size(args, resumed)
    config = configure(args, world, inside, resumed, planned_run)   # every pre-start rule
    Faults.from_env()     # a malformed test hook fails here, not in every rank
    if inside:            # this process is a rank of torchrun's or srun's job
        from par4d.launch import distributed_env

        return _finish(as_rank(config), quiet=distributed_env().rank != 0)
    try:
        return _finish(local_ranks(config, world, args.max_restarts))
    except Interrupted as error:   # this process got the signal; the ranks saved their step before exiting
        return _stopped(error.signum, Path(config.out))
    except RankFailed as error:
        if not error.stopped:
            raise
        # One rank was sent the signal (a scheduler's, a user's kill): every rank saved the step and stopped
        return _stopped(error.signum, Path(config.out), f" (sent to rank {error.rank})")


def _finish(summary: dict, quiet: bool = False) -> int:
    """Print rank 0's summary (``quiet``: another rank's); a run a signal stopped early exits
    with 128 + the signal's number."""
    if "stopped" in summary:
        signum = signal.Signals[summary["stopped"]["signal"]]
        return 128 + signum if quiet else _stopped(signum, Path(summary["stopped"]["run"]))
    if summary and not quiet:
        from par4d.cli.report import print_summary

        print_summary(summary)
    return 0


def _stopped(signum: int, out: Path, whose: str = "") -> int:
    from par4d.checkpoint import latest, read_meta

    name = signal.Signals(signum).name + whose
    try:   # the pointer moves only once a checkpoint is complete (a resume verifies it)
        step = read_meta(latest(out))["step"]
        say(f"stopped by {name}: step {step} is saved; continue with: par4d train --resume {out} (it goes on "
             f"from the newest intact checkpoint)")
    except (ValueError, OSError):
        say(f"stopped by {name} before a checkpoint was complete; nothing to resume in {out}")
    return 128 + signum


