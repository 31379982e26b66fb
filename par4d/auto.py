"""``par4d.parallelize(model, grid)``: Algorithm 1 for a model nobody here wrote.

Every ``nn.Linear`` (and Hugging Face's ``Conv1D``, GPT-2's: a linear layer whose weight
is stored (in, out)) becomes a :class:`par4d.nn.Linear`, every ``nn.Conv2d`` a
:class:`par4d.nn.Conv2d` (channels in dim 1 play features), holding its shard of the same
weight and bias, under the same name and in the same orientation; every other parameter
stays whole on every rank (replicated: its gradient is summed over the batch's axes, z
and data), and so does a layer whose weight is tied to another parameter (the plan says
so). Samples are split over z and data as for par4d's own GPT (``layout.shard_batch``), so
a batch norm, whose statistics would be those of a rank's samples, is refused there.

Activations between layers this module does not recognise are whole (every feature on
every rank of x and y), which is correct for any model: a lone layer cuts its input's
features for its in-axis (free) and all-gathers its output's over its out-axis
(``SplitFeatures`` / ``GatherFeatures``). Where it recognises a feed-forward pair, a
normal layer then a transposed one with only elementwise work between (an
``nn.Sequential`` of Linear, activations, Linear; GPT-2's MLP; the gated MLPs of
Llama-like models: ``down(act(gate(x)) * up(x))``), the activations stay sharded between
the two, as in the 4D paper's transposed alternation: no collective at that boundary.

Not yet (docs/architecture.md): attention's projections are lone layers (their heads are
not split); ``nn.Embedding`` stays replicated (so do norms: batch norm's statistics
would be those of this rank's samples); models on the meta device;
the planner's communication per step in the plan.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.grid import Grid
from par4d.layout import Placement, Split, place, placement_of
from par4d.nn.collectives import GatherFeatures, SplitFeatures
from par4d.nn.conv import Conv2d
from par4d.nn.linear import Linear, _Algorithm1

TREATMENTS = ("normal", "transposed", "replicated")
ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.LeakyReLU)
# Feed-forward blocks by class name: (the layers whose outputs meet elementwise, the layer after).
PAIRED = {name: (("gate_proj", "up_proj"), "down_proj") for name in ("LlamaMLP", "MistralMLP", "Qwen2MLP")}
PAIRED["GPT2MLP"] = (("c_fc",), "c_proj")
REPLICATED = Placement((), grad_sum=("z", "data"))


@dataclass(frozen=True)
class Treatment:
    """One layer of the plan: its name, what it became and why."""

    name: str
    kind: str          # normal, transposed or replicated
    why: str
    shard: tuple[int, ...] | None = None


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D (weight (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


class AutoLinear(Linear):
    """A par4d Linear standing where an ``nn.Linear`` or a ``Conv1D`` was: it takes whole
    features unless ``sharded_in`` (the transposed half of a pair) and gives whole features
    unless ``sharded_out`` (the normal half). ``stored_in_out``: the weight is kept as the
    Conv1D's (in, out), cut as the transpose of a Linear's (Algorithm 1 gets its transpose,
    a view)."""

    sharded_in: bool = False
    sharded_out: bool = False
    stored_in_out: bool = False

    def store_in_out(self) -> None:
        """Keep the weight (in, out), as a Conv1D does, with the same shards transposed."""
        local = self.weight.detach().t().contiguous()
        self.weight = place(nn.Parameter(local), Placement((Split(1, self.out_axis), Split(0, self.in_axis),
                                                            Split(1, "z")), grad_sum=("data",)))
        self.stored_in_out = True

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if not self.sharded_in:
            inp = SplitFeatures.apply(inp, self.grid, self.in_axis)
        weight = self.weight.t() if self.stored_in_out else self.weight     # (out, in) shard either way
        if self.grid.size(self.in_axis, self.out_axis, "z") == 1:
            out = F.linear(inp, weight, self.bias)
        else:
            out = _Algorithm1.apply(inp, weight, self.bias, self)
        return out if self.sharded_out else GatherFeatures.apply(out, self.grid, self.out_axis)


class AutoConv2d(Conv2d):
    """A par4d Conv2d standing where an ``nn.Conv2d`` was; whole channels (dim 1) in and out
    unless ``sharded_in`` / ``sharded_out``, as :class:`AutoLinear`'s features."""

    sharded_in: bool = False
    sharded_out: bool = False

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if not self.sharded_in:
            inp = SplitFeatures.apply(inp.movedim(1, -1), self.grid, self.in_axis).movedim(-1, 1)
        out = super().forward(inp.contiguous())
        if self.sharded_out:
            return out
        return GatherFeatures.apply(out.movedim(1, -1), self.grid, self.out_axis).movedim(-1, 1)


