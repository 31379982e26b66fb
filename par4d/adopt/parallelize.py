"""``par4d.parallelize(model, grid)``: Algorithm 1 for a model nobody here wrote.

Every ``nn.Linear`` (and Hugging Face's ``Conv1D``, GPT-2's: a linear layer whose weight
is stored (in, out), kept so: ``weight_layout="in_out"``) becomes a :class:`par4d.nn.Linear`,
every ``nn.Conv2d`` a :class:`par4d.nn.Conv2d` (channels in dim 1 play features) and every
``nn.Embedding`` a :class:`par4d.nn.Embedding` (rows over z, features over y), holding its
shard of the same weight and bias, under the same name and in the same orientation: par4d's
own layers, told their layouts in and out, not subclasses. Every other parameter
stays whole on every rank (replicated: its gradient is summed over the batch's axes, z
and data), and so does a layer whose weight is tied to another parameter (the plan says
so). Samples are split over z and data as for par4d's own GPT (``layout.shard_batch``).

Activations between blocks are whole (every feature on every rank of x and y), which is correct
for any model: a lone layer cuts its input's features for its in-axis (free) and all-gathers its
output's over its out-axis (``input_layout`` / ``output_layout="whole"``); norms over features
therefore stay whole. The exception is the residual stream of a causal language model whose every use
par4d knows (Llama, Mistral, Qwen2, GPT-2) on a grid with y > 1: there the stream is sharded over y
between blocks, as in par4d's GPT, and its norms are par4d's (:mod:`par4d.adopt.stream`). Batch
norms become :class:`par4d.nn.BatchNorm` where samples are split (z*data > 1), whose statistics
are all-reduced over z and data (the whole batch's, running ones included). Inside
a recognised block activations stay sharded, as in the 4D paper's transposed
alternation, with no collective between its layers:

* a feed-forward pair, a normal layer then a transposed one with only elementwise work
  between (an ``nn.Sequential`` of Linear, activations, Linear or of two Conv2d; GPT-2's
  MLP; the gated MLPs of Llama-like models: ``down(act(gate(x)) * up(x))``);
* attention (Llama, Mistral, Qwen2; GPT-2's with its fused q, k, v): the q, k, v
  projections are normal layers whose out-features are cut over x at head boundaries, so
  each rank of x runs attention on whole heads of its own (grouped-query attention's key
  and value heads with them), and the output projection is transposed.

A block with a layer forced or tied to another treatment is made of lone layers. A layer whose
sizes the grid does not divide (a 10-class head on x=2, z=2) is kept whole, and the plan says
why; a block with such a layer is made of lone layers too.

The overlaps (``par4d.overlap.set_overlap``) reach these layers as they reach par4d's own:
they are par4d's own.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from par4d.adopt.context import cut_sequences
from par4d.adopt.messages import (
    Message,
    bytes_sent,
    hook_messages,
    layer_messages,
    norm_messages,
    record,
    sync_messages,
)
from par4d.adopt.moe import MIXTURES, SparseMoE
from par4d.adopt.stream import gather_input, is_norm, split_output, stream_norm, stream_problem
from par4d.grid import Grid, Indivisible
from par4d.layout import BATCH_AXES, Placement, place, placement_of
from par4d.nn.batchnorm import BatchNorm
from par4d.nn.conv import Conv2d
from par4d.nn.embedding import Embedding
from par4d.nn.linear import Linear
from par4d.nn.norm import HeadRMSNorm
from par4d.parallel import has_state, state

TREATMENTS = ("normal", "transposed", "replicated")
KEPT_WHOLE = "kept whole: the grid does not divide its sizes"   # the plan's why, before the numbers
ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.LeakyReLU)
# Feed-forward blocks by class name: (the layers whose outputs meet elementwise, the layer after).
PAIRED = {name: (("gate_proj", "up_proj"), "down_proj") for name in ("LlamaMLP", "MistralMLP", "Qwen2MLP",
                                                                      "Qwen3MoeMLP", "DeepseekV3MLP")}
PAIRED["GPT2MLP"] = (("c_fc",), "c_proj")
# Attention blocks by class name: (the q, k, v projections (one fused for GPT-2), the output projection).
ATTENTION = {name: (("q_proj", "k_proj", "v_proj"), "o_proj") for name in ("LlamaAttention", "MistralAttention",
                                                                           "Qwen2Attention", "MixtralAttention",
                                                                           "Qwen3MoeAttention")}
# Attention whose queries and keys are normalised per head (Qwen3's q_norm, k_norm over head_dim): with its
# heads over x, each rank of x gives those weights the gradient of its own heads only (par4d's HeadRMSNorm
# sums them over x).
HEAD_NORMS = ("q_norm", "k_norm")
ATTENTION["GPT2Attention"] = (("c_attn",), "c_proj")
# Attention that runs on sequences cut over a context axis (par4d.adopt.context: through transformers' attention
# interface, rotary positions from the global position_ids)
CONTEXT_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "MixtralAttention", "Qwen3MoeAttention")
REPLICATED = Placement((), grad_sum=BATCH_AXES)
NORM_WHY = "a norm over features, which are whole between blocks: kept whole (its gradient summed over z and data)"
STREAM_NORM_WHY = ("a norm over the residual stream, whose features are split over y between blocks: its weight "
                   "split so, its statistics summed over y")


@dataclass(frozen=True)
class Treatment:
    """One layer of the plan: its name, what it became and why."""

    name: str
    kind: str          # normal, transposed or replicated; sharded: a norm over the stream's features over y
    why: str
    shard: tuple[int, ...] | None = None
    messages: tuple[Message, ...] = ()    # its collectives in one step (given an example batch)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D (weight (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def _embedding(module: nn.Embedding, name: str, grid: Grid, output_layout: str) -> Embedding:
    odd = [f"{k}={getattr(module, k)}" for k in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(module, k)]
    if odd:
        raise ValueError(f"parallelize: {name} is nn.Embedding({', '.join(odd)}), which par4d's Embedding does not "
                         f"do (force it replicated to keep it whole)")
    return Embedding(module.num_embeddings, module.embedding_dim, grid=grid, name=name, initialize=False,
                     output_layout=output_layout, padding_idx=module.padding_idx)


def _layouts(role: Role | None) -> dict[str, str]:
    """A layer's layouts in and out: sharded inside a recognised block, whole at its edges and alone."""
    return {"input_layout": "sharded" if role and role.sharded_in else "whole",
            "output_layout": "sharded" if role and role.sharded_out else "whole"}


