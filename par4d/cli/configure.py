"""A run's settings from the command line: a new run's or a resumed one's ``TrainConfig``, with every rule
that must hold before any rank starts (the grid, the batch, the sizes against memory, the data, the run
folder), and what a resume keeps (FIXED) or takes (HONOURED). ``par4d train`` parses; this decides.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from par4d.train.config import DEFAULT_NPROC, default, flag
from par4d.train.lock import check_new_out
from par4d.train.recipes import recipe
from par4d.train.recipes.base import MOE_SETTINGS
from par4d.train.say import say

# A resumed run keeps these (they decide the model and its batches); it takes HONOURED ones when given.
FIXED = ("model", "batch_size", "seq_len", "document_mask", "restart_positions", "n_layer", "n_embd", "n_head",
         "mlp", "phantom_k", *MOE_SETTINGS, "image_size", "seed")
HONOURED = ("lr", "grad_clip", "save_every", "keep", "overlap", "bucket_mb", "context_form", "compile", "float8",
            "hierarchical", "recompute", "microbatches", "pipeline_limit", "precision", "grad_reduce", "offload_bsize",
            "eval_every", "tensorboard", "matmul_peak")
Planner = Callable[..., object]   # par4d.measure.choose.planned_run (returns its Plan)
PLANNED = ("microbatches", "recompute", "overlap")   # what --grid auto chooses besides the grid, unless a flag does


def resumable(args: argparse.Namespace) -> tuple[Path, dict]:
    """(the checkpoint a --resume goes on from, its meta): the newest intact one, each one skipped said why."""
    from par4d.checkpoint import FOLDER, choose_checkpoint

    run_dir = Path(args.resume)
    if not run_dir.is_dir():
        raise ValueError(f"--resume {run_dir}: no such folder")
    if not (run_dir / FOLDER).is_dir():
        raise ValueError(f"--resume {run_dir} is not a par4d run folder (it has no {FOLDER}/ folder)")
    if args.init_from is not None:
        raise ValueError(f"--resume {run_dir} starts from the run's checkpoint; --init-from applies to a new run only")
    from par4d.folder import Folder
    from par4d.train.board import FOLDER as BOARD
    from par4d.train.run_files import METRICS, PLOT, SUMMARY

    files = Folder(run_dir)
    if files.kind(METRICS) not in (None, "file"):   # the one file a resume reads besides checkpoints
        raise ValueError(f"--resume {run_dir}: {run_dir / METRICS} is not a regular file (a link or a folder); "
                         f"par4d reads and writes only regular files inside a run folder")
    if files.kind(BOARD) not in (None, "folder"):  # TensorBoard's files go into it: a real folder of the run
        raise ValueError(f"--resume {run_dir}: {run_dir / BOARD} is not a folder of the run (a link or a file); "
                         f"par4d writes its TensorBoard files only inside the run folder (move it away)")
    for name in (SUMMARY, PLOT):     # replaced at the end (a link among them too): not a folder
        if files.kind(name) not in (None, "file", "link"):
            raise ValueError(f"--resume {run_dir}: {run_dir / name} is not a file; the run writes its {name} "
                             f"there (move it away)")
    try:
        chosen = choose_checkpoint(run_dir, report=say)     # any grid may resume it: the model is built there next
    except ValueError as error:
        raise ValueError(f"--resume {error}") from None
    folder, meta = chosen.path, chosen.meta
    from par4d.train.config import TrainConfig

    TrainConfig.check_record(meta.get("train_config"), f"{folder / 'meta.json'}: train_config")
    return folder, meta


def world_size(args: argparse.Namespace, resumed: tuple[Path, dict] | None = None) -> tuple[int, bool]:
    """(world size, whether we are inside a launched job). Without --nproc: as many ranks as
    --grid names, or as the resumed run's grid has, or DEFAULT_NPROC."""
    from par4d.launch import distributed_env

    env = distributed_env()
    if env is not None:
        if args.nproc is not None and args.nproc != env.world_size:
            raise ValueError(f"--nproc {args.nproc} but the {env.launcher} job has {env.world_size} ranks")
        return env.world_size, True
    nproc = _default_nproc(args, resumed) if args.nproc is None else args.nproc
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc, False