def _conv2d(module: nn.Conv2d, name: str, kind: str, grid: Grid) -> AutoConv2d:
    """The par4d convolution for ``module``; what it cannot represent raises, naming it."""
    square = [v[0] for v in (module.stride, module.padding) if isinstance(v, tuple) and len(set(v)) == 1]
    if (module.groups != 1 or module.dilation != (1, 1) or module.padding_mode != "zeros" or len(square) != 2):
        raise ValueError(f"parallelize: {name} is nn.Conv2d(groups={module.groups}, dilation={module.dilation}, "
                         f"padding={module.padding}, stride={module.stride}, padding_mode={module.padding_mode!r}); "
                         f"par4d's Conv2d takes groups=1, no dilation, zero padding and equal strides and paddings "
                         f"(force it replicated to keep it whole)")
    return AutoConv2d(module.in_channels, module.out_channels, module.kernel_size, square[0], square[1],
                      module.bias is not None, kind == "transposed", grid=grid, name=name, initialize=False)


def _pairs(model: nn.Module) -> dict[str, str]:
    """{layer name: normal or transposed} for the feed-forward pairs this module recognises."""
    out: dict[str, str] = {}
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        gated = PAIRED.get(type(module).__name__)
        if gated and all(_is_linear(getattr(module, n, nn.Identity())) for n in (*gated[0], gated[1])):
            out.update({f"{at}{n}": "normal" for n in gated[0]} | {f"{at}{gated[1]}": "transposed"})
        if isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for i, (name, child) in enumerate(children):
                if not isinstance(child, (nn.Linear, nn.Conv2d)) or f"{at}{name}" in out:
                    continue
                j = i + 1
                while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                    j += 1
                if j < len(children) and type(children[j][1]) is type(child):     # Linear-Linear, Conv2d-Conv2d
                    out[f"{at}{name}"], out[f"{at}{children[j][0]}"] = "normal", "transposed"
    return out


def _forced(name: str, force: dict[str, str]) -> str | None:
    hits = [kind for pattern, kind in force.items() if fnmatch.fnmatchcase(name, pattern)]
    return hits[-1] if hits else None


@torch.no_grad()
def parallelize(model: nn.Module, grid: Grid, *, force: dict[str, str] | None = None,
                report: bool = False) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers (in place) by par4d's, keeping names and values;
    returns the model, whose ``par4d_plan`` lists every layer's :class:`Treatment`.

    ``force``: {name pattern (fnmatch): normal, transposed or replicated}, the last match
    wins; a forced normal or transposed layer is a lone one (whole features around it).
    ``report``: print the plan. A layer whose sizes the grid does not divide raises, naming
    the layer and the numbers (force it ``replicated`` to keep it whole)."""
    force = dict(force or {})
    bad = [k for k in force.values() if k not in TREATMENTS]
    if bad:
        raise ValueError(f"parallelize: unknown treatment {bad[0]!r}; give one of {', '.join(TREATMENTS)}")
    if grid.size("z", "data") > 1:
        norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            raise ValueError(f"parallelize: {norms[0]} is a batch norm, whose statistics would be those of one "
                             f"rank's samples (the batch is split over z*data={grid.size('z', 'data')}); par4d "
                             f"cannot synchronise them yet: use z=data=1, or a norm over features")
    pairs = _pairs(model)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    plan: list[Treatment] = []
    for name, module in list(model.named_modules()):
        if not (_is_linear(module) or isinstance(module, nn.Conv2d)):
            continue
        kind, why = _forced(name, force), "forced"
        tied = [n for n in names[id(module.weight)] if n != f"{name}.weight"]
        if tied and kind not in (None, "replicated"):
            raise ValueError(f"parallelize: {name} is forced {kind}, but its weight is tied to {tied[0]}, "
                             f"which par4d cannot shard apart")
        if tied:
            kind, why = "replicated", f"its weight is tied to {tied[0]}: kept whole"
        elif kind is None:
            kind = pairs.get(name, "normal")
            why = (f"the {kind} half of a feed-forward pair: activations stay sharded between them"
                   if name in pairs else "a lone layer: whole features in and out")
        if kind == "replicated":
            plan.append(Treatment(name, kind, why))
            continue
        if isinstance(module, nn.Conv2d):
            layer = _conv2d(module, name, kind, grid)
        else:
            in_features, out_features = _sizes(module)
            layer = AutoLinear(in_features, out_features, module.bias is not None, kind == "transposed",
                               grid=grid, name=name, initialize=False)
            if not isinstance(module, nn.Linear):
                layer.store_in_out()
        paired = name in pairs and why != "forced"
        layer.sharded_out, layer.sharded_in = paired and kind == "normal", paired and kind == "transposed"
        state = {"weight": module.weight}
        if module.bias is not None:
            state["bias"] = module.bias
        layer.load_full_state({k: v.detach().to(layer.weight.device, layer.weight.dtype) for k, v in state.items()})
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        plan.append(Treatment(name, kind, why, tuple(layer.weight.shape)))
        names[id(layer.weight)] = [f"{name}.weight"]
    for param in model.parameters():
        if placement_of(param) is None:        # whole on every rank: its gradient is summed over z and data
            place(param, REPLICATED)
    model.par4d_plan = plan
    if report:
        width = max((len(t.name) for t in plan), default=4)
        print("\n".join(f"{t.name:<{width}}  {t.kind:<10}  shard {t.shard or 'whole'}  {t.why}" for t in plan))
    return model
