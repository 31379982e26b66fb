"""The planner's long sequences: a dense decoder with grouped-query attention trained on sequences cut over a
context axis (docs/planner.md, "Long sequences"), and a ranking of context sizes with x, z and data.

A :class:`LongSpec` is a Llama-like decoder: attention of ``heads`` query and ``kv_heads`` key/value heads of
``head_dim``, a gated MLP of width ``ffn``, untied embedding and head. A step on ``sizes`` (x, z, context and
data; context inside data in the rank layout, as par4d's grid) is priced per rank, holding ``rows`` sequences'
``T / C`` tokens each:

* compute: 6 FLOPs per matmul weight a token meets, over x, and causal attention's work: the ring computes
  only the blocks at or before the diagonal, half the full ``T x T`` (its count for MFU is the full one, as
  torchtitan's); with recomputation the forward again;
* the ring (:func:`ring_bytes`, what par4d's ledger counts): per layer, forward C - 1 blocks of keys and values
  (grouped-query: ``kv_heads``, over x) of a rank's ``T / C`` tokens, backward C - 1 again and C gradient sums
  (and the forward's again with recomputation). Each block travels while the attention of the block before
  is computed: a step exposes only what its transfer takes beyond that attention;
* x's all-reduces (attention's and the MLP's outputs, forward and backward), z's weight gathers and
  gradient reduce-scatters, and the data-parallel sums (over context and data, behind the backward), as
  the mixture planner prices them;
* memory: the training state (over x and z) and the activations of a rank's tokens (a C-th of the
  sequence), every layer's or, recomputed, each layer's input plus one layer's.

The all-gather form (``--context-form gather``: a layer's keys and values all-gathered over context once,
their gradients reduce-scattered; the same bytes as the ring, in one collective each, not hidden) is priced
beside it, and each grid takes the faster form (few key heads and short sequences favour it: its latency is
one collective's, the ring's 2C - 1 steps'). y and the pipe axis are not priced here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from par4d.plan.collectives import ring_time
from par4d.plan.cost import divisors
from par4d.plan.machines import Machine
from par4d.plan.workload import Prediction, fit_memory, state_bytes


@dataclass(frozen=True)
class LongSpec:
    name: str
    n_layer: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    seq_len: int = 131072
    global_batch: int = 8

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def layer_matmul_params(self) -> int:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv + 3 * d * self.ffn

    def params(self) -> int:
        """Every parameter: the blocks' matmuls and two RMS norms, the embedding, the head, the final norm."""
        return self.n_layer * (self.layer_matmul_params() + 2 * self.hidden) + 2 * self.vocab * self.hidden \
            + self.hidden

    def matmul_flops_per_token(self) -> float:
        return 6 * (self.n_layer * self.layer_matmul_params() + self.vocab * self.hidden)

    def attention_flops_per_token(self, causal: bool) -> float:
        """Scores and the weighted sum over the sequence, forward and backward: the full ``T x T`` count
        (torchtitan's, for MFU), or half of it (the work a causal ring does)."""
        full = 12 * self.n_layer * self.heads * self.head_dim * self.seq_len
        return full / 2 if causal else full

    def flops_per_token(self) -> float:
        return self.matmul_flops_per_token() + self.attention_flops_per_token(causal=False)

    def with_batch(self, global_batch: int, seq_len: int) -> LongSpec:
        return replace(self, global_batch=global_batch, seq_len=seq_len)