def _default_nproc(args: argparse.Namespace, resumed: tuple[Path, dict] | None) -> int:
    from par4d.grid import parse_grid, world_of

    if args.grid and args.grid != "auto":
        return world_of(parse_grid(args.grid))
    if resumed is not None:   # the grid it was saved on (checked by _resumable)
        return world_of(resumed[1]["train_config"]["grid"])
    return DEFAULT_NPROC


def configure(args: argparse.Namespace, world: int, inside: bool, resumed: tuple[Path, dict] | None = None,
              planner: Planner | None = None):
    """The run's ``TrainConfig``; every error a rank would raise on its grid is raised here, before any starts.
    ``planner``: what ``--grid auto`` asks (:func:`par4d.measure.choose.planned_run`: the harness stands above
    train/)."""
    from par4d.adopt.parallelize import kept_whole
    from par4d.grid import Grid, validate_sizes
    from par4d.launch import distributed_env
    from par4d.launch.host import host_memory
    from par4d.train.data import BUNDLED, read_corpus
    from par4d.train.recipes import build_model

    restarts = args.max_restarts or 0
    if restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {restarts}")
    if inside and restarts:
        raise ValueError("--max-restarts restarts par4d's own local ranks; under torchrun or srun give the "
                         "launcher's own restart option (torchrun --max-restarts N) together with --out")
    if args.resume:
        config = _resumed_config(args, world, inside, resumed or resumable(args), planner)
    else:
        config = _new_config(args, world, inside, planner)
    config = _tokens(args, config)             # the vocabulary: before any shape is checked
    if config.tensorboard:
        from par4d.train.board import check_available

        check_available()
    sizes = validate_sizes(config.grid, world)
    if config.hierarchical == "on" and not inside:
        raise ValueError("--hierarchical on stages collectives over groups that span nodes; par4d's own local ranks "
                         "share one node (run under par4d cluster, torchrun or srun across nodes, or use auto)")
    env = distributed_env()
    config.check_memory(world, env.local_world_size if env else world, host_memory())   # before it is built
    last_stage = world - world // sizes["pipe"]        # the first rank of the last pipeline stage (head, loss)
    kept: dict[str, str] = {}
    for rank in sorted({0, last_stage}):               # every rank's shape errors
        kept.update(kept_whole(build_model(config, Grid.virtual(sizes, rank))))
    for name, why in kept.items():                     # parallelize kept these whole: said, never silent
        say(f"{name} is {why}")
    batch = _named(args, "batch_size", config.batch_size)
    if config.batch_size % (sizes["data"] * sizes["z"]):
        raise ValueError(f"{batch} is not divisible by data * z = "
                         f"{sizes['data']} * {sizes['z']} = {sizes['data'] * sizes['z']}")
    per_rank = config.batch_size // (sizes["data"] * sizes["z"])
    if sizes["pipe"] > 1 and not (config.microbatches or sizes["pipe"]) <= per_rank:
        raise ValueError(f"{_named(args, 'microbatches', config.microbatches or sizes['pipe'])} exceeds the "
                         f"{per_rank} sequences per rank ({batch} / (data * z))")
    if config.init_from and not config.resume:
        recipe(config.model).check_pretrained(config)     # names the file and every number that differs
    dropped = [n for n in config.overlap_settings().names if n not in config.overlap_run().names]
    if dropped and args.overlap is not None:
        say(f"--grid pipe={sizes['pipe']}: --overlap {','.join(dropped)} do not act with a pipeline yet (its "
            f"stages run outside the model's forward and the step's own backward); this run overlaps "
            f"{config.overlap_run().describe()}")
    if recipe(config.model).data == "images" or (config.data is not None and Path(config.data).is_dir()):
        return config            # images are generated; a dataset folder was checked by _tokens
    label = None if args.data is not None or config.data is None else f"the run's data {config.data}"
    corpus = read_corpus(config.data, config.seq_len, config.data_sha256, label)   # a resume checks it is the same text
    return replace(config, data=None if corpus.source == BUNDLED else corpus.source, data_sha256=corpus.sha256)


