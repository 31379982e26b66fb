"""The planner's mixtures of experts: their shapes, what a step costs on a grid with an ``expert`` axis, and a
ranking of expert sizes with x and data (docs/planner.md, "Mixtures of experts").

A :class:`MoESpec` is a decoder whose blocks are attention (grouped-query, or DeepSeek-V3's multi-head latent
attention) and either a dense gated MLP or a mixture: a router, ``experts`` gated experts of width
``expert_hidden``, ``top_k`` per token, and ``shared`` experts every token goes through. Its parameters are
counted exactly (``tests/test_plan_experts.py`` holds them to transformers' models).

A step on ``sizes`` (x, z, data and expert; ``expert`` folds over ``data`` as in par4d's grid) is priced per
rank of ``T = tokens / (z data)`` tokens:

* compute: the active matmuls' training FLOPs (6 per weight a token meets: attention, the router, its top-k
  experts and the shared ones, the head) and attention's scores, over x, at the machine's efficiency; the
  experts' share times ``imbalance`` where they are spread (the busiest rank's load over the mean: a step
  waits for it);
* the token exchange: each mixture's four all-to-alls (dispatch and combine, forward and backward) move ``T k``
  rows of ``D`` elements, ``(G - 1) / G`` of them to other ranks of the expert group of G (uniform routing):
  :func:`exchange_bytes`, what par4d's ledger counts; six with recomputation (the forward's again); inside a
  node at ``beta_intra``, across nodes the node's share at ``beta_inter``, never hidden (par4d does not
  overlap them yet);
* x's Algorithm 1 all-reduces (attention's output and the MLP's or experts' output, forward and backward);
  every rank of x holds the same tokens, so each sends the same rows: x multiplies the exchange's traffic;
* z's Algorithm 1 all-gathers of the weights (forward, and again when recomputed) and reduce-scatters of their
  gradients: every parameter cut over z, as a fully sharded data-parallel peer shards them;
* the data-parallel sums, behind the backward: the dense gradients over data, each expert's over its replicas
  (``data / G``), exposed where they take longer than the backward.

par4d's GPT with ``mlp="moe"`` is priced as the mixture it builds (:func:`gpt_spec`: GELU experts, its
parameters and FLOPs the model's own); ``--grid auto`` ranks its grids here (par4d.measure.choose).

Memory per rank: the parameters' training state (``state_bytes``: dense over x and z, experts over x, z and G),
the weights gathered over z (every layer's for backward, or one layer's with recomputation) and the
activations (a layer's inputs kept with recomputation, or an estimate of a layer's working set per token
without). y and the pipe axis are not priced for mixtures yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from par4d.models.config import GPTConfig
from par4d.plan.collectives import ring_time
from par4d.plan.cost import divisors
from par4d.plan.machines import Machine
from par4d.plan.workload import Prediction, fit_memory, state_bytes


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts decoder and its batch. ``mla``: DeepSeek-V3's attention, (q_lora, kv_lora,
    qk_nope, qk_rope, v) head dims; else grouped-query attention of ``heads`` and ``kv_heads`` heads of
    ``head_dim``. ``dense_layers``: the first blocks' MLPs are dense, of width ``dense_hidden``."""

    name: str
    n_layer: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_hidden: int
    vocab: int
    shared: int = 0
    dense_layers: int = 0
    dense_hidden: int = 0
    head_norms: bool = False                         # per-head q and k norms (Qwen3)
    mla: tuple[int, int, int, int, int] | None = None
    gated: bool = True                               # gate, up and down per expert; else fc and proj (GELU)
    extra: int = 0                                   # vectors the formulas leave out (par4d's GPT: gpt_spec)
    seq_len: int = 4096
    global_batch: int = 1024

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def moe_layers(self) -> int:
        return self.n_layer - self.dense_layers

    def attention_params(self) -> int:
        d = self.hidden
        if self.mla is None:
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return 2 * d * q + 2 * d * kv + (2 * self.head_dim if self.head_norms else 0)
        q_lora, kv_lora, nope, rope, v = self.mla
        return (d * q_lora + q_lora + q_lora * self.heads * (nope + rope) + d * (kv_lora + rope) + kv_lora
                + kv_lora * self.heads * (nope + v) + self.heads * v * d)

    def expert_params(self) -> int:
        """Every routed expert's weights, every mixture's."""
        return self.moe_layers * self.experts * self.matrices * self.hidden * self.expert_hidden

    @property
    def matrices(self) -> int:
        """An expert's weight matrices (each ``hidden x expert_hidden``)."""
        return 3 if self.gated else 2

    def params(self) -> int:
        d = self.hidden
        # (DeepSeek's score bias: a buffer)
        mixture = self.experts * d + self.matrices * d * self.expert_hidden * self.shared
        blocks = self.n_layer * (self.attention_params() + 2 * d) + self.dense_layers * 3 * d * self.dense_hidden \
            + self.moe_layers * mixture
        return self.expert_params() + blocks + 2 * self.vocab * d + d + self.extra

    def active_matmul_params(self) -> int:
        """The matmul weights one token meets: attention's, the dense MLPs', the routers', its top-k experts' and
        the shared ones', and the head's (not the embedding: a lookup)."""
        d = self.hidden
        norms = (2 * self.head_dim if self.head_norms else 0) + (
            self.mla[0] + self.mla[1] if self.mla is not None else 0)
        per_mixture = self.experts * d + self.matrices * d * self.expert_hidden * (self.top_k + self.shared)
        return self.n_layer * (self.attention_params() - norms) + self.dense_layers * 3 * d * self.dense_hidden \
            + self.moe_layers * per_mixture + self.vocab * d

    def attention_dims(self) -> tuple[int, int]:
        """(query-key width, value width) of all heads together."""
        if self.mla is None:
            return self.heads * self.head_dim, self.heads * self.head_dim
        _, _, nope, rope, v = self.mla
        return self.heads * (nope + rope), self.heads * v

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per active matmul weight, and attention's scores and weighted sum over the
        sequence (forward and backward, causal counted in full, as par4d's GPT and torchtitan count them)."""
        qk, v = self.attention_dims()
        return 6 * self.active_matmul_params() + 6 * self.n_layer * self.seq_len * (qk + v)

    def expert_flops_per_token(self) -> float:
        """The routed experts' share of :meth:`flops_per_token`."""
        return 6 * self.moe_layers * self.top_k * self.matrices * self.hidden * self.expert_hidden

    def with_batch(self, global_batch: int, seq_len: int) -> MoESpec:
        return replace(self, global_batch=global_batch, seq_len=seq_len)


# Built-in shapes (their config.json files on the Hugging Face Hub; DeepSeek-V3 without its multi-token
# prediction module).
MOE_MODELS = {spec.name: spec for spec in (
    MoESpec("mixtral-8x7b", n_layer=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, experts=8, top_k=2,
            expert_hidden=14336, vocab=32000),
    MoESpec("qwen3-30b-a3b", n_layer=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
            expert_hidden=768, vocab=151936, head_norms=True),
    MoESpec("qwen3-235b-a22b", n_layer=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, experts=128, top_k=8,
            expert_hidden=1536, vocab=151936, head_norms=True),
    MoESpec("deepseek-v3-671b", n_layer=61, hidden=7168, heads=128, kv_heads=128, head_dim=128, experts=256, top_k=8,
            expert_hidden=2048, vocab=129280, shared=1, dense_layers=3, dense_hidden=18432,
            mla=(1536, 512, 128, 64, 128)),
)}


def exchange_bytes(spec: MoESpec, sizes: dict[str, int], bytes_per_element: int,
                   leaving: float | None = None) -> float:
    """Bytes one rank's token exchanges send in a step: per mixture four all-to-alls (dispatch and combine,
    and their backward) of the rank's ``tokens / (data z) * k`` rows of ``hidden / y`` elements, the share
    ``leaving`` of them to other ranks (uniform routing: ``(G - 1) / G``)."""
    spread = sizes.get("expert", 1)
    share = (spread - 1) / spread if leaving is None else leaving
    rows = spec.tokens / (sizes["data"] * sizes.get("z", 1)) * spec.top_k
    return 4 * spec.moe_layers * rows * share * spec.hidden / sizes.get("y", 1) * bytes_per_element


@dataclass
class MoEPrediction(Prediction):
    t_exchange: float = 0.0       # the all-to-alls (never hidden)
    exchange_bytes: float = 0.0


def problem(spec: MoESpec, sizes: dict[str, int]) -> str | None:
    """Why ``spec`` cannot run on ``sizes``, or None."""
    gx, gz, data, spread = sizes["x"], sizes["z"], sizes["data"], sizes["expert"]
    if spec.experts % spread:
        return f"expert={spread} does not divide the {spec.experts} experts"
    if data % spread:
        return f"expert={spread} does not divide data={data} (it folds over data)"
    if spec.global_batch % (gz * data):
        return f"batch of {spec.global_batch} sequences not divisible by z*data={gz * data}"
    if spec.kv_heads % gx or spec.heads % gx:
        return f"x={gx} does not divide the {spec.heads} query and {spec.kv_heads} key/value heads"
    # As Algorithm 1 cuts a matmul: out-features over x, then each block's rows over z; in-features over y
    # (y = 1 here), the embedding's rows over z
    for what, size, parts in (("the experts' width", spec.expert_hidden, gx * gz),
                              ("the dense MLPs' width", spec.dense_hidden if spec.dense_layers else gx * gz, gx * gz),
                              ("the hidden size", spec.hidden, gz), ("the vocabulary", spec.vocab, gz)):
        if size % parts:
            return f"x*z={gx * gz} does not divide {what} {size}" if parts == gx * gz else \
                f"z={gz} does not divide {what} {size}"
    return None


def memory_terms(spec: MoESpec, sizes: dict[str, int], b: int, recompute: bool) -> dict[str, float]:
    """Bytes per device: the parameters' training state (experts over x and the expert group, the rest over x;
    the embedding and the head over x as Algorithm 1's) and the activations: with recomputation each layer's
    input (``T D``), plus one layer's working set; without, every layer's, estimated per token as attention's
    q, k, v, scores' log-sum-exp and output and the norms' inputs (``(4 D + 2 (qk + v)) / x``) and a mixture's
    rows (``k (D + 3 I / x)``: the rows received, gate, up and their product; ``2 I`` for GELU experts: fc's output
    and its GELU)."""
    gx, gz, spread = sizes["x"], sizes["z"], sizes["expert"]
    dense = spec.params() - spec.expert_params()
    params = dense / (gx * gz) + spec.expert_params() / (gx * gz * spread)
    layer = (spec.attention_params() + spec.experts / spread * spec.matrices * spec.hidden * spec.expert_hidden) / gx
    gathered = 0.0 if gz == 1 else b * layer * (1 if recompute else spec.n_layer)
    tokens = spec.tokens / (sizes["data"] * gz)
    qk, v = spec.attention_dims()
    per_layer = b * ((4 * spec.hidden + 2 * (qk + v)) / gx
                     + spec.top_k * (spec.hidden + spec.matrices * spec.expert_hidden / gx))
    activations = tokens * (spec.n_layer * b * spec.hidden + per_layer) if recompute \
        else tokens * spec.n_layer * per_layer
    return {"states": state_bytes(params, b), "gathered": gathered, "activations": activations}


def predict(spec: MoESpec, sizes: dict[str, int], machine: Machine, imbalance: float = 1.0,
            recompute: bool | None = None) -> MoEPrediction:
    """One step of ``spec`` on ``sizes`` (x, z, data, expert) of ``machine`` (see the module's docstring);
    ``recompute`` None: off where the activations fit, else on."""
    sizes = {"x": sizes.get("x", 1), "z": sizes.get("z", 1), "data": sizes["data"], "expert": sizes.get("expert", 1)}
    pred = MoEPrediction(dict(sizes))
    reason = problem(spec, sizes)
    if reason is not None:
        pred.fits, pred.excluded = False, reason
        return pred
    b, gx, gz, data, spread = (machine.bytes_per_element, sizes["x"], sizes["z"], sizes["data"], sizes["expert"])
    recompute = fit_memory(pred, lambda again: memory_terms(spec, sizes, b, again), machine, recompute)
    tokens = spec.tokens / (gz * data)
    expert = spec.expert_flops_per_token()
    wait = imbalance if spread > 1 else 1.0           # every expert on each rank: its own tokens, no one to wait for
    flops = tokens * (spec.flops_per_token() - expert + expert * wait) / gx
    if recompute:
        flops *= 4 / 3                                     # the forward again
    pred.t_compute = flops / (machine.peak_flops * machine.efficiency)
    dpn = machine.devices_per_node
    # The expert group: G data ranks x z apart; its peers outside a node's dpn / (x z) data ranks cross the
    # network, where the node's dpn ranks share its links
    # Recomputation runs each forward's exchanges and x's all-reduces again: 6 passes of them, not 4
    again = 1.5 if recompute else 1.0
    pred.exchange_bytes = exchange_bytes(spec, sizes, b) * again
    inside = min(spread, max(1, dpn // (gx * gz)))
    far = (spread - inside) / max(spread - 1, 1)
    latency = machine.latency_inter if far and machine.latency_inter is not None else machine.latency
    pred.t_exchange = max(pred.exchange_bytes * (1 - far) / machine.beta_intra,
                          pred.exchange_bytes * far * min(dpn, gx * gz * spread) / machine.beta_inter) \
        + 4 * again * spec.moe_layers * (spread - 1) * latency
    # x: attention's and the MLP's (a mixture's: its k rows') outputs summed, forward and backward
    beta_x = machine.beta_intra if gx <= dpn else machine.beta_inter / dpn
    rows = spec.n_layer * tokens * (1 + 1) + spec.moe_layers * tokens * (spec.top_k - 1)
    pred.t_tensor = 2 * again * ring_time("all_reduce", gx, rows * spec.hidden * b, beta_x, machine.latency)
    # z: each layer's weights gathered in forward (and again when recomputed), their gradients reduce-scattered
    beta_z = machine.beta_intra if gx * gz <= dpn else machine.beta_inter / min(dpn, gx)
    held = ((spec.params() - spec.expert_params()) / gx + spec.expert_params() / (gx * spread)) * b
    gathers = 2 if recompute else 1
    pred.t_tensor += gathers * ring_time("all_gather", gz, held / gz, beta_z, machine.latency) \
        + ring_time("reduce_scatter", gz, held / gz, beta_z, machine.latency)
    # The data-parallel sums: dense gradients over data, experts' over their data / G replicas
    beta_data = machine.beta_intra if gx * gz * data <= dpn else machine.beta_inter / min(dpn, gx * gz)
    dense = (spec.params() - spec.expert_params()) / (gx * gz) * b
    experts = spec.expert_params() / (gx * gz * spread) * b
    pred.t_sync = ring_time("all_reduce", data, dense, beta_data, machine.latency) \
        + ring_time("all_reduce", data // spread, experts, beta_data, machine.latency)
    backward = pred.t_compute * (2 / 3 if not recompute else 2 / 4)
    pred.t_iter = pred.t_compute + pred.t_exchange + pred.t_tensor + max(0.0, pred.t_sync - backward)
    pred.rates(spec.tokens, gx * gz * data, spec.flops_per_token(), machine.peak_flops)
    return pred


def rank_grids(spec: MoESpec, world: int, machine: Machine, imbalance: float = 1.0, recompute: bool | None = None
               ) -> tuple[list[MoEPrediction], list[MoEPrediction]]:
    """(every (x, z, data, expert) of ``world`` devices that fits, fastest first; the others, with why);
    ``recompute`` as :func:`predict` takes it."""
    fitting, excluded = [], []
    for gx in divisors(world):
        for gz in divisors(world // gx):
            data = world // (gx * gz)
            for spread in divisors(data):
                pred = predict(spec, {"x": gx, "z": gz, "data": data, "expert": spread}, machine, imbalance,
                               recompute)
                (fitting if pred.fits else excluded).append(pred)
    fitting.sort(key=lambda p: p.t_iter)
    return fitting, excluded


def gpt_spec(config: GPTConfig, global_batch: int) -> MoESpec:
    """par4d's GPT with ``mlp="moe"`` as the planner's mixture: multi-head attention, GELU experts of the dense
    MLP's shape (``4 n_embd`` wide), ``extra`` what the decoder's formulas leave out: per block the attention's
    biases (4 d) and the LayerNorms' biases (2 d), the final LayerNorm's bias (d) and the learned positions
    (T d)."""
    if config.mlp != "moe":
        raise ValueError(f"gpt_spec: GPTConfig.mlp={config.mlp!r} is not a mixture (the dense GPT's is GPTSpec)")
    d = config.n_embd
    return MoESpec("gpt", n_layer=config.n_layer, hidden=d, heads=config.n_head, kv_heads=config.n_head,
                   head_dim=d // config.n_head, experts=config.experts, top_k=config.top_k, expert_hidden=4 * d,
                   vocab=config.vocab_size, shared=config.shared_experts, gated=False,
                   extra=(6 * config.n_layer + 1 + config.block_size) * d, seq_len=config.block_size,
                   global_batch=global_batch)


def moe_spec(name: str) -> MoESpec:
    if name not in MOE_MODELS:
        raise ValueError(f"unknown mixture {name!r}; built-in mixtures are {', '.join(MOE_MODELS)}")
    return MOE_MODELS[name]


def batch_of(spec: MoESpec, batch_tokens: int, seq_len: int) -> MoESpec:
    """``spec`` with a batch of ``batch_tokens`` tokens in sequences of ``seq_len``."""
    if batch_tokens % seq_len:
        raise ValueError(f"--batch-tokens {batch_tokens} is not a multiple of --seq-len {seq_len}")
    return spec.with_batch(batch_tokens // seq_len, seq_len)

