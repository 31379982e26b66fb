"""A mixture of experts on the grid (docs/architecture.md, "Experts"): a router gives each token its top-k
experts; the tokens travel to the ranks that hold those experts over the ``expert`` axis (folded over
``data``) and back, **dropless**: every token reaches every expert it chose, whatever the load.

One layer's step, on each rank of an expert group (``G`` ranks, ``E / G`` experts each):

1. route: fp32 (or wider) logits of a replicated router, softmax or sigmoid scores, top-k, weights
   renormalised over the k where asked;
2. permute: the (token, slot) assignments sorted by expert (stable), so each destination rank's rows
   are one run, in the order of its experts;
3. exchange: an all-to-all of the per-expert counts, then one of the rows with uneven splits;
4. the experts: the rows regrouped expert-major (from every source), each expert's GEMMs on its run;
5. the way back: ungrouped, the reverse all-to-all, unsorted to (token, slot) order, weighted and summed
   over the k slots.

Load balancing: the switch (GShard) auxiliary loss ``E * sum_e f_e * P_e`` over the global batch (``f_e``,
the share of assignments expert e got, counted over every data-parallel rank; ``P_e`` its mean score), and
the router z-loss (the mean squared log-sum-exp of the logits); the layer keeps both of its last forward
(``aux_loss``, weighted, for the model to add to its loss).

Each expert's two GEMMs run under Algorithm 1 on x, y and z like the dense MLP's (fc normal: features
over y in, x out; proj transposed), so an expert is split as well as spread: the rows that arrive have
the residual stream's features over y, and every rank of an x or y group holds the same tokens (routing
is the same there). The router's weight is cut over y with the features; its partial logits are summed
over y. :class:`ReferenceMoE` is the single-device twin the tests hold it to.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d import comm
from par4d.eager import eager
from par4d.grid import Grid, Indivisible
from par4d.layout import BATCH_AXES, REPLICAS, Placement, Split, place
from par4d.nn.algorithm1 import Algorithm1
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import SumFeatures, SumGradients
from par4d.nn.linear import Linear

SCORES = ("softmax", "sigmoid")
ROUTER = Placement((Split(1, "y"),), BATCH_AXES)     # a router's weight: features over y, whole elsewhere


def expert_placement(transposed: bool, chunks: int = 1) -> Placement:
    """Every expert's weight of one GEMM, stacked (experts, out, in): the experts over ``expert``, each cut as
    a normal Linear's weight (out over x in ``chunks`` equal chunks, in over y, each block's rows over z) or,
    ``transposed``, a transposed one's (out over y, in over x); each expert's gradient summed over its
    replicas on data."""
    if transposed:
        return Placement((Split(0, "expert"), Split(1, "y"), Split(2, "x"), Split(1, "z")), REPLICAS)
    return Placement((Split(0, "expert"), Split(1, "x", chunks=chunks), Split(2, "y"), Split(1, "z")), REPLICAS)


class Exchange(torch.autograd.Function):
    """all-to-all of rows over ``expert`` in forward (``send[i]`` rows to its i-th rank, ``receive[i]``
    from it), the reverse all-to-all in backward (each row's gradient goes back where the row came from)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, grid: Grid, send: list[int], receive: list[int],
                arrived: torch.Tensor | None = None) -> torch.Tensor:
        """``arrived``: the rows already exchanged (an all-to-all issued earlier and waited for, with other
        work in between): returned as they are."""
        ctx.grid, ctx.send, ctx.receive = grid, send, receive
        return arrived.view_as(arrived) if arrived is not None else comm.all_to_all(grid, rows, "expert", send, receive)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_to_all(ctx.grid, grad.contiguous(), "expert", ctx.receive, ctx.send), None, None, None, None