def _conv2d(module: nn.Conv2d, name: str, kind: str, role: Role | None, grid: Grid) -> Conv2d:
    """The par4d convolution for ``module``; what it cannot represent raises, naming it."""
    square = [v[0] for v in (module.stride, module.padding) if isinstance(v, tuple) and len(set(v)) == 1]
    if (module.groups != 1 or module.dilation != (1, 1) or module.padding_mode != "zeros" or len(square) != 2):
        raise ValueError(f"parallelize: {name} is nn.Conv2d(groups={module.groups}, dilation={module.dilation}, "
                         f"padding={module.padding}, stride={module.stride}, padding_mode={module.padding_mode!r}); "
                         f"par4d's Conv2d takes groups=1, no dilation, zero padding and equal strides and paddings "
                         f"(force it replicated to keep it whole)")
    return Conv2d(module.in_channels, module.out_channels, module.kernel_size, square[0], square[1],
                  module.bias is not None, kind == "transposed", grid=grid, name=name, initialize=False,
                  **_layouts(role))


@dataclass(frozen=True)
class Role:
    """What a recognised block asks of one of its layers."""

    kind: str                   # normal or transposed
    why: str
    sharded_in: bool = False    # takes its input features as the layer before left them (sharded)
    sharded_out: bool = False   # leaves its output features sharded for the layer after
    chunks: int = 1             # out-features in equal chunks, each split (a fused q, k, v)
    block: tuple[str, ...] = ()  # the layers of its block: sharded only if all keep their roles
    sets: tuple = ()            # (module, attribute, value): what the block's module needs to know of the shards