def _grid(args: argparse.Namespace, world: int, inside: bool, dims: dict, planner: Planner | None
          ) -> tuple[dict, float | None, dict]:
    """(grid, the machine's peak where the planner measured it, the planner's other choices by setting name) from
    --grid, or a default for ``world``. Under --grid auto the planner chooses what no flag gave: the microbatches,
    recomputation and overlaps (:data:`PLANNED`) besides the grid."""
    from par4d.grid import default_grid, parse_grid

    if args.grid != "auto":
        return (parse_grid(args.grid) if args.grid else default_grid(world)), None, {}
    if dims["mlp"] == "phantom" or not recipe(dims.get("model", "gpt")).plannable:
        what = f"--model {dims.get('model', 'gpt')}" if dims["mlp"] != "phantom" else "--mlp phantom"
        raise ValueError(f"--grid auto plans par4d's GPT, dense or with --mlp moe; give --grid for {what} "
                         f"(transformers' mixtures' grids: par4d plan --model mixtral-8x7b and the other built-in "
                         f"mixtures)")
    if planner is None:
        raise ValueError("--grid auto needs the planner (par4d train passes par4d.measure.choose.planned_run)")
    plan = planner(world, machine=args.machine, inside=inside, report=say, microbatches=args.microbatches,
                   recompute=args.recompute, overlap=args.overlap, offload_bsize=args.offload_bsize,
                   bucket_mb=_bucket_mb(args, dims),
                   **{k: dims[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size", "mlp")},
                   **({k: dims[k] for k in ("experts", "top_k", "shared_experts")} if dims["mlp"] == "moe" else {}))
    # What no flag gave (microbatches None: the default, which the search timed)
    return plan.grid, plan.peak, {k: getattr(plan, k) for k in PLANNED if getattr(args, k) is None}


def _bucket_mb(args: argparse.Namespace, dims: dict) -> float:
    """The run's bucket size for the planner, checked before it calibrates or plans: --bucket-mb's, else a resumed
    run's own (``dims`` is its saved settings), else the default."""
    from par4d.overlap import check_bucket_mb

    return check_bucket_mb(args.bucket_mb if args.bucket_mb is not None else
                           dims.get("bucket_mb", default("bucket_mb")))


def _new_config(args: argparse.Namespace, world: int, inside: bool, planner: Planner | None):
    from par4d.train.config import TrainConfig
    from par4d.train.run_files import new_run_dir

    chosen = {name: getattr(args, name) for name in FIXED + HONOURED if getattr(args, name) is not None}
    model = recipe(chosen.get("model", default("model")))
    unused = [name for name in model.unused if name in chosen]
    if unused:
        raise ValueError(f"--model {model.name}: {flag(unused[0])} {chosen[unused[0]]} does not apply "
                         f"({model.unused_why})")
    if model.mixture:       # a mixture by construction: the experts' flags are its own
        chosen.setdefault("mlp", "moe")
    lonely = [name for name in MOE_SETTINGS if name in chosen]
    if lonely and not model.mixture and chosen.get("mlp", default("mlp")) != "moe":      # else silently unused
        raise ValueError(f"{flag(lonely[0])} {chosen[lonely[0]]}: a setting of a mixture of experts; give --mlp moe "
                         f"with it")
    init_from = _init_from(args.init_from)
    hf_config = None
    if init_from is not None:      # the pretrained model's shape (a flag that differs is refused)
        chosen, hf_config = model.pretrained_settings(init_from, chosen)
    dims = {name: chosen.get(name, default(name)) for name in FIXED}
    grid, peak, planned = _grid(args, world, inside, dims, planner)
    chosen.update(planned)
    # Launched here: name the new run now. Under torchrun/srun rank 0 names it later.
    out = Path(args.out) if args.out else (None if inside else new_run_dir(grid))
    if out is not None and not _restarted_in(out, inside):
        check_new_out(out)     # checked again once the run holds the folder's lock (par4d.train.lock)
    steps = default("steps") if args.steps is None else args.steps
    return TrainConfig(grid=grid, out=None if out is None else str(out), steps=steps, data=args.data,
                       progress=not args.no_progress, peak_flops=peak, init_from=init_from, hf_config=hf_config,
                       **chosen)


def _tokens(args: argparse.Namespace, config):
    """The run's data identity and vocabulary: a dataset folder (checked: finished, its tokenizer the
    run's; its vocabulary), a text file with ``--tokenizer`` (that tokenizer's), or bytes (256). A resume
    refuses another tokenizer, and a dataset folder whose index changed."""
    if recipe(config.model).data == "images":
        if args.tokenizer is not None:
            raise ValueError(f"--model {config.model} trains on generated images; --tokenizer {args.tokenizer} "
                             f"does not apply")
        return config
    from par4d.data.tokenizer import load_tokenizer

    given = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    if config.resume and given is not None and given.sha256 != config.tokenizer_sha256:
        raise ValueError(f"--resume {config.out}: --tokenizer {given.path} is not the run's tokenizer "
                         f"({config.tokenizer or 'bytes'}); a resumed run keeps the token ids it trained on")
    data = config.data
    if config.resume and data is not None and not Path(data).exists():
        raise ValueError(f"--resume {config.out}: the run's data {data} is missing (a resumed run trains on the "
                         f"data it started on: restore it there)")
    if data is not None and Path(data).is_dir():
        from par4d.data.dataset import open_dataset, sha256_of_index

        dataset = open_dataset(data, config.seq_len)
        if config.document_mask and not dataset.documents_marked:
            raise ValueError(f"--document-mask: --data {dataset.path} records no document ends (an earlier par4d "
                             f"prepared it): run par4d data prepare again")
        if given is not None and given.sha256 != dataset.tokenizer_sha256:
            raise ValueError(f"--data {dataset.path} was prepared with another tokenizer than --tokenizer "
                             f"{given.path} (SHA-256 {dataset.tokenizer_sha256[:12]}... against "
                             f"{given.sha256[:12]}...)")
        identity = sha256_of_index(data)
        if config.resume and config.data_sha256 not in (None, identity):
            raise ValueError(f"--resume {config.out}: the dataset {data} has changed since the run started (its "
                             f"index.json's SHA-256 is {identity[:12]}..., the run recorded "
                             f"{config.data_sha256[:12]}...)")
        tokenizer = given.path if given is not None else str(Path(dataset.path) / "tokenizer.json")
        config = replace(config, data=str(Path(dataset.path).resolve()), data_sha256=identity, tokenizer=tokenizer,
                         tokenizer_sha256=dataset.tokenizer_sha256, vocab_size=dataset.vocab)
    elif given is not None or config.tokenizer is not None:
        tokenizer = given or load_tokenizer(config.tokenizer, config.tokenizer_sha256)   # a resume's: unchanged
        config = replace(config, tokenizer=tokenizer.path, tokenizer_sha256=tokenizer.sha256,
                         vocab_size=tokenizer.vocab)
    if config.document_mask and not (data is not None and Path(data).is_dir()):
        raise ValueError(f"--document-mask: give --data a dataset folder of par4d data prepare (it records where "
                         f"documents end; {'--data ' + str(data) if data else 'the default text'} does not)")
    vocab = (config.hf_config or {}).get("vocab_size")
    if isinstance(vocab, int) and vocab < config.vocab_size:
        raise ValueError(f"--init-from hf {config.init_from}: the model's vocab_size {vocab} is below the "
                         f"{config.vocab_size} tokens of the run's {'tokenizer' if config.tokenizer else 'bytes'}")
    return config


def _named(args: argparse.Namespace, name: str, value) -> str:
    """How an error names a setting: the flag when the user gave it, else the run's own (a resume's saved value)."""
    if getattr(args, name, None) is not None or not args.resume:
        return f"{flag(name)} {value}"
    return f"the run's {name} {value} (train_config in its meta.json)"


def _shown(value):
    """A setting's value as a message shows it: a float as short as it reads (2e+11, not 200000000000.0)."""
    return f"{value:g}" if isinstance(value, float) else value


def _restarted_in(out: Path, inside: bool) -> bool:
    """Whether torchrun (or srun's requeue) restarted this job in its own run folder: the ranks
    go on there from the newest intact checkpoint (par4d.train.loop)."""
    from par4d.checkpoint import FOLDER
    from par4d.train.run_files import METRICS, restart_count

    return inside and restart_count() > 0 and ((out / FOLDER).is_dir() or (out / METRICS).is_file())


def _init_from(given: list[str] | None) -> str | None:
    if given is None:
        return None
    kind, folder = given
    if kind != "hf":
        raise ValueError(f"--init-from {kind} {folder}: the format must be hf (a Hugging Face model folder)")
    if not Path(folder).is_dir():
        raise ValueError(f"--init-from hf {folder}: no such folder")
    return str(Path(folder).resolve())


def _resumed_config(args: argparse.Namespace, world: int, inside: bool, resumed: tuple[Path, dict],
                    planner: Planner | None):
    """The saved run's config with what a resume may change: the grid, the step count, the HONOURED settings."""
    from par4d.grid import world_of
    from par4d.train.config import TrainConfig

    run_dir = Path(args.resume)
    folder, meta = resumed    # the newest intact checkpoint
    # Runs saved before --model trained the GPT; before --image-size, a size they had no use for.
    saved = {"model": "gpt", "image_size": default("image_size"),     # (settings newer than the run: their defaults)
             **{name: default(name) for name in HONOURED}, **meta["train_config"]}
    for name in FIXED:
        given = getattr(args, name)
        if given is not None and given != saved[name]:
            raise ValueError(f"--resume {run_dir}: {flag(name)} {given} differs from the run's {saved[name]}; "
                             f"a resumed run keeps its model, batch and seed (start a new run to change them)")
    if args.out is not None and Path(args.out).resolve() != run_dir.resolve():
        raise ValueError(f"--resume {run_dir} continues in that folder; --out {args.out} names another "
                         f"(drop --out, or copy the run there and resume the copy)")
    if args.data is not None and (saved["data"] is None or Path(args.data).resolve() != Path(saved["data"])):
        raise ValueError(f"--resume {run_dir}: --data {args.data} is not the run's data "
                         f"({saved['data'] or 'the default data'}); a resumed run trains on the text it started on")
    steps = args.steps if args.steps is not None else saved["steps"]
    if steps <= meta["step"]:
        raise ValueError(f"--resume {run_dir}: the checkpoint is at step {meta['step']}; "
                         f"pass --steps greater than that (got {steps})")
    honoured = {name: getattr(args, name) for name in HONOURED if getattr(args, name) is not None}
    for name, value in honoured.items():
        if value != saved[name]:
            say(f"{flag(name)} {_shown(value)} replaces the run's {_shown(saved[name])} from step {meta['step']}")
    grid, peak, planned = _grid(args, world, inside, saved, planner) if args.grid else (saved["grid"], None, {})
    for name, value in planned.items():
        if value != saved.get(name):
            say(f"--grid auto: {flag(name)} {_shown(value)} replaces the run's {_shown(saved.get(name))} "
                f"from step {meta['step']}")
    honoured.update(planned)
    if "matmul_peak" not in honoured and saved["matmul_peak"] and world_of(grid) != world_of(saved["grid"]):
        # The peak given was the job's (a GPU's times the ranks): another rank count measures its own
        say(f"the run's --peak-flops {saved['matmul_peak']:g} was for {world_of(saved['grid'])} ranks: measured "
            f"again on {world_of(grid)} (give --peak-flops for these)")
        honoured["matmul_peak"] = None
    shards, kept = grid.get("z", 1) * grid.get("data", 1), saved.get("microbatches")
    if (grid.get("pipe", 1) == 1 and "microbatches" not in honoured and kept is not None
            and saved["batch_size"] % shards == 0 and kept > saved["batch_size"] // shards):
        # The run's count is kept where it fits (gradient accumulation on any grid): not on this one.
        say(f"the run's --microbatches {kept} exceeds the {saved['batch_size'] // shards} samples of a "
             f"data x z shard on this grid: one microbatch per step (give --microbatches to choose)")
        honoured["microbatches"] = None
    if grid.get("pipe", 1) == 1 and "pipeline_limit" not in honoured:
        honoured["pipeline_limit"] = None
    if honoured.get("precision") == "fp32" and "offload_bsize" not in honoured:
        honoured["offload_bsize"] = None    # an fp32 run keeps no separate masters to offload
    try:
        return TrainConfig(**dict(saved, **honoured, steps=steps, out=str(run_dir), resume=True, grid=grid,
                                  progress=not args.no_progress, peak_flops=peak, checkpoint=str(folder)))
    except ValueError as error:    # a saved value out of range: the file says it, not a flag
        if any(flag(name) in str(error) for name in vars(args) if getattr(args, name) is not None):
            raise
        raise ValueError(f"{folder / 'meta.json'}: the run's saved settings are refused: {error}") from None


