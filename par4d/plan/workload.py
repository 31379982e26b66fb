"""Workloads: the matmul layers of one training iteration, with their shapes.

A layer is ``O = I W`` with ``I`` (m x k), ``W`` (k x n) as in the paper; ``m`` counts
the rows of the whole global batch (samples x sequence), and the model divides it by
``G_data`` (and ``G_z``) itself. ``count`` folds identical layers together.

:class:`GPTSpec` is par4d's GPT with a batch: its layers, parameters, FLOPs and grid rules
are those of the model's own :class:`~par4d.models.config.GPTConfig` (torch-free).
:class:`ModuleWorkload` records the layers of any ``nn.Module``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

from par4d.models.config import GPTConfig

if TYPE_CHECKING:   # torch is imported only to record a module's layers
    import torch
    import torch.nn as nn

    from par4d.overlap import Overlap


@dataclass(frozen=True)
class Layer:
    name: str
    m: int
    k: int
    n: int
    transposed: bool = False
    count: int = 1


def logit_bytes(gx: int, bytes_per_element: int) -> int:
    """Bytes per logit the loss keeps and moves (par4d.nn.loss): split over x, par4d's vocabulary-parallel
    softmax in fp32 at least; whole (G_x = 1), PyTorch's fused cross-entropy, whose log-softmax is in the
    logits' dtype."""
    return max(4, bytes_per_element) if gx > 1 else bytes_per_element


def state_bytes(params: float, bytes_per_element: int, offload_bsize: int | None = None) -> float:
    """Device bytes of ``params`` parameters' training state: the parameter and its gradient,
    and AdamW's m and v (with fp32 masters when training in 16 bits). Offloaded (the
    async-pipeline paper's memory optimisation, Section IV-B): the 16-bit parameters and
    gradients stay, ``2 x 2`` bytes each (its 4φ), the masters and optimizer state live in CPU
    memory, and the device keeps the buffers of one bucket, 16 bytes per element (its 16 bsize)."""
    if offload_bsize is not None:
        return 2 * bytes_per_element * params + 16 * offload_bsize
    return params * (2 * bytes_per_element + (12 if bytes_per_element < 4 else 8))


@dataclass
class Prediction:
    """One grid's predicted step, the terms the mixture and long-sequence planners share (their own
    subclasses add what they price besides: a mixture's exchange, the ring)."""

    sizes: dict[str, int]
    fits: bool = True
    excluded: str | None = None
    recompute: bool = False
    t_compute: float = 0.0
    t_tensor: float = 0.0         # x's all-reduces, z's gathers and reduce-scatters
    t_sync: float = 0.0           # the data-parallel sums (behind the backward)
    t_iter: float = 0.0
    mem_bytes: float = 0.0
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0              # model FLOPs (no recomputation) over the devices' peak

    def row(self) -> dict:
        """The grid's sizes and every term, flat (a JSON row)."""
        return {**self.sizes, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "sizes"}}

    def rates(self, tokens: int, world: int, flops_per_token: float, peak_flops: float) -> None:
        """Tokens a second per device and MFU from ``t_iter`` (a step of ``tokens`` on ``world`` devices)."""
        self.tokens_per_s_per_device = tokens / self.t_iter / world
        self.mfu = self.tokens_per_s_per_device * flops_per_token / peak_flops


def fit_memory(pred, footprint, machine, recompute: bool | None) -> bool:
    """Set ``pred``'s ``recompute`` (None: off where the activations fit, else on), ``mem_bytes`` (the sum of
    ``footprint(recompute)``'s terms) and, where they exceed the device, ``fits`` and ``excluded``; returns
    ``recompute``. For the mixture and long-sequence planners' predictions."""
    if recompute is None:
        recompute = sum(footprint(False).values()) > machine.memory_bytes
    pred.recompute = recompute
    pred.mem_bytes = sum(footprint(recompute).values())
    if pred.mem_bytes > machine.memory_bytes:
        pred.fits = False
        pred.excluded = f"needs {pred.mem_bytes / 1e9:.1f} GB per device, {machine.name} has " \
                        f"{machine.memory_bytes / 1e9:.0f} GB"
    return recompute