def _attention(module: nn.Module, at: str, grid: Grid, roles: dict[str, Role]) -> None:
    """Roles for a recognised attention block: its q, k, v projections normal (out-features
    over x: whole heads per rank, so attention itself runs on local heads with no
    collective), its output projection transposed; or lone layers if x does not divide the
    heads (the why says so, with the numbers)."""
    projections, out = ATTENTION[type(module).__name__]
    if getattr(module, "is_cross_attention", False) or not all(
            _is_linear(getattr(module, n, None)) for n in (*projections, out)):
        return
    heads = module.config.num_attention_heads
    kv = getattr(module.config, "num_key_value_heads", None) or heads
    g = grid.size("x")
    if heads % g or kv % g:
        why = (f"attention with {heads} query and {kv} key/value heads, which x={g} does not divide: "
               f"a lone layer (whole features in and out)")
        roles.update({f"{at}{n}": Role("normal", why) for n in (*projections, out)})
        return
    fused = len(projections) == 1             # GPT-2's c_attn: q, k and v side by side
    heads_per_rank = f"{heads // g} of {heads} query heads" + (f" and {kv // g} of {kv} key/value heads" if kv != heads
                                                              else "")
    block = tuple(f"{at}{n}" for n in (*projections, out))
    # GPT-2 splits its fused projection's output into q, k, v by this width: now the local one
    sets = ((module, "split_size", module.split_size // g),) if fused else ()
    for n in projections:
        roles[f"{at}{n}"] = Role("normal", f"attention's {n}: {heads_per_rank} per rank of x; activations stay "
                                           f"sharded to {out}", sharded_out=True, chunks=3 if fused else 1,
                                 block=block, sets=sets)
    roles[f"{at}{out}"] = Role("transposed", "attention's output projection: takes the local heads' outputs "
                                             "(sharded over x) as they are", sharded_in=True, block=block)


def _roles(model: nn.Module, grid: Grid) -> dict[str, Role]:
    """{layer name: role} for the blocks this module recognises (feed-forward pairs and attention)."""
    roles: dict[str, Role] = {}
    pair_why = "the {} half of a feed-forward pair: activations stay sharded between them"
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        if type(module).__name__ in ATTENTION:
            _attention(module, at, grid, roles)
        gated = PAIRED.get(type(module).__name__)
        if gated and all(_is_linear(getattr(module, n, None)) for n in (*gated[0], gated[1])):
            block = tuple(f"{at}{n}" for n in (*gated[0], gated[1]))
            roles.update({f"{at}{n}": Role("normal", pair_why.format("normal"), sharded_out=True, block=block)
                          for n in gated[0]})
            roles[f"{at}{gated[1]}"] = Role("transposed", pair_why.format("transposed"), sharded_in=True, block=block)
        if isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for i, (name, child) in enumerate(children):
                if not isinstance(child, (nn.Linear, nn.Conv2d)) or f"{at}{name}" in roles:
                    continue
                j = i + 1
                while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                    j += 1
                if j < len(children) and type(children[j][1]) is type(child):     # Linear-Linear, Conv2d-Conv2d
                    block = (f"{at}{name}", f"{at}{children[j][0]}")
                    roles[block[0]] = Role("normal", pair_why.format("normal"), sharded_out=True, block=block)
                    roles[block[1]] = Role("transposed", pair_why.format("transposed"), sharded_in=True, block=block)
    return roles


def _decide(name: str, module: nn.Module, roles: dict[str, Role], force: dict[str, str],
            names: dict[int, list[str]]) -> tuple[str, str]:
    """(treatment, why) of one layer, before its block is checked: forced, tied, its role, or lone."""
    kind = _forced(name, force)
    tied = [n for n in names[id(module.weight)] if n != f"{name}.weight"]
    if tied and kind not in (None, "replicated"):
        raise ValueError(f"parallelize: {name} is forced {kind}, but its weight is tied to {tied[0]}, "
                         f"which par4d cannot shard apart")
    if tied:
        return "replicated", f"its weight is tied to {tied[0]}: kept whole"
    if kind is not None:
        return kind, "forced"
    if name in roles:
        return roles[name].kind, roles[name].why
    if isinstance(module, nn.Embedding):
        return "normal", "an embedding: rows over z, features over y, gathered to whole features"
    return "normal", "a lone layer: whole features in and out"


def _replacement(module: nn.Module, name: str, kind: str, role: Role | None, grid: Grid, stream: bool) -> nn.Module:
    """The par4d layer standing for ``module`` (its values are loaded next). ``stream``: the residual
    stream is sharded over y, so embeddings write it so and a lone layer (the head) reads it so."""
    if isinstance(module, nn.Conv2d):
        return _conv2d(module, name, kind, role, grid)
    if isinstance(module, nn.Embedding):
        return _embedding(module, name, grid, "sharded" if stream else "whole")
    in_features, out_features = _sizes(module)
    layouts = _layouts(role)
    if stream and role is None:
        layouts["input_layout"] = "sharded"
    return Linear(in_features, out_features, module.bias is not None, kind == "transposed", grid=grid,
                  out_chunks=role.chunks if role else 1, name=name, initialize=False, **layouts,
                  weight_layout="out_in" if isinstance(module, nn.Linear) else "in_out")


def _indivisible(module: nn.Module, name: str, kind: str, role: Role | None, virtual: Grid) -> str | None:
    """Why ``module`` cannot be cut as ``kind`` on the (virtual) grid's sizes, or None: built there once,
    shapes only (the meta device)."""
    try:
        _replacement(module, name, kind, role, virtual, stream=False)
    except Indivisible as error:
        return str(error)
    return None


def _streamed(role: Role) -> Role:
    """A block's role when the residual stream is sharded over y: its first layers (normal) take the
    stream's features over y as they are, its last (transposed) leave theirs over y."""
    if role.kind == "normal" and not role.sharded_in:
        return replace(role, sharded_in=True)
    if role.kind == "transposed" and not role.sharded_out:
        return replace(role, sharded_out=True)
    return role


def _batch_norms(model: nn.Module, grid: Grid, counted: bool) -> list[Treatment]:
    """Every batch norm, in place and under its name, made par4d's BatchNorm holding the same
    tensors where samples are split (z*data > 1), so its statistics are the whole batch's; their
    plan rows. ``counted``: with their collectives per step (the backward's assumes the input
    needs a gradient, as after any trained layer)."""
    split = grid.size(*BATCH_AXES) > 1
    axes = tuple(a for a in BATCH_AXES if grid.size(a) > 1)
    made: dict[int, BatchNorm] = {}
    rows = []
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        if not split:
            rows.append(Treatment(name, "replicated", "a batch norm with every sample on each rank (z*data=1): "
                                                      "torch's, kept whole (its gradient summed over z and data)"))
            continue
        if not isinstance(module, BatchNorm):
            if id(module) not in made:
                made[id(module)] = BatchNorm.from_module(module, grid=grid, name=name)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, made[id(module)])
        c = module.num_features
        messages = (("all_reduce", axes, grid.size(*axes) * 3 * c), ("all_reduce", axes, 2 * c)) if counted else ()
        rows.append(Treatment(name, "replicated", f"a batch norm: statistics synchronised over z and data "
                                                  f"(z*data={grid.size(*axes)}), so they are the whole batch's; "
                                                  f"kept whole (its gradient summed over z and data)",
                              messages=messages))
    return rows


def _mixtures(model: nn.Module, grid: Grid, stream: bool) -> list[Treatment]:
    """Every sparse mixture-of-experts block transformers built (:data:`par4d.adopt.moe.MIXTURES`), in place and
    under its name, made par4d's :class:`par4d.adopt.moe.SparseMoE` holding the same tensors; their plan rows
    (their all-to-alls depend on the routing: the ledger counts them as they run)."""
    rows = []
    for name, module in list(model.named_modules()):
        if type(module).__name__ not in MIXTURES:
            continue
        mixture = SparseMoE(module, grid, name, stream)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mixture)
        rows.append(Treatment(name, "experts", f"a mixture of {mixture.n_experts} experts, top {mixture.top_k}: "
                                               f"{mixture.n_experts // grid.size('expert')} per rank of expert="
                                               f"{grid.size('expert')}, each cut over x, y and z as a gated MLP; "
                                               f"tokens exchanged over expert",
                              tuple(mixture.experts.gate_up_proj.shape)))
    return rows


