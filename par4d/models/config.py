"""GPT configuration, its arithmetic (parameters, FLOPs, layer shapes, grid rules), and
the initialization both twins share. Pure Python: torch is imported only by :func:`init_tensor`,
so the planner (``par4d plan``) reads the model's arithmetic without it."""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class LinearShape(NamedTuple):
    """One kind of par4d Linear in the GPT: ``in_features`` k -> ``out_features`` n, ``count`` of them.

    ``transposed`` layers take features over x and give them over y (normal ones y -> x);
    ``out_chunks`` equal parts of the output are split over the grid separately (qkv's q, k, v)."""

    name: str
    k: int
    n: int
    transposed: bool
    out_chunks: int
    count: int


def balanced_stages(costs: list[float], stages: int, last: float = 0.0) -> list[range]:
    """The blocks of each of ``stages`` pipeline stages: contiguous runs, at least one block each,
    that minimise the largest stage's cost, block i costing ``costs[i]``, the last stage also ``last``
    (the head and the loss). Ties go to the earliest boundary. Dynamic programming over (stages,
    blocks); each run's cost summed correctly rounded (``math.fsum``), so equal costs tie exactly
    wherever the runs lie."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"pipe={stages}: each stage needs at least one of the n_layer={n} blocks")
    run = [[math.fsum(costs[j:m]) for m in range(n + 1)] for j in range(n + 1)]   # run[j][m]: blocks j .. m-1
    # best[k][m]: the least possible largest-stage cost of the first m blocks in k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for m in range(k, n + 1):
            for j in range(k - 1, m):       # the last of these k stages holds blocks j .. m-1
                cost = run[j][m] + (last if k == stages and m == n else 0.0)
                worst = max(best[k - 1][j], cost)
                if worst < best[k][m]:
                    best[k][m], cut[k][m] = worst, j
    bounds, m = [], n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k][m], m))
        m = cut[k][m]
    return bounds[::-1]


MLPS = ("dense", "phantom", "moe")


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder: learned positions, pre-LN blocks, GELU MLP, untied head, no dropout.

    With ``d = n_embd``, ``L = n_layer``, ``V = vocab_size``, ``T = block_size``, a dense model has
    ``V d + T d`` embedding parameters, ``L (12 d^2 + 13 d) + 2 d`` in its blocks and final norm, and
    ``d V`` in its head (no bias)."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    seed: int = 0
    mlp: str = "dense"       # "phantom": phantom layers over x (phantom parallelism); "moe": a mixture of experts
    phantom_k: int = 16      # ghost neurons per phantom layer
    phantom_p: int = 1       # ranks of the phantom axis (x); a phantom model's shape depends on it
    experts: int = 1         # mlp="moe": experts per block (each the dense MLP's shape, without biases)
    top_k: int = 1           # mlp="moe": experts per token
    shared_experts: int = 0  # mlp="moe": experts every token goes through besides (0: none)
    capacity_factor: float = 0.0    # mlp="moe": an expert's capacity per rank over its share (0: dropless)
    expert_bias_rate: float = 0.0   # mlp="moe": loss-free balancing's bias step (0: off)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            low = 0 if name == "shared_experts" else 1
            if name in ("capacity_factor", "expert_bias_rate"):
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise ValueError(f"GPTConfig.{name}={value!r} must be a finite number >= 0 (0: off)")
            elif name not in ("seed", "mlp") and (not isinstance(value, int) or value < low):
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.mlp not in MLPS:
            raise ValueError(f"GPTConfig.mlp={self.mlp!r}; valid: {', '.join(map(repr, MLPS))}")
        if self.mlp == "moe" and not (2 <= self.experts and 1 <= self.top_k <= self.experts):
            raise ValueError(f"GPTConfig: mlp='moe' needs experts >= 2 and top_k from 1 to experts (got "
                             f"experts={self.experts}, top_k={self.top_k})")
        if self.mlp == "phantom" and (self.n_embd % self.phantom_p or (4 * self.n_embd) % self.phantom_p):
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by phantom_p={self.phantom_p}")

    def _linears(self) -> list[LinearShape]:
        """The dense Linears, in execution order; a phantom model's MLP layers are not among them."""
        d, layers = self.n_embd, self.n_layer
        mlp = [LinearShape("mlp.fc", d, 4 * d, False, 1, layers),
               LinearShape("mlp.proj", 4 * d, d, True, 1, layers)] if self.mlp == "dense" else []
        return [LinearShape("qkv", d, 3 * d, False, 3, layers),
                LinearShape("attn.proj", d, d, True, 1, layers),
                *mlp,
                LinearShape("head", d, self.vocab_size, False, 1, 1)]

    def linear_layers(self) -> list[LinearShape]:
        """The GPT's matmul layers, one entry per kind, in execution order: per block qkv
        (d -> 3d, normal, 3 out-chunks), attn.proj (d -> d, transposed), mlp.fc (d -> 4d, normal),
        mlp.proj (4d -> d, transposed), ``n_layer`` of each; then head (d -> V, normal, no bias).

        Dense MLP only: a phantom MLP (``mlp="phantom"``) has no such fc/proj Linears, and listing
        the others alone would undercount its work, so a phantom config raises ValueError (the
        planner plans the dense GPT only)."""
        if self.mlp != "dense":
            raise ValueError(f"GPTConfig.mlp={self.mlp!r}: only a dense MLP has Linear layers to list")
        return self._linears()

    def _phantom_mlp_weights(self) -> int:
        d, p, k = self.n_embd, self.phantom_p, self.phantom_k
        # Per phantom layer: local blocks, compressors, decompressors (docs/phantom.md, Notation); its bias is a vector.
        return sum(n_in * n_out // p + k * n_in + (p - 1) * k * n_out for n_in, n_out in ((d, 4 * d), (4 * d, d)))

    def _moe_weights(self, active: bool) -> int:
        """A mixture's weights per block: the router's, every expert's and the shared ones' (``active``: the
        top-k experts a token goes through, the shared ones and the router: its multiply-adds per token)."""
        d = self.n_embd
        return self.experts * d + ((self.top_k if active else self.experts) + self.shared_experts) * 2 * d * 4 * d

    def _matmul_weights(self, active: bool = False) -> int:
        """Weights of every matmul (``active``: those a token goes through, its multiply-adds), the head's
        included."""
        phantom = self.n_layer * self._phantom_mlp_weights() if self.mlp == "phantom" else 0
        moe = self.n_layer * self._moe_weights(active) if self.mlp == "moe" else 0
        return sum(layer.k * layer.n * layer.count for layer in self._linears()) + phantom + moe

    def embedding_params(self) -> int:
        """Token and position embeddings: ``(V + T) d``."""
        return (self.vocab_size + self.block_size) * self.n_embd

    def vector_params(self) -> int:
        """Biases and norm gains: ``13 d`` per block (two LayerNorms' weight and bias 4d, qkv 3d,
        attn.proj d, fc 4d, proj d: a phantom layer has the same bias) and the final norm's ``2 d``."""
        d = self.n_embd
        mlp = 0 if self.mlp == "moe" else 4 * d + d          # experts have no biases
        return self.n_layer * (2 * 2 * d + 3 * d + d + mlp) + 2 * d

    def num_params(self) -> int:
        """Parameters of the model (embeddings included), from the shapes alone."""
        return self.embedding_params() + self._matmul_weights() + self.vector_params()

    def _passes(self, recompute: bool) -> int:
        # Forward + backward = 3 forwards; activation recomputation runs the forward once more.
        return 4 if recompute else 3

    def attention_flops_per_token(self, recompute: bool = False) -> int:
        """Training FLOPs per token of causal attention's QK^T and AV, counted in full:
        ``2 T d`` multiply-adds per block, 2 FLOPs each, times 3 passes (4 with ``recompute``)."""
        return self._passes(recompute) * 2 * self.n_layer * 2 * self.block_size * self.n_embd

    def flops_per_token(self, recompute: bool = False) -> int:
        """Training FLOPs per token (forward + backward = 3x forward): 2 per matmul
        multiply-add of every Linear, plus causal attention's QK^T and AV counted in full
        (:meth:`attention_flops_per_token`).

        ``recompute``: activation recomputation per block, as Narayanan et al. count it: the
        blocks run their forward twice (x 4/3), the head once. Over a batch of ``B T`` tokens
        this is their ``72 B T L d^2 (1 + T/(6d) + V/(12 L d))`` (``96 ... (1 + T/(6d) + V/(16 L d))``)."""
        head = self.n_embd * self.vocab_size
        blocks = 2 * (self._matmul_weights(active=True) - head)
        return self._passes(recompute) * blocks + self.attention_flops_per_token(recompute) + 3 * 2 * head

    def narayanan_flops(self, batch: int) -> float:
        """The async-pipeline paper's Eq 3 numerator (Narayanan et al.'s count, activation
        recomputation included): ``96 b s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs for one batch
        of ``batch`` sequences of ``block_size`` tokens; divide by the seconds per batch."""
        b, s, l, h, v = batch, self.block_size, self.n_layer, self.n_embd, self.vocab_size
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def stage_blocks(self, stages: int) -> list[range]:
        """The blocks of each of ``stages`` pipeline stages: contiguous runs, at least one block
        each, that minimise the largest stage's training FLOPs per token, where the first stage
        also embeds and the last also runs ``ln_f``, the head and the loss (the head's FLOPs count
        there: for a small model it is worth blocks). Ties go to the earliest boundary."""
        if not 1 <= stages <= self.n_layer:
            raise ValueError(f"pipe={stages}: each stage needs at least one of the n_layer={self.n_layer} blocks")
        head = 3 * 2 * self.n_embd * self.vocab_size
        block = (self.flops_per_token() - head) / self.n_layer
        return balanced_stages([block] * self.n_layer, stages, last=head)

    def grid_problem(self, sizes: dict[str, int]) -> str | None:
        """Why par4d's GPT cannot be built on grid ``sizes`` (axes x, y, z), or None.

        The layers' own rules: heads split over x; embedding rows (V and T) over z; each
        Linear with ``(g_in, g_out) = (x, y)`` if transposed else ``(y, x)`` needs ``k % g_in``,
        ``n % (out_chunks g_out)`` and ``(n / g_out) % z``; the residual stream's d over y.
        The batch is not part of the model (its rule is the workload's). A mixture's experts are cut as
        the dense MLP (par4d.nn.moe.check_expert_shape); a phantom MLP has no rules here (see
        :meth:`linear_layers`). The expert axis's rules are the mixture's (par4d.nn.moe.check_moe)."""
        gx, gy, gz = sizes["x"], sizes["y"], sizes["z"]
        layers = (replace(self, mlp="dense") if self.mlp == "moe" else self).linear_layers()
        if self.n_head % gx:
            return f"heads={self.n_head} not divisible by x={gx}"
        if self.vocab_size % gz or self.block_size % gz:
            return f"embedding rows (vocab={self.vocab_size}, seq_len={self.block_size}) not divisible by z={gz}"
        for layer in layers:
            g_in, g_out = (gx, gy) if layer.transposed else (gy, gx)
            if layer.k % g_in or layer.n % (layer.out_chunks * g_out) or (layer.n // g_out) % gz:
                return f"{layer.name} ({layer.k} -> {layer.n}) does not divide the grid"
        if self.n_embd % gy:
            return f"hidden={self.n_embd} not divisible by y={gy}"
        return None


def recompute_spacing(n_blocks: int, total: int | None = None) -> int:
    """The async-pipeline paper's spacing (Section V-A): recompute every ``a`` blocks, ``a``
    the divisor of the block count closest to the square root of ``total`` (the model's
    block count; default ``n_blocks``), the smaller on a tie. With a pipeline ``n_blocks``
    is the blocks per stage."""
    if n_blocks < 1:
        raise ValueError(f"recompute spacing of {n_blocks} blocks: need at least one block")
    divisors = [a for a in range(1, n_blocks + 1) if n_blocks % a == 0]
    return min(divisors, key=lambda a: (abs(a - math.sqrt(total or n_blocks)), a))


def parse_recompute(text: str | int | None, n_blocks: int, total: int | None = None) -> int:
    """``none`` (0: no recomputation), ``auto`` (:func:`recompute_spacing`) or ``N``: every
    N blocks, N a divisor of the block count (the CLI's ``--recompute``). With a pipeline,
    ``n_blocks`` is what every stage's block count is a multiple of, ``total`` the model's."""
    if text is None:
        return 0
    value = str(text).strip().lower()
    if value == "none":
        return 0
    if value == "auto":
        return recompute_spacing(n_blocks, total)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--recompute {text!r}: give none, auto, or a block count N >= 1")
    every = int(value)
    if n_blocks % every:
        divisors = ", ".join(str(a) for a in range(1, n_blocks + 1) if n_blocks % a == 0)
        what = f"the {n_blocks} blocks" if total is None else f"the pipeline stages' blocks (multiples of {n_blocks})"
        raise ValueError(f"--recompute {every}: {what} do not split into segments of {every}; "
                         f"give a divisor of {n_blocks}: {divisors}")
    return every


def init_tensor(config: GPTConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of parameter ``name``: a function of (seed, name) alone.

    GPT-2's scheme: N(0, 0.02) weights and embeddings, residual projections scaled
    by 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains.
    """
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if ".ln" in f".{name}" and leaf == "weight":
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = 0.02
    if name.endswith("proj.weight"):
        std /= math.sqrt(2 * config.n_layer)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std