def gathered_bytes(blocks: list[float], counts: list[int], checkpointing: bool, overlap: Overlap | None) -> float:
    """Device bytes of the z-gathered weights Ŵ (``blocks``: one layer's bytes, ``counts`` of
    each). Without recomputation every layer's Ŵ is kept for backward; with it, one layer's,
    plus the ``prefetch`` layers OAG gathers ahead, or, with the cache, every layer's again."""
    if not checkpointing or (overlap is not None and overlap.cache):
        return sum(block * count for block, count in zip(blocks, counts))
    ahead = overlap.prefetch if overlap is not None and overlap.all_gather else 0
    return max(blocks) * (1 + ahead)


# Elements per token and block that par4d's GPT's element-wise kernels read and write in one forward,
# in units of the width d (docs/planner.md, "Compute"): over y, ln1 and ln2 (read, write: 2 each), the
# two residual sums (two reads, a write: 3 each), attn.proj's and mlp.proj's biases (2 each); over x,
# qkv's bias (2 x 3d), fc's (2 x 4d) and GELU (2 x 4d). The loss reads and writes the logits twice.
STREAM_PASSES, OUTPUT_PASSES, LOGIT_PASSES = 2 + 2 + 3 + 3 + 2 + 2, 6 + 8 + 8, 4
# A norm over a row split over y (par4d/nn/norm.py, _ShardedLayerNorm) is not PyTorch's fused kernel: its forward
# reads and writes the row 14 times (mean, centre, square, sum, centre again, scale, gain, bias), its backward 21
# (the two gradient products and their sums, four more in the input's gradient), where the fused kernel's count
# in STREAM_PASSES is 2 and twice that: what each of a block's two norms adds, forward and backward.
SHARDED_NORM_EXTRA = (14 - 2, 21 - 2 * 2)
# What autograd keeps per token of a block, in units of the width d, in the training dtype: over y, ln1's and
# ln2's normalized inputs and the inputs of qkv and fc; over x, q, k, v, attention's output, fc's output and
# GELU's (GPTSpec.memory_terms; tests/test_plan_memory.py measures them).
SAVED_PER_BLOCK = (2 + 2, 4 + 4 + 4)


