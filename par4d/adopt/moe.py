"""transformers' sparse mixture-of-experts blocks (Mixtral, Qwen3-MoE, OLMoE) as par4d mixtures.

transformers 5 keeps a block's experts as two stacked tensors, ``experts.gate_up_proj`` (E, 2I, D: each
expert's gate and up projections, one above the other) and ``experts.down_proj`` (E, D, I), and its router
as ``gate.weight`` (E, D). ``par4d.parallelize`` replaces the block, under the same name, by a
:class:`SparseMoE` holding the same three tensors under the same names, cut as par4d's own
:class:`par4d.nn.moe.MoE` cuts its experts (docs/architecture.md, "Experts"): the experts over ``expert``
(dim 0), each expert's gate and up as a normal Linear's weight (rows over x, its gate's and its up's blocks
kept side by side, then over z; features over y) and its down as a transposed one's; the router's
features over y. Checkpoints, ``--init-from``, export and the initialisation read and write them by name,
as for every other parameter.

The routing is transformers': softmax scores in float32 (as its routers compute them, whatever the model's
dtype), the top k, renormalised over the k where the model does (Mixtral always; Qwen3-MoE and OLMoE where
``norm_topk_prob``), dropless. Its auxiliary
loss (``output_router_logits``: ``router_aux_loss_coef`` times :func:`router_aux_loss`) is
transformers' ``load_balancing_loss_func``: every layer's assignments and scores pooled, over the whole
batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from par4d.grid import Grid
from par4d.layout import place
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import GatherFeatures, SplitFeatures
from par4d.nn.moe import ROUTER, ExpertMatmul, Mixture, check_expert_shape, expert_placement

# transformers' sparse blocks par4d knows: the gate's top_k and (where the model has it) norm_topk_prob, the
# experts' gate_up_proj, down_proj and act_fn; Mixtral's may add router jitter, which par4d refuses;
# DeepSeek-V3's router scores by sigmoid with a correction bias, in groups, scaled, and its block adds
# shared experts.
MIXTURES = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "DeepseekV3MoE")


class Router(ShardedModule):
    """A block's ``gate``: its weight (E, D), the features cut over y (every rank of the batch's axes
    holds it: its gradient is summed there); ``corrected``: with DeepSeek-V3's ``e_score_correction_bias``
    (E,), a float32 buffer added to the scores to choose the experts (checkpoints and folders keep it)."""

    def __init__(self, experts: int, dim: int, grid: Grid, corrected: bool = False):
        super().__init__()
        self.grid = grid
        self.weight = place(nn.Parameter(torch.empty(experts, dim // grid.size("y"), device=grid.device)), ROUTER)
        if corrected:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32,
                                                                        device=grid.device))


class Experts(ShardedModule):
    """A block's ``experts``: ``gate_up_proj`` (E, 2I, D) and ``down_proj`` (E, D, I), this rank's experts
    and each one's Algorithm 1 shard."""

    def __init__(self, experts: int, dim: int, inner: int, grid: Grid):
        super().__init__()
        self.grid = grid
        local = experts // grid.size("expert")
        gx, gy, gz = grid.size("x"), grid.size("y"), grid.size("z")
        # Two out-chunks (gate, up): each chunk's rows over x, the rank's blocks side by side, then over z
        self.gate_up_proj = place(
            nn.Parameter(torch.empty(local, 2 * inner // (gx * gz), dim // gy, device=grid.device)),
            expert_placement(transposed=False, chunks=2))
        self.down_proj = place(nn.Parameter(torch.empty(local, dim // (gy * gz), inner // gx, device=grid.device)),
                               expert_placement(transposed=True))


class SparseMoE(Mixture):
    """transformers' sparse block ``block`` on ``grid`` (see the module's docstring), its values kept unless
    on the meta device. ``stream``: the residual stream reaches it with its features over y (as
    ``par4d.parallelize`` shards it); else whole, and the block cuts and gathers them itself."""

    def __init__(self, block: nn.Module, grid: Grid, name: str, stream: bool):
        super().__init__()
        gate, experts = block.gate, block.experts
        n_experts, dim = gate.weight.shape
        inner = experts.down_proj.shape[-1]
        jitter = getattr(block, "jitter_noise", 0.0)
        if jitter:
            raise ValueError(f"parallelize: {name} multiplies its input by router jitter noise "
                             f"(router_jitter_noise={jitter}), which par4d does not draw (the ranks holding a token "
                             f"would draw different noise); set router_jitter_noise to 0")
        renormalize = getattr(gate, "norm_topk_prob", True)       # Mixtral's router always renormalises
        corrected = hasattr(gate, "e_score_correction_bias")     # DeepSeek-V3's
        # transformers' routing, dropless, no capacity; balanced by router_aux_loss (the model's) or, DeepSeek-V3,
        # by its correction bias, not by the layer's own losses
        self._setup(grid=grid, name=name, experts=n_experts, top_k=gate.top_k,
                    score="sigmoid" if corrected else "softmax", renormalize=renormalize, aux_weight=0.0,
                    z_weight=0.0, capacity_factor=None, bias_rate=0.0, overlap=True,
                    groups=(gate.num_group, gate.topk_group) if corrected else (1, 1))
        # transformers' routers score in float32 whatever the model's dtype; DeepSeek-V3's logits too
        self.precision = (torch.float32 if corrected else None, torch.float32)
        self.route_scale = float(getattr(gate, "routed_scaling_factor", 1.0))
        self.last_logits: torch.Tensor | None = None    # the last forward's router logits (router_aux_loss)
        check_expert_shape(name, dim, inner, grid)
        self.gate = Router(n_experts, dim, grid, corrected)
        # DeepSeek-V3's shared experts: a gated MLP parallelize has made par4d's already (its layers' block)
        self.shared_experts = getattr(block, "shared_experts", None)
        self.experts = Experts(n_experts, dim, inner, grid)
        self.act_fn = experts.act_fn
        self.stream = stream or grid.size("y") == 1
        self.up, self.down = ExpertMatmul(grid, transposed=False), ExpertMatmul(grid, transposed=True)
        if corrected and not gate.e_score_correction_bias.is_meta:
            self.gate.e_score_correction_bias.copy_(gate.e_score_correction_bias)
        if not gate.weight.is_meta:
            with torch.no_grad():
                self.gate.load_full_state({"weight": gate.weight.to(grid.device, self.gate.weight.dtype)})
                self.experts.load_full_state({n: getattr(experts, n).to(grid.device, self.experts.down_proj.dtype)
                                              for n in ("gate_up_proj", "down_proj")})

    def router_weight(self) -> torch.Tensor:
        return self.gate.weight

    def _choice_bias(self) -> torch.Tensor | None:
        return getattr(self.gate, "e_score_correction_bias", None)

    def step_correction(self, rate: float) -> None:
        """Step DeepSeek-V3's score correction bias as par4d's loss-free balancing steps a bias
        (:func:`par4d.nn.moe.step_bias`, after each optimizer step: ``rate`` towards the mean load): the one
        buffer transformers keeps (and checkpoints and exports) is the one stepped."""
        if not hasattr(self.gate, "e_score_correction_bias"):
            raise ValueError(f"{self.name}: its router has no score correction bias to step (DeepSeek-V3's has)")
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"{self.name}: bias rate {rate} must be a finite number > 0")
        self.bias_rate = rate
        self.expert_bias = self.gate.e_score_correction_bias    # (non-persistent here: kept once, by the gate)

    def _routed(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        self.last_logits = logits       # transformers' balance loss takes its scores from them, where it is on

    def _shared(self):
        """DeepSeek-V3's shared experts run while the rows travel, where they take the stream as the mixture
        does (features over y, or y = 1); else on the whole input, after (:meth:`forward`)."""
        return self.shared_experts if self.stream else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.stream:
            return super().forward(h)
        routed = GatherFeatures.apply(super().forward(SplitFeatures.apply(h, self.grid, "y")), self.grid, "y")
        return routed if self.shared_experts is None else routed + self.shared_experts(h)

    def _experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Each expert's gated MLP, ``down(act(gate(x)) * up(x))``, a GEMM pair on its run of rows."""
        out = []
        for e, part in enumerate(rows.split(per_expert)):
            gate, up = self.up(part, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            out.append(self.down(self.act_fn(gate) * up, self.experts.down_proj[e]))
        return torch.cat(out)


def router_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """transformers' ``load_balancing_loss_func`` over the mixtures in ``model`` at their last forward: E
    times the sum over experts of (assignments per token, every layer's pooled over the whole batch) times
    (mean score, this rank's tokens' over every layer). The mean of every rank's value is the whole
    batch's (each rank holds as many tokens), and so is the mean of their gradients. None without one."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE) and m.last_routed is not None]
    if not layers:
        return None
    # The softmax of the logits at their own precision (float32 at least), not the router's float32 scores:
    # equal in float32 and float64 (in bf16 transformers takes this softmax in bf16)
    scores = torch.stack([m.last_logits.to(torch.promote_types(m.last_logits.dtype, torch.float32))
                          .softmax(-1).mean(0) for m in layers]).mean(0)
    routed = torch.stack([m.last_routed for m in layers]).sum(0).to(scores.dtype)
    tokens = layers[0].last_routed.sum().to(scores.dtype) / layers[0].top_k     # the whole batch's
    return layers[0].n_experts * (routed / (len(layers) * tokens) * scores).sum()