LONG_MODELS = {spec.name: spec for spec in (
    LongSpec("llama3-8b", n_layer=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
)}


def ring_bytes(spec: LongSpec, sizes: dict[str, int], bytes_per_element: int, recompute: bool = False) -> float:
    """Bytes one rank sends around the context ring in a step (``send`` entries of par4d's ledger): per layer
    forward C - 1 blocks, backward C - 1 and C gradient sums, and C - 1 again with recomputation; a block is a
    rank's ``rows`` sequences' ``T / C`` tokens of keys and values (``kv_heads / x`` heads)."""
    spread = sizes.get("context", 1)
    if spread == 1:
        return 0.0
    block = 2 * _rows(spec, sizes) * spec.seq_len / spread * spec.kv_heads / sizes.get("x", 1) * spec.head_dim
    passes = (spread - 1) * (3 if recompute else 2) + spread
    return spec.n_layer * passes * block * bytes_per_element


def _rows(spec: LongSpec, sizes: dict[str, int]) -> float:
    return spec.global_batch / (sizes.get("z", 1) * sizes.get("data", 1))


@dataclass
class LongPrediction(Prediction):
    t_ring: float = 0.0           # the ring's transfers beyond the attention they travel behind (or the gathers)
    form: str = "ring"            # the faster: ring or gather
    ring_bytes: float = 0.0


def problem(spec: LongSpec, sizes: dict[str, int]) -> str | None:
    gx, gz, spread, data = sizes["x"], sizes["z"], sizes["context"], sizes["data"]
    if spec.seq_len % (2 * spread):
        return f"context={spread}: sequences of {spec.seq_len} do not cut into {2 * spread} equal chunks"
    if spec.global_batch % (gz * data):
        return f"batch of {spec.global_batch} sequences not divisible by z*data={gz * data}"
    if spec.heads % gx or spec.kv_heads % gx:
        return f"x={gx} does not divide the {spec.heads} query and {spec.kv_heads} key/value heads"
    for what, size, parts in (("the MLP's width", spec.ffn, gx * gz), ("the vocabulary", spec.vocab, gx * gz),
                              ("the hidden size", spec.hidden, gz)):
        if size % parts:
            return f"{'x*z' if parts == gx * gz else 'z'}={parts} does not divide {what} {size}"
    return None


def memory_terms(spec: LongSpec, sizes: dict[str, int], b: int, recompute: bool) -> dict[str, float]:
    """Bytes per device: the training state (over x and z), the weights gathered over z, and the activations
    of a rank's ``rows x T / C`` tokens, per layer and token estimated as the norms' inputs and the residual
    (4 D), attention's q, k, v, output and log-sum-exp (``(2 H + 2 H_kv) hd / x``) and the MLP's gate, up
    and product (``3 F / x``)."""
    gx, gz = sizes["x"], sizes["z"]
    tokens = _rows(spec, sizes) * spec.seq_len / sizes["context"]
    layer = (4 * spec.hidden + ((2 * spec.heads + 2 * spec.kv_heads) * spec.head_dim + 3 * spec.ffn) / gx) * b
    activations = tokens * (spec.n_layer * spec.hidden * b + layer) if recompute else tokens * spec.n_layer * layer
    gathered = 0.0 if gz == 1 else b * spec.layer_matmul_params() / gx * (1 if recompute else spec.n_layer)
    return {"states": state_bytes(spec.params() / (gx * gz), b), "gathered": gathered, "activations": activations}


def predict(spec: LongSpec, sizes: dict[str, int], machine: Machine, recompute: bool | None = None) -> LongPrediction:
    """One step of ``spec`` on ``sizes`` (x, z, context, data) of ``machine`` (see the module's docstring);
    ``recompute`` None: off where the activations fit, else on."""
    sizes = {a: sizes.get(a, 1) for a in ("x", "z", "context", "data")}
    pred = LongPrediction(dict(sizes))
    reason = problem(spec, sizes)
    if reason is not None:
        pred.fits, pred.excluded = False, reason
        return pred
    b, gx, gz, spread, data = (machine.bytes_per_element, sizes["x"], sizes["z"], sizes["context"], sizes["data"])
    recompute = fit_memory(pred, lambda again: memory_terms(spec, sizes, b, again), machine, recompute)
    speed = machine.peak_flops * machine.efficiency
    tokens = spec.tokens / (gz * data * spread)
    again = 4 / 3 if recompute else 1.0
    attention = tokens * spec.attention_flops_per_token(causal=True) / gx * again
    pred.t_compute = (tokens * spec.matmul_flops_per_token() / gx * again) / speed + attention / speed
    dpn = machine.devices_per_node
    # The ring: context sits inside data, x*z ranks apart; its group inside a node while x*z*C fit there
    inside = gx * gz * spread <= dpn
    beta = machine.beta_intra if inside else machine.beta_inter / min(dpn, gx * gz)
    latency = machine.latency if inside or machine.latency_inter is None else machine.latency_inter
    pred.ring_bytes = ring_bytes(spec, sizes, b, recompute)
    if spread > 1:
        block = pred.ring_bytes / (spec.n_layer * ((spread - 1) * (3 if recompute else 2) + spread))
        per_step = attention / (spec.n_layer * spread * (4 if recompute else 3)) / speed   # one block's forward
        transfers = spec.n_layer * ((spread - 1) * (2 if recompute else 1) * max(0.0, block / beta + latency
                                                                                  - per_step)
                                    + (2 * spread - 1) * max(0.0, block / beta + latency - 2 * per_step))
        # The all-gather form: per layer a gather of the rank's keys and values (again when recomputed) and a
        # reduce-scatter of the whole sequence's gradients, waited for where issued
        gathered = spec.n_layer * ((2 if recompute else 1) * ring_time("all_gather", spread, block, beta, latency)
                                   + ring_time("reduce_scatter", spread, block * spread, beta, latency))
        pred.t_ring, pred.form = min((transfers, "ring"), (gathered, "gather"))
    # x: attention's and the MLP's outputs summed, forward and backward
    beta_x = machine.beta_intra if gx <= dpn else machine.beta_inter / dpn
    passes = 3 if recompute else 2
    pred.t_tensor = passes * 2 * spec.n_layer * ring_time("all_reduce", gx, tokens * spec.hidden * b, beta_x,
                                                         machine.latency)
    beta_z = machine.beta_intra if gx * gz <= dpn else machine.beta_inter / min(dpn, gx)
    held = spec.params() / gx * b
    pred.t_tensor += (2 if recompute else 1) * ring_time("all_gather", gz, held / gz, beta_z, machine.latency) \
        + ring_time("reduce_scatter", gz, held / gz, beta_z, machine.latency)
    beta_data = machine.beta_intra if gx * gz * spread * data <= dpn else machine.beta_inter / min(dpn, gx * gz)
    pred.t_sync = ring_time("all_reduce", spread * data, spec.params() / (gx * gz) * b, beta_data, machine.latency)
    backward = pred.t_compute * (2 / 3 if not recompute else 2 / 4)
    pred.t_iter = pred.t_compute + pred.t_ring + pred.t_tensor + max(0.0, pred.t_sync - backward)
    pred.rates(spec.tokens, gx * gz * spread * data, spec.flops_per_token(), machine.peak_flops)
    return pred


def rank_grids(spec: LongSpec, world: int, machine: Machine) -> tuple[list[LongPrediction], list[LongPrediction]]:
    """(every (x, z, context, data) of ``world`` devices that fits, fastest first; the others, with why)."""
    fitting, excluded = [], []
    for gx in divisors(world):
        for gz in divisors(world // gx):
            for spread in divisors(world // (gx * gz)):
                data = world // (gx * gz * spread)
                pred = predict(spec, {"x": gx, "z": gz, "context": spread, "data": data}, machine)
                (fitting if pred.fits else excluded).append(pred)
    fitting.sort(key=lambda p: p.t_iter)
    return fitting, excluded


def long_spec(name: str) -> LongSpec:
    if name not in LONG_MODELS:
        raise ValueError(f"unknown model {name!r}; built-in long-sequence models are {', '.join(LONG_MODELS)}")
    return LONG_MODELS[name]