@dataclass(frozen=True)
class GPTSpec:
    """par4d's GPT (a GPT-2 style transformer, the paper's Table I) and its batch.

    The model's arithmetic (parameters, FLOPs, layer shapes, grid rules) is :class:`GPTConfig`'s,
    of :attr:`config`; this adds the batch (``global_batch`` sequences of ``seq_len`` tokens)
    and the planner's own estimates (extra collectives, memory). Construction validates the
    model as GPTConfig does (ValueError, e.g. for ``hidden`` not divisible by ``heads``)."""

    name: str
    n_layer: int
    hidden: int
    heads: int
    NOT_RECOMPUTED: ClassVar[tuple[str, ...]] = ("head",)   # layers recomputation leaves alone (blocks only)
    seq_len: int = 2048
    global_batch: int = 2048          # sequences: 4M tokens, the paper's weak/strong scaling batch
    vocab: int = 51200

    def __post_init__(self) -> None:
        self.config  # noqa: B018  (build it now: a bad shape fails here, not mid-ranking)

    @cached_property
    def config(self) -> GPTConfig:
        """The dense GPT of this shape."""
        return GPTConfig(vocab_size=self.vocab, block_size=self.seq_len, n_layer=self.n_layer, n_head=self.heads,
                         n_embd=self.hidden)

    @classmethod
    def from_config(cls, name: str, config: GPTConfig, global_batch: int) -> GPTSpec:
        """The spec of ``config`` (dense MLP; its seed is irrelevant) with ``global_batch``
        sequences of ``config.block_size`` tokens."""
        if config.mlp != "dense":
            raise ValueError(f"GPTSpec plans the dense GPT only; GPTConfig.mlp={config.mlp!r}")
        return cls(name, n_layer=config.n_layer, hidden=config.n_embd, heads=config.n_head,
                   seq_len=config.block_size, global_batch=global_batch, vocab=config.vocab_size)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def samples(self) -> int:
        """The global batch in sequences (as :attr:`ModuleWorkload.samples`)."""
        return self.global_batch

    def params(self) -> int:
        return self._params

    @cached_property
    def _params(self) -> int:       # asked once per choice the search times: counted once
        return self.config.num_params()

    def flops_per_iteration(self, checkpointing: bool = True) -> float:
        """``tokens x GPTConfig.flops_per_token``: Narayanan et al.'s count (the async-pipeline
        paper's Eq. 3), ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` without activation
        recomputation, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` with it."""
        return self._flops[checkpointing][0]

    @cached_property
    def _flops(self) -> dict[bool, tuple[float, float]]:
        """(all FLOPs, attention FLOPs) of an iteration, without and with recomputation: counted once."""
        return {rc: (float(self.tokens * self.config.flops_per_token(recompute=rc)),
                     float(self.tokens * self.config.attention_flops_per_token(recompute=rc))) for rc in (False, True)}

    def layers(self) -> tuple[Layer, ...]:
        """The config's :meth:`~GPTConfig.linear_layers` over all the batch's rows: per block
        qkv (normal), attention proj (transposed), fc (normal), MLP proj (transposed); then the
        vocabulary head (normal)."""
        return self._layers

    @cached_property
    def _vectors_and_embeddings(self) -> tuple[int, int]:
        return self.config.vector_params(), self.config.embedding_params()

    def params_per_rank(self, sizes: dict[str, int]) -> float:
        """This rank's parameters (the whole model's, a stage holding 1/P of them): the matmul weights over x, y
        and z; the embeddings' rows over z and features over y (whole over x); biases and norm gains over the one
        of x and y their layer's features lie on."""
        vectors, embed = self._vectors_and_embeddings
        matmul = self.params() - vectors - embed
        return matmul / (sizes["x"] * sizes["y"] * sizes["z"]) + embed / (sizes["y"] * sizes["z"]) \
            + self.vectors_per_rank(sizes)

    def vectors_per_rank(self, sizes: dict[str, int]) -> float:
        """This rank's biases and norm gains: per block qkv's and fc's biases (``7 d``) over x, where those
        layers' outputs lie; the norms' weights and biases and the projections' biases (``6 d``) over y, and
        the final norm's (``2 d``)."""
        d = self.hidden
        return self.n_layer * 7 * d / sizes["x"] + (self.n_layer * 6 * d + 2 * d) / sizes["y"]

    @cached_property
    def _layers(self) -> tuple[Layer, ...]:
        return tuple(Layer(layer.name, self.tokens, layer.k, layer.n, layer.transposed, layer.count)
                     for layer in self.config.linear_layers())

    def flops_split(self, checkpointing: bool = True) -> tuple[float, float]:
        """(matmul FLOPs, attention-score FLOPs) of one iteration; they sum to
        :meth:`flops_per_iteration`. Attention (QK^T and AV, causal counted in full)
        is the ``s/(6h)`` term: ``12 B s^2 l h`` (x 4/3 with recomputation)."""
        total, attention = self._flops[checkpointing]
        return total - attention, attention

    def check(self, sizes: dict[str, int]) -> str | None:
        """Why par4d's GPT cannot run on grid ``sizes`` with this batch, or None: the
        batch's rule (samples over z and data) and :meth:`GPTConfig.grid_problem`."""
        gz, gd = sizes["z"], sizes["data"]
        problem = self.config.grid_problem(sizes)
        if problem is not None and problem.startswith("heads="):
            return problem                  # the one model rule reported before the batch's
        if self.global_batch % (gz * gd):
            return f"batch of {self.global_batch} sequences not divisible by z*data={gz * gd}"
        return problem

    def extra_collectives(self, sizes: dict[str, int]) -> list[tuple[str, tuple[str, ...], float, int, int]]:
        """Collectives outside Eqs 4-8, per iteration: (kind, axes, elements per rank, count, count a recomputed
        forward issues again). Norm statistics (the blocks' forward ones again under recomputation), the
        vocabulary-parallel loss, the embeddings' gather/scatter over z, and the gradient sync of embeddings,
        biases and norm gains."""
        gy, gz, gd = sizes["y"], sizes["z"], sizes["data"]
        rows = self.tokens / (gd * gz)
        norms = 2 * self.n_layer + 1
        _, embed = self._vectors_and_embeddings                      # wte, wpe (full size)
        return [
            ("all_gather", ("y",), 2 * rows, norms, 2 * self.n_layer),   # row [mean, M2]
            ("all_reduce", ("y",), 2 * rows, norms, 0),                 # row gradient statistics
            ("all_reduce", ("x",), rows, 1, 0),                         # loss: row max
            ("all_reduce", ("x",), 2 * rows, 1, 0),                     # loss: [sum exp, target logit]
            ("all_gather", ("z",), embed / (gy * gz) / 2, 2, 0),        # wte and wpe, one call each
            ("reduce_scatter", ("z",), embed / gy / 2, 2, 0),
            ("all_reduce", ("data",), embed / (gy * gz), 1, 0),
            ("all_reduce", ("z", "data"), self.vectors_per_rank(sizes), 1, 0),
        ]

    def memory_per_device(self, sizes: dict[str, int], bytes_per_element: int, checkpointing: bool, *,
                          share: float = 1.0, overlap: Overlap | None = None,
                          offload_bsize: int | None = None) -> float:
        """Bytes per device: the sum of :meth:`memory_terms`."""
        return sum(self.memory_terms(sizes, bytes_per_element, checkpointing, share=share, overlap=overlap,
                                     offload_bsize=offload_bsize).values())

    def memory_terms(self, sizes: dict[str, int], bytes_per_element: int, checkpointing: bool, *,
                     share: float = 1.0, overlap: Overlap | None = None,
                     offload_bsize: int | None = None) -> dict[str, float]:
        """Bytes per device, by what holds them (par4d.train.footprint measures the same terms):

        * ``states``: this rank's parameters with gradients and AdamW state (:func:`state_bytes`);
        * ``gathered``: the weights Algorithm 1 gathers over z and keeps for backward
          (:func:`gathered_bytes`; none at z = 1, where Ŵ is the shard itself);
        * ``activations``: what autograd keeps for backward from ``share`` of the step's batch (one
          microbatch's: 1/M), per token of a block (:data:`SAVED_PER_BLOCK`): over y, the two norms'
          normalized inputs and the two normal layers' inputs (``4 d / G_y``); over x, q, k, v and
          attention's output (which attn.proj reads as it is), fc's output and GELU's (``12 d / G_x``); in
          fp32, attention's log-sum-exp per head and the norms' statistics. Once: the final norm's and the
          head's inputs, the loss's softmax (:func:`logit_bytes` per token) and its targets. With recomputation, each
          block's input, and the larger of those once-terms (forward) and one block's working set (backward);
        * ``buffers``: the data-parallel buckets in flight, a flattened copy of every gradient summed over
          data (over z alone: the norms' and biases')."""
        gx, gy, gz, gd = sizes["x"], sizes["y"], sizes["z"], sizes["data"]
        b, h = bytes_per_element, self.hidden
        shard = self.params_per_rank(sizes)
        gathered = 0.0 if gz == 1 else gathered_bytes([layer.k * layer.n / (gx * gy) * b for layer in self.layers()],
                                                      [layer.count for layer in self.layers()], checkpointing, overlap)
        rows = self.tokens / (gd * gz) * share
        stream, outputs = SAVED_PER_BLOCK
        per_block = rows * (b * (stream * h / gy + outputs * h / gx) + 4 * (self.heads / gx + 2))
        once = rows * (b * 2 * h / gy + logit_bytes(gx, b) * self.vocab / gx + 4 + 8)
        # Without recomputation all of it at the end of forward; with it, every block's input, and then either
        # the loss's and head's (forward) or one block's recomputed working set (backward, theirs freed by then).
        acts = (self.n_layer * rows * h / gy * b + max(per_block, once)) if checkpointing else (
            self.n_layer * per_block + once)
        buffers = shard * b if gd > 1 else (self.vectors_per_rank(sizes) * b if gz > 1 else 0.0)
        return {"states": state_bytes(shard, b, offload_bsize), "gathered": gathered, "activations": acts,
                "buffers": buffers}

    def elementwise_bytes(self, sizes: dict[str, int], bytes_per_element: int, checkpointing: bool) -> float:
        """Bytes one device's element-wise kernels move through memory in a step (the whole model's;
        a stage's is 1/P of it): per token and block, the forward reads and writes ``14 d`` elements of
        the residual stream's layout (features over y: two norms, two residual sums, the transposed
        layers' biases) and ``22 d`` of the normal layers' outputs (over x: qkv's and fc's biases, GELU),
        backward twice that, recomputation the forward again; where y splits the row, the two norms run unfused
        (:data:`SHARDED_NORM_EXTRA` more); the loss reads and writes the logits
        (``V / G_x`` per token, :func:`logit_bytes` each) twice forward and twice backward (:data:`LOGIT_PASSES`)."""
        gx, gy, gz, gd = sizes["x"], sizes["y"], sizes["z"], sizes["data"]
        tokens = self.tokens / (gd * gz)
        passes = 4 if checkpointing else 3
        stream = passes * STREAM_PASSES
        if gy > 1:                            # the norms unfused, their forward again under recomputation
            forward, backward = SHARDED_NORM_EXTRA
            stream += 2 * (forward * (passes - 2) + backward)
        per_token = self.n_layer * bytes_per_element * self.hidden * (stream / gy + passes * OUTPUT_PASSES / gx)
        return tokens * (per_token + LOGIT_PASSES * logit_bytes(gx, bytes_per_element) * self.vocab / gx)

    def with_batch(self, global_batch: int | None = None, seq_len: int | None = None) -> GPTSpec:
        from dataclasses import replace

        return replace(self, global_batch=self.global_batch if global_batch is None else global_batch,
                       seq_len=self.seq_len if seq_len is None else seq_len)


