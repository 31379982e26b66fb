"""The settings of a training run (no torch here: the CLI reads its defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from par4d.folder import ABSURD_BYTES, is_count
from par4d.hierarchy import MODES
from par4d.overlap import BUCKET_MB, Overlap, check_bucket_mb
from par4d.parallel import check_compile, check_context_form, check_float8
from par4d.train.recipes import recipe

if TYPE_CHECKING:
    from par4d.models.config import GPTConfig
    from par4d.models.unet import UNetConfig

VOCAB_BYTES = 256   # byte-level tokens
STATE_BYTES = 16      # per parameter at the least: its fp32 value and gradient, AdamW's two moments
CORPUS_COPIES = 2     # of the text in a rank while it loads: the bytes read and the token tensor


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on. ``grid`` maps axis -> size (missing axes are 1)."""

    grid: dict[str, int]
    out: str | None  # None: rank 0 picks a new folder under runs/ and tells the others
    steps: int = 300
    batch_size: int = 32
    seq_len: int = 128
    document_mask: bool = False      # --document-mask: attention inside a packed window's documents
    restart_positions: bool = False  # --restart-positions: positions from each document's start
    context_form: str = "ring"       # --context-form: attention on a context axis, ring or gather
    compile: str = "none"            # --compile: each block compiled as a region by this backend (par4d.compiled)
    float8: str = "none"             # --float8: the Linear layers' local GEMMs in float8 by this torchao recipe
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    model: str = "gpt"
    image_size: int = 16             # --model unet: images are image_size x image_size pixels
    mlp: str = "dense"
    phantom_k: int = 16
    experts: int = 8                 # --mlp moe: experts per block
    top_k: int = 2                   # --mlp moe: experts per token
    shared_experts: int = 0          # --mlp moe: experts every token goes through besides (0: none)
    capacity_factor: float = 0.0     # --mlp moe: an expert's capacity per rank (0: dropless)
    expert_bias_rate: float = 0.0    # --mlp moe: loss-free balancing's bias step (0: off)
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global gradient-norm limit; 0 disables
    seed: int = 0
    data: str | None = None          # the corpus's absolute path; None: Python's bundled documentation
    data_sha256: str | None = None   # its SHA-256 (a dataset folder's: its index.json's), checked on every start
    tokenizer: str | None = None     # --tokenizer: a tokenizer.json (absolute); None: bytes (a dataset's own)
    tokenizer_sha256: str | None = None   # its SHA-256: a resume, and a dataset, must have the same
    vocab_size: int = VOCAB_BYTES    # token ids are below this: the tokenizer's vocabulary, or the 256 bytes
    resume: bool = False
    save_every: int = 0
    eval_batches: int = 4
    eval_every: int = 0              # --eval-every: validation loss every N steps too (0: at the end only)
    tensorboard: bool = True         # TensorBoard event files in RUN/tensorboard (par4d.train.board)
    progress: bool = True
    peak_flops: float | None = None  # measured by the launching process; None: rank 0 measures
    matmul_peak: float | None = None  # --peak-flops: the peak given (FLOP/s, the job's), not measured
    overlap: str = "all"             # --overlap: all, none, or a comma list of par4d.overlap.NAMES
    bucket_mb: float = BUCKET_MB     # --bucket-mb: the data-parallel sync's gradient buckets, in MB
    hierarchical: str = "auto"       # --hierarchical: auto, on or off (par4d.hierarchy.MODES)
    recompute: str = "none"          # --recompute: none, auto, or every N blocks
    keep: int = 2                    # --keep: checkpoints kept
    checkpoint: str | None = None    # on --resume: the checkpoint folder chosen (verified) before the ranks start
    precision: str = "fp32"          # --precision: fp32, bf16 or fp16 compute (fp32 master weights)
    offload_bsize: int | None = None # --offload-optimizer: masters and AdamW state in CPU memory, stepped in buckets
    grad_reduce: str = "fp32"        # --grad-reduce: sum gradients over data x z in fp32 or in the compute dtype
    microbatches: int | None = None  # --microbatches: per step and rank (None: pipe; pipe = 1: accumulation)
    pipeline_limit: int | None = None  # --pipeline-limit: microbatches the first stage keeps in flight (None: pipe)
    init_from: str | None = None     # --init-from hf DIR: a model folder (absolute) the run's weights start from
    hf_config: dict | None = None    # --model hf-*: with --init-from, the folder's config.json (the model's shape)

    def __post_init__(self) -> None:
        if self.hierarchical not in MODES:     # the run's settings are the command line's: worded as its flag
            raise ValueError(f"--hierarchical {self.hierarchical!r}: choose one of {', '.join(MODES)}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        recipe(self.model).check(self)      # an unknown --model, and what the model cannot train with
        if self.grid.get("expert", 1) > 1 and self.mlp != "moe":    # nothing to spread: never a silent dense run
            raise ValueError(f"--grid expert={self.grid['expert']}: the expert axis spreads a mixture's experts over "
                             f"data's ranks; --mlp {self.mlp} has none (give --mlp moe)")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"--precision {self.precision!r}: give fp32, bf16 or fp16")
        if self.offload_bsize is not None and (self.precision == "fp32" or self.offload_bsize < 1):
            raise ValueError(f"--offload-optimizer {self.offload_bsize}: needs --precision bf16 or fp16 (got "
                             f"{self.precision}) and a bucket of >= 1 element")
        if self.grad_reduce not in ("fp32", "compute"):
            raise ValueError(f"--grad-reduce {self.grad_reduce!r}: give fp32 or compute")
        pipe = self.grid.get("pipe", 1)
        self._check_context(pipe)
        check_context_form(self.context_form)
        check_compile(self.compile)
        check_float8(self.float8)
        if self.document_mask and not recipe(self.model).documents:
            raise ValueError(f"--document-mask: --model {self.model}'s attention does not keep inside documents yet "
                             f"(par4d's GPT's and transformers' Llama's do: --model gpt or hf-llama)")
        if self.restart_positions and not self.document_mask:
            raise ValueError("--restart-positions: positions restart at each document's start, which only "
                             "--document-mask knows: give both")
        if self.document_mask and pipe > 1:
            raise ValueError(f"--document-mask with --grid pipe={pipe}: the pipeline does not carry documents yet")
        if self.microbatches is not None and pipe > 1 and self.microbatches < 1:
            raise ValueError(f"--microbatches {self.microbatches}: give a count >= 1, on a grid with pipe > 1 "
                             f"(this grid has pipe={pipe})")
        if self.microbatches is not None and pipe == 1:
            self._check_accumulation()
        if self.pipeline_limit is not None and not (pipe > 1 and self.pipeline_limit >= 1):
            raise ValueError(f"--pipeline-limit {self.pipeline_limit}: give a count >= 1 of microbatches in "
                             f"flight, on a grid with pipe > 1 (this grid has pipe={pipe})")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.save_every < 0:
            raise ValueError(f"--save-every must be >= 0 (0: only at the end), got {self.save_every}")
        if self.matmul_peak is not None and not 0 < self.matmul_peak < float("inf"):
            raise ValueError(f"--peak-flops must be a positive number of FLOP/s, got {self.matmul_peak}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.keep < 1:
            raise ValueError(f"--keep must be >= 1, got {self.keep}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"--grad-clip must be a finite number >= 0 (0 disables), got {self.grad_clip}")
        check_bucket_mb(self.bucket_mb)
        settings, every = self.overlap_settings(), self.recompute_every()   # both raise on bad values
        if settings.cache and not every:
            raise ValueError(f"--overlap {self.overlap}: the cache keeps gathered weights for recomputation; "
                             f"add --recompute auto (or N), or leave cache out of --overlap "
                             f"(e.g. --overlap {','.join(n for n in settings.names if n != 'cache') or 'none'})")

    def _check_context(self, pipe: int) -> None:
        """--grid context=C: a model whose attention runs on a cut sequence, sequences of 2C equal chunks."""
        context = self.grid.get("context", 1)
        if context == 1:
            return
        if not recipe(self.model).context:
            raise ValueError(f"--grid context={context}: --model {self.model}'s attention does not run on sequences "
                             f"cut over a context axis yet (par4d's GPT's does: --model gpt)")
        if self.seq_len % (2 * context):
            raise ValueError(f"--seq-len {self.seq_len} does not cut into 2 * context = {2 * context} equal chunks "
                             f"(context rank i holds chunks i and {2 * context - 1}-i)")

    def _check_accumulation(self) -> None:
        """--microbatches without a pipeline (gradient accumulation): 1 to a data x z shard's samples."""
        shards = self.grid.get("z", 1) * self.grid.get("data", 1)
        if self.batch_size % shards:
            if self.microbatches < 1:
                raise ValueError(f"--microbatches {self.microbatches}: give a count >= 1")
            return                           # the batch itself is refused (par4d.cli.configure names it)
        rows = self.batch_size // shards
        if not 1 <= self.microbatches <= rows:
            what = recipe(self.model).samples
            raise ValueError(f"--microbatches {self.microbatches}: a data x z shard has {rows} {what} "
                             f"(batch {self.batch_size} over z*data={shards}); give 1 to {rows}")

    @classmethod
    def check_record(cls, record: object, where: str) -> None:
        """Raise a ValueError naming ``where`` (a file and its key) unless ``record`` is a saved
        TrainConfig's fields with their types (as ``meta.json`` keeps them); ranges are checked when
        the config is built."""
        if not isinstance(record, dict):
            raise ValueError(f"{where} is {type(record).__name__}, not an object of the run's settings")
        kinds = {f.name: f.type for f in fields(cls)}
        for key, value in record.items():
            if key not in kinds:
                raise ValueError(f"{where} has {str(key)[:40]!r}, not a setting of par4d train")
            if not _of_type(value, kinds[key]):
                raise ValueError(f"{where}: {key} is {str(value)[:40]!r} ({type(value).__name__}), "
                                 f"not {kinds[key]}")
        grid = record.get("grid")
        if not (isinstance(grid, dict) and all(is_count(v, 1) for v in grid.values())):
            raise ValueError(f"{where}: grid is {str(grid)[:60]}, not axis sizes >= 1")

    def check_memory(self, world: int, ranks_here: int, memory: int | None) -> None:
        """Refuse, with the numbers, a run whose model state (at the least ``STATE_BYTES`` per
        parameter, over all ranks) or corpus (read whole by every rank) cannot fit in ``memory``
        bytes per machine (None: unknown, then only an absurd size is refused), before any model is
        built: the parameters are the recipe's count (a formula, or a model on the meta device)."""
        params = recipe(self.model).num_params(self)
        state = params * STATE_BYTES
        machines = max(1, world // max(1, ranks_here))
        sizes = recipe(self.model).sizes(self)
        if state > ABSURD_BYTES or (memory is not None and state > memory * machines):
            where = (f"this machine's {_gb(memory)} of memory" if machines == 1 else
                     f"{machines} machines of {_gb(memory)}") if memory is not None else "any machine"
            raise ValueError(f"the model ({self.model}, {sizes}) has {params:,} parameters; their values, gradients "
                             f"and AdamW state need at least {_gb(state)} over all ranks, more than {where}")
        if self.data is None or memory is None or Path(self.data).is_dir():
            return                           # (a prepared dataset is memory-mapped, never read whole)
        size = Path(self.data).stat().st_size if Path(self.data).is_file() else 0
        need = size * CORPUS_COPIES * ranks_here + size + state // machines
        if need > memory:
            raise ValueError(f"--data {self.data} has {_gb(size)}; par4d reads the text whole into each of this "
                             f"machine's {ranks_here} ranks ({CORPUS_COPIES} copies while it loads), which with the "
                             f"model needs {_gb(need)}, more than this machine's {_gb(memory)} of memory (a dataset "
                             f"that streams is not built yet: train on a part of the text)")

    def overlap_settings(self) -> Overlap:
        """``--overlap`` with ``--bucket-mb``'s buckets; ``all`` without recomputation means every overlap but the
        cache (it needs recomputation)."""
        settings = replace(Overlap.parse(self.overlap), bucket_mb=self.bucket_mb)
        if self.overlap.strip().lower() == "all" and self.recompute_every() == 0:
            return replace(settings, cache_layers=0)
        return settings

    def overlap_run(self) -> Overlap:
        """The overlaps that act in this run: ``--overlap``'s, but with a pipeline (pipe > 1) only those
        :meth:`Overlap.in_pipeline` keeps. The run says so before it starts (``par4d.cli.configure``) and its
        summary reports these."""
        settings = self.overlap_settings()
        return settings if self.grid.get("pipe", 1) == 1 else settings.in_pipeline()

    def recompute_every(self) -> int:
        """``--recompute`` as blocks per recomputed segment (0: none), as the model's recipe counts them."""
        return recipe(self.model).recompute_every(self)

    def model_config(self) -> GPTConfig | UNetConfig:
        """The model's own config (the U-Net's: ``--n-embd`` its width, ``--n-layer`` its levels)."""
        return recipe(self.model).model_config(self)

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then inverse-square-root decay. It does not depend on the
        total step count, so extending a run with --resume --steps follows the same
        trajectory an uninterrupted longer run would."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.lr * math.sqrt(self.warmup / (step + 1))


def _gb(count: int | None) -> str:
    return f"{count / 1e9:,.1f} GB"


def _of_type(value: object, annotation: str) -> bool:
    """Whether ``value`` (from JSON) fits a field annotated ``annotation`` (``int | None``, ``dict[str, int]``...)."""
    for kind in annotation.split("|"):
        kind = kind.strip().split("[")[0]
        if kind == "None" and value is None:
            return True
        if kind == "bool" and isinstance(value, bool):
            return True
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if (kind, type(value)) in (("str", str), ("dict", dict)):
            return True
    return False


DEFAULT_NPROC = 4   # local ranks when no launcher gives a world size (also calibrate's and bench grid's default)


def default(name: str):
    """The default of ``TrainConfig``'s setting ``name``."""
    return TrainConfig.__dataclass_fields__[name].default


FLAGS = {"offload_bsize": "--offload-optimizer", "matmul_peak": "--peak-flops"}   # a setting's flag, not its name's


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))
