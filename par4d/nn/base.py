"""What every sharded par4d module offers: its parameters as full tensors, both ways.

A :class:`ShardedModule`'s own parameters each carry a :class:`~par4d.layout.Placement`;
assembling and cutting them is :mod:`par4d.layout`'s work, so no layer slices by hand.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from par4d.grid import Grid
from par4d.layout import placement_of, shard, unshard


class ShardedModule(nn.Module):
    """A module whose own parameters are shards of full tensors, on ``self.grid``.

    ``full_state`` assembles them (a collective: call on every rank) and
    ``load_full_state`` keeps this rank's shards of given full tensors.
    """

    grid: Grid

    def _placed(self):
        for name, param in self.named_parameters(recurse=False):
            placement = placement_of(param)
            assert placement is not None, f"{type(self).__name__}.{name} has no placement"
            yield name, param, placement

    @torch.no_grad()
    def full_tensor(self, param: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """One own parameter (or its gradient) as a full tensor, on every rank (collective; a copy)."""
        return unshard(self.grid, (param.grad if grad else param).detach(), placement_of(param))

    def full_state(self, grad: bool = False) -> dict[str, torch.Tensor]:
        return {name: self.full_tensor(param, grad) for name, param, _ in self._placed()}

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, param, placement in self._placed():
            param.copy_(shard(self.grid, state[name], placement))

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of each of this module's own parameters."""
        return {name: placement.full_shape(tuple(param.shape), self.grid) for name, param, placement in self._placed()}


def full_state_dict(model: nn.Module, grad: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` (or its gradient) as a full tensor, on every rank (a
    collective), named as ``state_dict`` names them (tied ones under each name); a parameter
    of a module that is not sharded (replicated, as ``par4d.parallelize`` leaves it) is
    copied as it is."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        at = f"{prefix}." if prefix else ""
        if isinstance(module, ShardedModule):
            out.update({at + name: tensor for name, tensor in module.full_state(grad).items()})
            continue
        for name, param in module.named_parameters(recurse=False):
            out[at + name] = (param.grad if grad else param).detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full tensors (e.g. a single-device twin's ``state_dict``) into the shards.

    Every parameter must be given and every given tensor used: a mismatch raises
    ``ValueError`` naming the keys.
    """
    used = set()
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedModule):
            names = list(dict(module.named_parameters(recurse=False)))
            keys = {n: f"{prefix}.{n}" if prefix else n for n in names}
            missing = [k for k in keys.values() if k not in state]
            if missing:
                raise ValueError(f"full state is missing {missing}")
            for name, shape in module.full_shapes().items():
                if tuple(state[keys[name]].shape) != shape:
                    raise ValueError(f"full state {keys[name]!r} has shape {tuple(state[keys[name]].shape)}, "
                                     f"the model expects {shape}")
            module.load_full_state({n: state[k] for n, k in keys.items()})
            used |= set(keys.values())
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ValueError(f"full state has keys the model does not: {unexpected}")