class ExpertMatmul:
    """What :class:`par4d.nn.algorithm1.Algorithm1` asks of a layer, for one GEMM of every expert: the axes
    (normal: features y in, x out; transposed: swapped) and the local matmuls; the weight is the expert's
    slice of the stacked parameter, passed to each call."""

    runtime = None                # the exchanges and these GEMMs are not overlapped yet
    feature_dim = -1
    weight_layout = "out_in"

    def __init__(self, grid: Grid, transposed: bool):
        self.grid = grid
        self.in_axis, self.out_axis = ("x", "y") if transposed else ("y", "x")

    def __call__(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.grid.size(self.in_axis, self.out_axis, "z") == 1:
            return rows @ weight.t()                     # nothing to gather or sum
        return Algorithm1.apply(rows, weight, None, self)

    def local_forward(self, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return inp @ w.t()

    def local_input_grad(self, grad_out: torch.Tensor, w: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        return grad_out @ w

    def local_weight_grad(self, grad_out: torch.Tensor, inp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return grad_out.t() @ inp


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, score: str, renormalize: bool,
          bias: torch.Tensor | None = None, grid: Grid | None = None, groups: tuple[int, int] = (1, 1),
          precision: tuple[torch.dtype | None, torch.dtype] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts (N, k), their weights (N, k), scores (N, E), logits (N, E)) of tokens ``x`` (N, D) under
    router ``weight`` (E, D), in fp32 or the inputs' wider dtype. Ties in top-k go to the lower index.
    ``bias`` (E,): added to the scores to choose the experts only (DeepSeek-V3's loss-free balancing); the
    weights are the scores themselves. ``grid``: ``x`` and ``weight`` hold their features' part over y.
    ``groups`` (G, M): group-limited routing (DeepSeek-V3's): the experts in G equal groups, a token's k
    chosen among the M groups whose two best choice scores sum highest (the best one, in groups of one).
    ``precision`` (logits' dtype, scores' dtype): a fixed precision, as transformers' routers keep one whatever
    the model's dtype (Mixtral's logits in the inputs' dtype, None, and scores in float32; DeepSeek-V3's both
    in float32); None: both in fp32 or the inputs' wider dtype."""
    dtype, scored = (torch.promote_types(x.dtype, torch.float32), None) if precision is None else \
        (precision[0] or x.dtype, precision[1])
    logits = x.to(dtype) @ weight.to(dtype).t()
    if grid is not None:
        logits = SumFeatures.apply(logits, grid, "y")        # the features' parts, summed
    at = logits if scored is None else logits.to(scored)
    scores = at.softmax(-1) if score == "softmax" else at.sigmoid()
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    count, kept = groups
    if count > 1:
        per_group = choice.view(choice.shape[0], count, -1)
        best = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)       # (N, G)
        chosen = best.topk(kept, dim=-1).indices
        allowed = torch.zeros_like(best, dtype=torch.bool).scatter(1, chosen, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights, scores, logits


def balance_losses(experts: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor, counts: torch.Tensor,
                   score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(switch auxiliary loss, router z-loss) of one rank's tokens, given ``counts``: the assignments per
    expert over the whole batch (every rank's). The mean of every rank's values is the whole batch's (each
    rank holds as many tokens), and so is the mean of their gradients."""
    n_experts = scores.shape[-1]
    share = counts.to(scores.dtype) / counts.sum()                 # f_e: no gradient (a count)
    probs = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = n_experts * (share * probs.mean(0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return aux, z


def _expert_mlp(rows: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """One expert: fc (hidden, dim) -> GELU -> proj (dim, hidden), as the GPT's dense MLP (no bias)."""
    return F.gelu(rows @ fc.t()) @ proj.t()


class Mixture(ShardedModule):
    """What every mixture of experts on the grid shares: the routing, the counts, the balance losses, the
    exchange there and back and the weighted combine (residual layout in and out: (..., dim), samples over
    data and z, features over y). A subclass holds the router's weight (:meth:`router_weight`), the experts
    (:meth:`_experts`) and any shared experts (:meth:`_shared`), and calls :meth:`_setup`."""

    def _setup(self, *, grid: Grid, name: str, experts: int, top_k: int, score: str, renormalize: bool,
               aux_weight: float, z_weight: float, capacity_factor: float | None, bias_rate: float, overlap: bool,
               groups: tuple[int, int]) -> None:
        check_moe(name, experts, top_k, grid, score, capacity_factor, groups)
        self.grid, self.name, self.top_k, self.score, self.renormalize = grid, name, top_k, score, renormalize
        self.n_experts, self.aux_weight, self.z_weight = experts, aux_weight, z_weight
        self.capacity_factor, self.groups, self.overlap = capacity_factor, groups, overlap
        self.precision: tuple[torch.dtype | None, torch.dtype] | None = None   # the router's (see route)
        self.route_scale = 1.0       # the top-k weights times this (DeepSeek-V3's routed_scaling_factor)
        self.recomputing = False     # set while a recomputed segment runs it again (par4d.nn.recompute)
        _balancing(self, experts, bias_rate, grid.device)
        self.aux_loss: torch.Tensor | None = None     # the last forward's weighted balance losses (None: weighted 0)
        self.last_counts: torch.Tensor | None = None  # the last forward's assignments per expert (whole batch)
        self.last_routed: torch.Tensor | None = None  # ... as routed, before any capacity (whole batch)
        self.last_losses: tuple[torch.Tensor, torch.Tensor] | None = None   # its auxiliary and z losses, unweighted
        self.last_dropped: torch.Tensor | None = None  # assignments dropped over capacity (whole batch)

    def router_weight(self) -> torch.Tensor:
        """The router's weight (E, dim / y), its features cut over y."""
        raise NotImplementedError

    def _routed(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """What a subclass keeps of this forward's routing besides the counts and losses (nothing here)."""

    def _choice_bias(self) -> torch.Tensor | None:
        """What is added to the scores to choose the experts (loss-free balancing's bias, where it is on)."""
        return self.expert_bias if self.bias_rate else None

    def _experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on their runs of ``rows`` (expert-major)."""
        raise NotImplementedError

    def _shared(self):
        """The experts every token goes through, as a function of the layer's input (None: there are none)."""
        return None

    # Eager in a compiled block (par4d.compiled): each expert's rows change in number every step, and dynamo,
    # which specialises on them (a load of 0 or 1 always), would compile the block again step after step.
    @eager
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        experts, weights, scores, logits = route(x, self.router_weight(), self.top_k, self.score, self.renormalize,
                                                 self._choice_bias(), self.grid, self.groups, self.precision)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        flat = experts.reshape(-1)
        limit = capacity(self.capacity_factor, x.shape[0], self.top_k, self.n_experts)
        routed = torch.bincount(flat, minlength=self.n_experts)
        if limit is None:               # dropless: every (token, slot) assignment goes
            chosen, received = None, routed
        else:
            kept = within_capacity(experts, scores, limit).reshape(-1)
            chosen, received = kept.nonzero().squeeze(1), torch.bincount(flat[kept], minlength=self.n_experts)
        # One all-reduce: every rank's assignments per expert, as routed (the balance loss counts those) and
        # as kept (what the experts received)
        both = comm.all_reduce(self.grid, torch.cat([routed, received]), *BATCH_AXES)
        self.last_routed, self.last_counts = both[:self.n_experts], both[self.n_experts:]
        self._routed(scores, logits)
        weighted = bool(self.aux_weight or self.z_weight)
        with torch.set_grad_enabled(torch.is_grad_enabled() and weighted):   # else for the metrics only
            aux, z = balance_losses(experts, scores, logits, self.last_routed, self.score)
        self.aux_loss = self.aux_weight * aux + self.z_weight * z if weighted else None
        self.last_losses = (aux.detach(), z.detach())       # floats only when reported: no host sync here
        self.last_dropped = self.last_routed.sum() - self.last_counts.sum()
        # The load the next bias step answers: every microbatch's, once (not again when recomputed)
        if self.training and self.bias_rate and not self.recomputing:
            self.pending_load = self.last_routed + (0 if self.pending_load is None else self.pending_load)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k) if chosen is None \
            else chosen // self.top_k
        common_experts = self._shared()
        shared = None if common_experts is None else (lambda: common_experts(h))
        # The shared experts' GEMMs while the rows travel (or after them, without overlap)
        out, common = dispatch(x, tokens, flat if chosen is None else flat[chosen], self.n_experts, self.grid,
                               self._experts, meanwhile=shared if self.overlap else None)
        if shared is not None and not self.overlap:
            common = shared()
        # (token, slot) order; with a capacity, a dropped slot adds 0
        y = out if chosen is None else out.new_zeros(flat.numel(), out.shape[1]).index_copy(0, chosen, out)
        # Each rank of y weighs its features' part: the weights' gradient is the sum of the parts'
        weights = SumGradients.apply(weights.to(y.dtype), self.grid, "y")
        slots = y.view(x.shape[0], self.top_k, -1) * weights.unsqueeze(-1)
        routed = slots.sum(1).reshape(shape)
        return routed if common is None else routed + common


class MoE(Mixture):
    """A mixture of ``experts`` GELU MLPs (``dim`` -> ``hidden`` -> ``dim``), ``top_k`` of them per token,
    spread over the grid's ``expert`` axis; residual layout in and out ((..., dim), samples over data and z).

    ``score``: ``"softmax"`` or ``"sigmoid"`` router scores; ``renormalize``: the top-k weights summed to 1;
    ``aux_weight``, ``z_weight``: the weights of the auxiliary and z losses in :attr:`aux_loss`;
    ``capacity_factor``, ``bias_rate``, ``shared``, ``groups``: see the module's docstring and :func:`route`.
    Parameters: ``router`` (E, D), its features cut over y; ``fc`` (E, hidden, D) and ``proj`` (E, D,
    hidden), cut over ``expert`` (dim 0) and each expert's matrix as Algorithm 1 cuts a normal and a
    transposed Linear's. Raises ``ValueError`` naming the numbers for a shape the grid cannot hold.
    """

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, grid: Grid, name: str = "moe", *,
                 score: str = "softmax", renormalize: bool = True, aux_weight: float = 0.01,
                 z_weight: float = 0.001, capacity_factor: float | None = None, bias_rate: float = 0.0,
                 shared: int = 0, overlap: bool = True, groups: tuple[int, int] = (1, 1)):
        super().__init__()
        self._setup(grid=grid, name=name, experts=experts, top_k=top_k, score=score, renormalize=renormalize,
                    aux_weight=aux_weight, z_weight=z_weight, capacity_factor=capacity_factor, bias_rate=bias_rate,
                    overlap=overlap, groups=groups)
        check_expert_shape(name, dim, hidden, grid)
        local = experts // grid.size("expert")
        device = grid.device
        gx, gy, gz = grid.size("x"), grid.size("y"), grid.size("z")
        self.router = place(nn.Parameter(torch.empty(experts, dim // gy, device=device)), ROUTER)
        self.fc = place(nn.Parameter(torch.empty(local, hidden // (gx * gz), dim // gy, device=device)),
                        expert_placement(transposed=False))
        self.proj = place(nn.Parameter(torch.empty(local, dim // (gy * gz), hidden // gx, device=device)),
                          expert_placement(transposed=True))
        self.up, self.down = ExpertMatmul(grid, transposed=False), ExpertMatmul(grid, transposed=True)
        if shared:       # experts every token goes through: a dense MLP of their width (Linear's own layout)
            self.shared = nn.Module()
            self.shared.fc = Linear(dim, shared * hidden, bias=False, grid=grid, name=f"{name}.shared.fc",
                                    initialize=False)
            self.shared.proj = Linear(shared * hidden, dim, bias=False, transposed=True, grid=grid,
                                      name=f"{name}.shared.proj", initialize=False)
        else:
            self.shared = None

    def router_weight(self) -> torch.Tensor:
        return self.router

    def _shared(self):
        return None if self.shared is None else (lambda h: self.shared.proj(F.gelu(self.shared.fc(h))))

    def _experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """A GEMM pair for each expert (a loop: on CPU the runs are too uneven for a padded batched matmul
        to pay)."""
        parts = rows.split(per_expert)
        return torch.cat([self.down(F.gelu(self.up(part, self.fc[e])), self.proj[e]) for e, part in enumerate(parts)])


def balance_loss(modules) -> torch.Tensor | float:
    """The weighted balance losses of the mixtures among ``modules`` (par4d's or the twin's) in their last
    forward, 0 without any: what a mixture-of-experts model adds to its loss."""
    return sum(m.aux_loss for m in modules if isinstance(m, (Mixture, ReferenceMoE)) and m.aux_loss is not None)


def _balancing(layer: nn.Module, experts: int, rate: float, device: torch.device) -> None:
    """Loss-free balancing's state on a mixture (its twin's too): the bias (a persistent buffer: checkpoints
    keep it) and the load since its last step."""
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"bias_rate={rate} must be a finite number >= 0 (0: no loss-free balancing)")
    layer.bias_rate = rate
    layer.register_buffer("expert_bias", torch.zeros(experts, device=device), persistent=bool(rate))
    layer.pending_load = None


@torch.no_grad()
def step_bias(layer: nn.Module) -> None:
    """DeepSeek-V3's loss-free balancing, once per optimizer step: each expert's bias moves by ``bias_rate``
    towards the mean load since the last step (up for an expert that got fewer assignments than the mean,
    down for one that got more), outside the gradient. The load is the whole batch's, the same on every
    rank: every rank's bias stays the same."""
    if layer.bias_rate and layer.pending_load is not None:
        load = layer.pending_load.to(layer.expert_bias.dtype)
        layer.expert_bias.add_(layer.bias_rate * torch.sign(load.mean() - load))
    layer.pending_load = None


def update_expert_bias(model: nn.Module, modules: list[nn.Module] | None = None) -> None:
    """Step the loss-free balancing bias of every mixture in ``model`` (after the optimizer step;
    par4d.train.step.train_step calls it). ``modules``: the model's modules, already listed (train_step passes its
    data-parallel sync's, kept current: walking ``model.modules()`` took 26 us a step)."""
    for module in model.modules() if modules is None else modules:
        if isinstance(module, (Mixture, ReferenceMoE)):
            step_bias(module)


def expert_metrics(model: nn.Module) -> dict:
    """The load of every mixture in ``model`` at its last forward, for ``metrics.jsonl``: per layer the most
    and the mean tokens an expert received (over the whole batch, so the same on every rank), its auxiliary
    and z losses (this rank's share: the batch's where ranks agree), the assignments dropped over capacity
    (where a layer has one), and the worst layer's most over mean (1: perfectly balanced); empty for a model
    without one."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Mixture) and m.last_counts is not None]
    if not layers:
        return {}
    most = [int(m.last_counts.max()) for _, m in layers]
    mean = [m.last_counts.double().mean().item() for _, m in layers]
    dropped = {"expert_dropped": [int(m.last_dropped) for _, m in layers]} \
        if any(m.capacity_factor is not None for _, m in layers) else {}
    return {"expert_tokens_max": most, "expert_tokens_mean": mean,
            "expert_aux_loss": [float(m.last_losses[0]) for _, m in layers],
            "expert_z_loss": [float(m.last_losses[1]) for _, m in layers],
            "expert_imbalance": max(a / b for a, b in zip(most, mean)), **dropped}


def capacity(factor: float | None, tokens: int, top_k: int, experts: int) -> int | None:
    """The assignments an expert takes from one rank's ``tokens``: ``ceil(factor * tokens * top_k /
    experts)``, or None (dropless)."""
    return None if factor is None else math.ceil(factor * tokens * top_k / experts)


def within_capacity(experts: torch.Tensor, scores: torch.Tensor, limit: int | None) -> torch.Tensor:
    """Which (token, slot) assignments an expert keeps (N, k): all where ``limit`` is None, else each
    expert's ``limit`` of them with the highest scores (ties: the earlier token), the rest dropped."""
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    flat, score = experts.reshape(-1), scores.gather(1, experts).reshape(-1)
    by_score = torch.argsort(-score, stable=True)
    order = by_score[torch.argsort(flat[by_score], stable=True)]      # expert-major, best first inside
    sorted_experts = flat[order]
    first = torch.searchsorted(sorted_experts, sorted_experts, side="left")   # where each expert's run starts
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = torch.arange(flat.numel(), device=flat.device) - first < limit
    return keep.view_as(experts)


def check_moe(where: str, experts: int, top_k: int, grid: Grid, score: str = "softmax",
              capacity_factor: float | None = None, groups: tuple[int, int] = (1, 1)) -> None:
    """Raise a ValueError naming ``where`` and the numbers unless ``grid`` can hold the layer."""
    spread = grid.size("expert")
    if score not in SCORES:
        raise ValueError(f"{where}: score={score!r}; give one of {', '.join(SCORES)}")
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"{where}: capacity_factor={capacity_factor} must be a finite number > 0 (None: dropless)")
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: top_k={top_k} must be from 1 to the {experts} experts")
    count, kept = groups
    if count < 1 or experts % count or not 1 <= kept <= count or top_k > kept * (experts // count):
        raise ValueError(f"{where}: groups={groups}: give G groups dividing the {experts} experts and M from 1 to "
                         f"G groups holding the top_k={top_k} ({experts // max(count, 1)} experts a group)")
    if experts % spread:
        raise ValueError(f"{where}: {experts} experts do not divide over expert={spread} ranks")


def check_expert_shape(where: str, dim: int, hidden: int, grid: Grid) -> None:
    """Raise :class:`par4d.grid.Indivisible` naming the numbers unless an expert's GEMMs split as Algorithm 1
    splits a Linear: ``dim`` over y (and its blocks over z), ``hidden`` over x (and its blocks over z)."""
    gx, gy, gz = grid.size("x"), grid.size("y"), grid.size("z")
    for size, name, axis, g in ((dim, "dim", "y", gy), (hidden, "hidden", "x", gx)):
        if size % (g * gz):
            raise Indivisible(f"{where}: {name}={size} does not split over {axis}={g} and then z={gz} (an expert's "
                              f"GEMMs cut it as a Linear's)")


def dispatch(x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, n_experts: int, grid: Grid,
             compute, meanwhile=None):
    """``compute(rows, per_expert)`` of every assignment (token ``tokens[i]`` to expert ``experts[i]``),
    returned in the assignments' order: the rows are sorted by expert, sent to the ranks of the expert
    group that hold their experts, regrouped expert-major there (``per_expert``: each local expert's run),
    computed, and sent back; returns (the rows computed, what ``meanwhile()`` returned: None without it),
    ``meanwhile`` being work run while the rows are on their way (their all-to-all issued before it and
    waited for after: the same arithmetic, the same bits)."""
    spread = grid.size("expert")
    per_rank = n_experts // spread
    counts = torch.bincount(experts, minlength=n_experts)
    order = torch.argsort(experts, stable=True)                      # expert-major, assignment order inside
    rows = x[tokens[order]]
    send = counts.view(spread, per_rank)                               # to each rank: a count per expert of its
    got = comm.all_to_all(grid, send, "expert", [1] * spread, [1] * spread).view(spread, per_rank)
    send_rows, receive_rows = send.sum(1).tolist(), got.sum(1).tolist()
    side = None
    if meanwhile is None:
        arrived = Exchange.apply(rows, grid, send_rows, receive_rows)      # by source rank, then expert
    else:
        handle = comm.all_to_all(grid, rows.detach(), "expert", send_rows, receive_rows, async_op=True)
        side = meanwhile()
        arrived = Exchange.apply(rows, grid, send_rows, receive_rows, handle.wait())
    regroup = _expert_major(got)
    out = compute(arrived[regroup], got.sum(0).tolist())
    back = Exchange.apply(out[torch.argsort(regroup)], grid, receive_rows, send_rows)
    return back[torch.argsort(order)], side


def _expert_major(got: torch.Tensor) -> torch.Tensor:
    """The row order that takes blocks laid out (source, expert) to (expert, source); ``got[s, e]`` rows each."""
    sizes = got.reshape(-1).tolist()
    starts = [0, *itertools.accumulate(sizes)][:-1]
    sources, per_rank = got.shape
    runs = [torch.arange(starts[s * per_rank + e], starts[s * per_rank + e] + sizes[s * per_rank + e])
            for e in range(per_rank) for s in range(sources)]
    return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)


class ReferenceMoE(nn.Module):
    """The single-device twin of :class:`MoE`: every expert here, the same routing and losses, each
    (token, slot) computed by its expert and summed over the slots in the same order."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, *, score: str = "softmax",
                 renormalize: bool = True, aux_weight: float = 0.01, z_weight: float = 0.001,
                 capacity_factor: float | None = None, shards: int = 1, bias_rate: float = 0.0, shared: int = 0,
                 groups: tuple[int, int] = (1, 1)):
        """``shards``: with a capacity, the batch shards (data x z ranks) whose tokens each expert's capacity
        counts, as the parallel layer counts them per rank."""
        super().__init__()
        self.top_k, self.score, self.renormalize = top_k, score, renormalize
        self.n_experts, self.aux_weight, self.z_weight = experts, aux_weight, z_weight
        self.capacity_factor, self.shards, self.groups = capacity_factor, shards, groups
        _balancing(self, experts, bias_rate, torch.device("cpu"))
        self.shared = None
        if shared:
            self.shared = nn.Module()
            self.shared.fc = nn.Linear(dim, shared * hidden, bias=False)
            self.shared.proj = nn.Linear(shared * hidden, dim, bias=False)
        self.router = nn.Parameter(torch.randn(experts, dim) / math.sqrt(dim))
        self.fc = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(dim))
        self.proj = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(hidden))
        self.aux_loss: torch.Tensor | None = None

    @eager      # (as Mixture.forward: the twin's blocks are compiled as par4d's where a benchmark compiles both)
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        experts, weights, scores, logits = route(x, self.router, self.top_k, self.score, self.renormalize,
                                                 self.expert_bias if self.bias_rate else None, groups=self.groups)
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        if self.training and self.bias_rate:
            self.pending_load = counts + (0 if self.pending_load is None else self.pending_load)
        aux, z = balance_losses(experts, scores, logits, counts, self.score)
        self.aux_loss = self.aux_weight * aux + self.z_weight * z
        tokens = x.shape[0] // self.shards
        limit = capacity(self.capacity_factor, tokens, self.top_k, self.n_experts)
        kept = torch.cat([within_capacity(e, s, limit) for e, s in zip(experts.split(tokens), scores.split(tokens))])
        flat = experts.reshape(-1)
        y = x.new_zeros(flat.numel(), shape[-1])
        for e in range(self.n_experts):
            slots = ((flat == e) & kept.reshape(-1)).nonzero().squeeze(1)
            y = y.index_copy(0, slots, _expert_mlp(x[slots // self.top_k], self.fc[e], self.proj[e]))
        slots = y.view(x.shape[0], self.top_k, -1) * weights.to(y.dtype).unsqueeze(-1)
        routed = slots.sum(1).reshape(shape)
        return routed if self.shared is None else routed + self.shared.proj(F.gelu(self.shared.fc(h)))
