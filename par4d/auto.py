"""``par4d.parallelize(model, grid)``: Algorithm 1 for a model nobody here wrote.

Every ``nn.Linear`` becomes a :class:`par4d.nn.Linear` holding its shard of the same
weight and bias, under the same name; every other parameter stays whole on every rank
(replicated: its gradient is summed over the batch's axes, z and data). Samples are split
over z and data as for par4d's own GPT (``layout.shard_batch``).

Activations between layers this module does not recognise are whole (every feature on
every rank of x and y), which is correct for any model: a lone layer cuts its input's
features for its in-axis (free) and all-gathers its output's over its out-axis
(``SplitFeatures`` / ``GatherFeatures``). Where it recognises a feed-forward pair, a
normal layer then a transposed one with only elementwise work between (an
``nn.Sequential`` of Linear, activations, Linear; the gated MLPs of Llama-like models:
``down(act(gate(x)) * up(x))``), the activations stay sharded between the two, as in the
4D paper's transposed alternation: no collective at that boundary.

Not yet (docs/architecture.md): attention's projections are lone layers (their heads
are not split); Hugging Face GPT-2's ``Conv1D``, ``nn.Conv2d`` and ``nn.Embedding`` stay
replicated; models on the meta device; the planner's communication per step in the plan.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.nn as nn

from par4d.grid import Grid
from par4d.layout import Placement, place, placement_of
from par4d.nn.base import ShardedModule
from par4d.nn.collectives import GatherFeatures, SplitFeatures
from par4d.nn.linear import Linear

TREATMENTS = ("normal", "transposed", "replicated")
ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.LeakyReLU)
# Gated feed-forward blocks by class name: (the layers whose outputs meet elementwise, the layer after).
GATED = {name: (("gate_proj", "up_proj"), "down_proj") for name in ("LlamaMLP", "MistralMLP", "Qwen2MLP")}
REPLICATED = Placement((), grad_sum=("z", "data"))


@dataclass(frozen=True)
class Treatment:
    """One layer of the plan: its name, what it became and why."""

    name: str
    kind: str          # normal, transposed or replicated
    why: str
    shard: tuple[int, ...] | None = None


class AutoLinear(Linear):
    """A par4d Linear standing where an ``nn.Linear`` was: it takes whole features unless
    ``sharded_in`` (the transposed half of a pair) and gives whole features unless
    ``sharded_out`` (the normal half)."""

    sharded_in: bool = False
    sharded_out: bool = False

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if not self.sharded_in:
            inp = SplitFeatures.apply(inp, self.grid, self.in_axis)
        out = super().forward(inp)
        return out if self.sharded_out else GatherFeatures.apply(out, self.grid, self.out_axis)


def _pairs(model: nn.Module) -> dict[str, str]:
    """{layer name: normal or transposed} for the feed-forward pairs this module recognises."""
    out: dict[str, str] = {}
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        gated = GATED.get(type(module).__name__)
        if gated and all(isinstance(getattr(module, n, None), nn.Linear) for n in (*gated[0], gated[1])):
            out.update({f"{at}{n}": "normal" for n in gated[0]} | {f"{at}{gated[1]}": "transposed"})
        if isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for i, (name, child) in enumerate(children):
                if not isinstance(child, nn.Linear) or f"{at}{name}" in out:
                    continue
                j = i + 1
                while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                    j += 1
                if j < len(children) and isinstance(children[j][1], nn.Linear):
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
    pairs = _pairs(model)
    shared: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in shared:
            raise ValueError(f"parallelize: {name} is the same tensor as {shared[id(param)]} (tied weights), "
                             f"which par4d cannot shard apart yet")
        shared[id(param)] = name
    plan: list[Treatment] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        kind, why = _forced(name, force), "forced"
        if kind is None:
            kind = pairs.get(name, "normal")
            why = (f"the {kind} half of a feed-forward pair: activations stay sharded between them"
                   if name in pairs else "a lone layer: whole features in and out")
        if kind == "replicated":
            plan.append(Treatment(name, kind, why))
            continue
        layer = AutoLinear(module.in_features, module.out_features, module.bias is not None, kind == "transposed",
                           grid=grid, name=name, initialize=False)
        paired = name in pairs and why != "forced"
        layer.sharded_out, layer.sharded_in = paired and kind == "normal", paired and kind == "transposed"
        state = {"weight": module.weight}
        if module.bias is not None:
            state["bias"] = module.bias
        layer.load_full_state({k: v.detach().to(layer.weight.device, layer.weight.dtype) for k, v in state.items()})
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        plan.append(Treatment(name, kind, why, tuple(layer.weight.shape)))
    for param in model.parameters():
        if placement_of(param) is None:        # whole on every rank: its gradient is summed over z and data
            place(param, REPLICATED)
    model.par4d_plan = plan
    if report:
        width = max((len(t.name) for t in plan), default=4)
        print("\n".join(f"{t.name:<{width}}  {t.kind:<10}  shard {t.shard or 'whole'}  {t.why}" for t in plan))
    return model


@torch.no_grad()
def full_state_dict(model: nn.Module, grad: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of a parallelized model as a full tensor, on every rank
    (collective), named as in the original model."""
    out = {}
    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, ShardedModule):
                out[at + name] = module.full_tensor(param, grad)
            else:
                out[at + name] = (param.grad if grad else param).detach().clone()
    return out