def _per_head_norms(model: nn.Module, grid: Grid, roles: dict[str, Role]) -> None:
    """Per-head query and key norms (:data:`HEAD_NORMS`) of attention whose heads are over x: par4d's
    :class:`par4d.nn.norm.HeadRMSNorm` under the same name, holding the same weight, whose gradient is summed
    over x as it is made (each rank of x gives its own heads')."""
    if grid.size("x") == 1:
        return
    for prefix, module in list(model.named_modules()):
        projections = ATTENTION.get(type(module).__name__, ((), None))[0]
        if not (projections and all(f"{prefix}.{n}" in roles for n in projections)):
            continue
        for name in HEAD_NORMS:
            norm = getattr(module, name, None)
            if norm is None:
                continue
            eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
            head = HeadRMSNorm(norm.weight.shape[0], grid=grid, eps=eps)
            if not norm.weight.is_meta:
                head.weight.data.copy_(norm.weight.detach())
            else:
                head.weight = nn.Parameter(torch.empty_like(norm.weight))
            setattr(module, name, head)


def _forced(name: str, force: dict[str, str]) -> str | None:
    hits = [kind for pattern, kind in force.items() if fnmatch.fnmatchcase(name, pattern)]
    return hits[-1] if hits else None


@torch.no_grad()
def parallelize(model: nn.Module, grid: Grid, *, force: dict[str, str] | None = None,
                example: tuple | dict | None = None, report: bool = False, shard_stream: bool = True) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers (in place) by par4d's, keeping names and values;
    returns the model, whose ``par4d.state(model).plan`` lists every layer's :class:`Treatment`.

    ``force``: {name pattern (fnmatch): normal, transposed or replicated}, the last match
    wins; a forced normal or transposed layer is a lone one (whole features around it).
    ``example``: the inputs of one step's whole batch, ``model(*example)`` or
    ``model(**example)`` (meta tensors will do): the plan then has each layer's collectives
    per step (:mod:`par4d.adopt.messages`), and the state's ``sync_messages`` the data-parallel sums.
    ``report``: print the plan. ``shard_stream``: shard the residual stream over y where par4d knows
    every use of it (:mod:`par4d.adopt.stream`; False: keep it whole, the state's ``stream`` is 1).
    A layer whose sizes the grid does not divide is kept whole (replicated), its plan row naming the
    numbers; one forced normal or transposed raises, naming them and the ``force`` that keeps it whole."""
    force = dict(force or {})
    bad = [k for k in force.values() if k not in TREATMENTS]
    if bad:
        raise ValueError(f"parallelize: unknown treatment {bad[0]!r}; give one of {', '.join(TREATMENTS)}")
    batch_norms = _batch_norms(model, grid, counted=example is not None)
    roles = _roles(model, grid)
    role_of = dict(roles)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    layers = [(n, m) for n, m in model.named_modules() if _is_linear(m) or isinstance(m, (nn.Conv2d, nn.Embedding))]
    decided = {name: _decide(name, module, roles, force, names) for name, module in layers}
    virtual = Grid.virtual(grid.sizes, grid.rank)
    changed = True
    while changed:     # until every layer that is cut divides the grid, and blocks hold only such layers
        for name, role in list(roles.items()):     # a block is sharded only if all its layers keep their roles
            broken = [m for m in role.block if decided[m][1] != role_of[m].why]
            if broken:
                del roles[name]
                if decided[name][1] == role.why:
                    decided[name] = ("normal", f"a lone layer: {broken[0]} of its block is {decided[broken[0]][0]}")
        changed = False
        for name, module in layers:
            kind, why = decided[name]
            problem = None if kind == "replicated" else _indivisible(module, name, kind, roles.get(name), virtual)
            if problem is not None and why == "forced":
                raise ValueError(f"parallelize: {name} is forced {kind}, but {problem} (force={{{name!r}: "
                                 f"'replicated'}} keeps it whole)")
            if problem is not None:
                decided[name], changed = ("replicated", f"{KEPT_WHOLE}: {problem}"), True
    in_blocks = {name for name, role in roles.items() if role.block}
    forced = any(why == "forced" or why.startswith(KEPT_WHOLE) for _, why in decided.values())
    stream = shard_stream and stream_problem(model, grid, layers, in_blocks, forced) is None   # over y between blocks
    if stream:
        roles = {name: _streamed(role) for name, role in roles.items()}
    norms = [(n, m) for n, m in model.named_modules() if is_norm(m)]
    seen = record(model, [n for n, _ in layers + norms], example) if example is not None else {}
    plan: list[Treatment] = []
    for name, module in layers:
        kind, why = decided[name]
        if kind == "replicated":
            messages = ()
            if stream and isinstance(module, nn.Embedding):      # whole here, its block of features kept
                split_output(module, grid)
                messages = hook_messages("split", module, seen.get(name), grid.sizes)
            elif stream:                                         # a head whole here reads the stream gathered
                gather_input(module, grid)
                messages = hook_messages("gather", module, seen.get(name), grid.sizes)
            plan.append(Treatment(name, kind, why, messages=messages))
            continue
        layer = _replacement(module, name, kind, roles.get(name), grid, stream)
        weights = dict(module.named_parameters(recurse=False))
        if not module.weight.is_meta:          # on the meta device: its shards are loaded next (load_safetensors)
            layer.load_full_state({k: v.detach().to(layer.weight.device, layer.weight.dtype)
                                   for k, v in weights.items()})
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        messages = tuple(layer_messages(layer, seen[name], grid.sizes)) if seen else ()
        plan.append(Treatment(name, kind, why, tuple(layer.weight.shape), messages))
        names[id(layer.weight)] = [f"{name}.weight"]
    for role in roles.values():
        for module, attribute, value in role.sets:
            setattr(module, attribute, value)
    for name, module in norms:
        if not stream:
            plan.append(Treatment(name, "replicated", NORM_WHY))
            continue
        norm = stream_norm(module, name, grid)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, norm)
        messages = tuple(norm_messages(norm, seen[name], grid.sizes)) if seen else ()
        plan.append(Treatment(name, "sharded", STREAM_NORM_WHY, tuple(norm.weight.shape), messages))
    plan += _mixtures(model, grid, stream)
    _per_head_norms(model, grid, roles)
    if grid.size("context") > 1:      # each sequence cut over context: attention runs around its ring
        cut_sequences(model, grid, CONTEXT_ATTENTION)
    plan += batch_norms
    for param in model.parameters():
        if placement_of(param) is None:        # whole on every rank: its gradient is summed over z and data
            place(param, REPLICATED)
    parallel = state(model)
    parallel.plan = plan
    parallel.stream = grid.size("y") if stream else 1     # the residual stream's features cut in this many
    parallel.sync_messages = tuple(sync_messages(model, grid.sizes)) if seen else ()
    if report:
        print(plan_table(plan, parallel.sync_messages, grid.sizes, counted=bool(seen)))
    return model


def kept_whole(model: nn.Module) -> dict[str, str]:
    """Layer name -> why, for every layer ``parallelize`` kept whole because the grid does not divide its sizes,
    in ``model`` or any module inside it that ``parallelize`` made parallel."""
    return {row.name: row.why for module in model.modules() if has_state(module)
            for row in state(module).plan if row.why.startswith(KEPT_WHOLE)}


def plan_table(plan: list[Treatment], sync: tuple[Message, ...], sizes: dict[str, int], counted: bool) -> str:
    """The plan as ``report=True`` prints it: a line per layer (treatment, shard, bytes each
    rank sends per step if ``counted``, why) and the step's total."""
    def sent(messages) -> str:
        return f"{sum(bytes_sent(m, sizes) for m in messages) / 1024:,.1f} KiB" if counted else "-"

    width = max((len(t.name) for t in plan), default=5)
    lines = [f"{'layer':<{width}}  {'treatment':<10}  {'shard':<14}  {'sent/step':>12}  why"]
    lines += [f"{t.name:<{width}}  {t.kind:<10}  {str(t.shard or 'whole'):<14}  {sent(t.messages):>12}  {t.why}"
              for t in plan]
    if counted:
        every = [m for t in plan for m in t.messages] + list(sync)
        lines.append(f"{'data-parallel sums':<{width}}  {'':<10}  {'':<14}  {sent(sync):>12}  gradients summed over "
                     f"z and data after backward")
        lines.append(f"{'total':<{width}}  {'':<10}  {'':<14}  {sent(every):>12}  per rank per step, fp32 "
                     f"(ring collectives: the planner's Eqs 1-3)")
    return "\n".join(lines)