# The paper's Table I (sequence 2048, batch 4M tokens; vocabulary 51200 assumed).
GPT_MODELS = {spec.name: spec for spec in (
    GPTSpec("gpt-5b", 24, 4096, 32),
    GPTSpec("gpt-10b", 32, 5120, 40),
    GPTSpec("gpt-20b", 32, 7168, 56),
    GPTSpec("gpt-40b", 38, 9216, 72),
    GPTSpec("gpt-80b", 42, 12288, 96),
)}


# What plan validate, its profiler and par4d bench grid measure (measure/grids.py): a
# small GPT and batch that divide every grid of 4 or 8 ranks.
MEASURED = GPTSpec.from_config("bench-gpt", GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4,
                                                      n_embd=128), global_batch=32)

def gpt_spec(name: str) -> GPTSpec:
    if name not in GPT_MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models are {', '.join(GPT_MODELS)}")
    return GPT_MODELS[name]


def layers_from_module(module: nn.Module, *example_inputs: torch.Tensor) -> list[Layer]:
    """Record the Linear and Conv2d layers a forward pass of ``module`` runs, in
    execution order, with their shapes; plain layers alternate normal/transposed as
    par4d would place them, par4d Linears keep their own orientation.

    Conv2d: in-channels x kernel area is ``k``, out-channels ``n``, and every output
    pixel of every sample a row of ``m``."""
    import torch
    import torch.nn as nn

    from par4d.nn import Linear as Par4dLinear

    seen: list[Layer] = []
    hooks = []

    def record(mod, inputs, output):
        index = len(seen)
        if isinstance(mod, Par4dLinear):
            layer = Layer(f"{type(mod).__name__}{index}", 0, mod.in_features, mod.out_features, mod.transposed)
            rows = inputs[0].numel() // inputs[0].shape[-1]
        elif isinstance(mod, nn.Linear):
            layer = Layer(f"Linear{index}", 0, mod.in_features, mod.out_features, index % 2 == 1)
            rows = inputs[0].numel() // mod.in_features
        else:  # Conv2d
            kh, kw = mod.kernel_size
            layer = Layer(f"Conv2d{index}", 0, mod.in_channels * kh * kw // mod.groups, mod.out_channels,
                          index % 2 == 1)
            rows = output.shape[0] * output.shape[-2] * output.shape[-1]
        seen.append(Layer(layer.name, rows, layer.k, layer.n, layer.transposed))

    for mod in module.modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d, Par4dLinear)):
            hooks.append(mod.register_forward_hook(record))
    try:
        with torch.no_grad():
            module(*example_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@dataclass(frozen=True)
class ModuleWorkload:
    """A workload recorded from an ``nn.Module`` (see :func:`layers_from_module`):
    only its Linear/Conv2d layers communicate; ``samples`` is the global batch."""

    name: str
    recorded: tuple[Layer, ...]
    samples: int
    NOT_RECOMPUTED: ClassVar[tuple[str, ...]] = ()     # every recorded layer is recomputed with the rest

    @classmethod
    def record(cls, module: nn.Module, *example_inputs: torch.Tensor, name: str | None = None) -> ModuleWorkload:
        samples = example_inputs[0].shape[0]
        return cls(name or type(module).__name__, tuple(layers_from_module(module, *example_inputs)), samples)

    @property
    def tokens(self) -> int:
        return self.samples

    def layers(self) -> list[Layer]:
        return list(self.recorded)

    def params(self) -> int:
        return sum(layer.k * layer.n * layer.count for layer in self.recorded)

    def params_per_rank(self, sizes: dict[str, int]) -> float:
        """This rank's parameters: every recorded layer's over x, y and z."""
        return self.params() / (sizes["x"] * sizes["y"] * sizes["z"])

    def flops_per_iteration(self, checkpointing: bool = False) -> float:
        # 2 m k n forward, 4 m k n backward, one more forward under recomputation.
        per_pass = sum(2 * layer.m * layer.k * layer.n * layer.count for layer in self.recorded)
        return per_pass * (4 if checkpointing else 3)

    def flops_split(self, checkpointing: bool = False) -> tuple[float, float]:
        return self.flops_per_iteration(checkpointing), 0.0

    def check(self, sizes: dict[str, int]) -> str | None:
        gx, gy, gz, gd = sizes["x"], sizes["y"], sizes["z"], sizes["data"]
        if self.samples % (gz * gd):
            return f"batch of {self.samples} samples not divisible by z*data={gz * gd}"
        for layer in self.recorded:
            g_in, g_out = (gx, gy) if layer.transposed else (gy, gx)
            if layer.k % g_in or layer.n % g_out or (layer.n // g_out) % gz:
                return f"{layer.name} ({layer.k} -> {layer.n}) does not divide the grid"
        return None

    def extra_collectives(self, sizes: dict[str, int]) -> list:
        return []

    def elementwise_bytes(self, sizes: dict[str, int], bytes_per_element: int, checkpointing: bool) -> float:
        """Unknown for a recorded module (only its Linear and Conv2d layers are recorded): 0."""
        return 0.0

    def memory_per_device(self, sizes: dict[str, int], bytes_per_element: int, checkpointing: bool, *,
                          share: float = 1.0, overlap: Overlap | None = None,
                          offload_bsize: int | None = None) -> float:
        """As :meth:`GPTSpec.memory_per_device`, with every layer's input kept (no recomputation)."""
        gx, gy, gz, gd = sizes["x"], sizes["y"], sizes["z"], sizes["data"]
        b = bytes_per_element
        states = state_bytes(self.params() / (gx * gy * gz), b, offload_bsize)
        gathered = sum(layer.k * layer.n / (gx * gy) * b for layer in self.recorded)
        inputs = sum(layer.m / (gd * gz) * share * layer.k / (gx if layer.transposed else gy) * b
                     for layer in self.recorded)
        return states + gathered + inputs
