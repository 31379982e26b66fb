"""Float8 training of par4d's Linear layers: each rank's three local GEMMs (forward, input gradient, weight
gradient) in float8, by torchao's recipes, while Algorithm 1's collectives around them move the layer's own
dtype as before.

torchao's ``Float8Linear`` swaps ``nn.Linear`` and runs its three GEMMs inside one autograd function; a par4d
Linear runs Algorithm 1's (par4d.nn.algorithm1), which calls each local GEMM by itself through the layer's
GEMM plan (``Linear.gemm``). :class:`Float8Gemm` is such a plan: for each GEMM it casts both operands as the
recipe casts that GEMM's (torchao's dynamic scaling: per tensor, or per row for the rowwise recipes; e4m3 or
e5m2; an operand a recipe keeps in high precision stays so) and multiplies them with ``torch._scaled_mm``
through torchao's float8 tensor. The scales are a rank's own: a shard's amax, not the whole tensor's (as a
GEMM of the grid computes its block alone), so a grid's float8 numbers are not the single device's.

torchao is imported when a model is converted, never before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn

from par4d.nn.linear import Linear
from par4d.parallel import FLOAT8_RECIPES as RECIPES  # torchao's recipe names (Float8LinearRecipeName)
from par4d.parallel import TORCHAO_MISSING

SKIPPED = ("head", "lm_head")
"""Linear layers left in their own dtype by default: a language model's output projection (float8 logits cost
accuracy and the head is a small share of the FLOPs, as torchtitan's float8 leaves ``output``)."""


@contextmanager
def quiet_torchao() -> Iterator[None]:
    """Around an import that may import torchao (transformers' model classes do, where it is installed): what it
    warns of when imported, users cannot act on: its CUDA kernels' libraries not loading (on a CPU; float8
    training uses torch's own scaled GEMM, not them), torch's deprecation of how it registers an enum."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _torchao() -> SimpleNamespace:
    """What par4d uses of torchao's float8 package, or an ImportError saying how to get it."""
    try:
        with quiet_torchao():
            from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType
            from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
            from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, ScaledMMConfig
    except ImportError as error:     # none, or one whose float8 package is laid out otherwise
        raise ImportError(f"{TORCHAO_MISSING}: {error}") from None
    return SimpleNamespace(**{f.__name__: f for f in (
        Float8LinearConfig, ScalingGranularity, ScalingType, get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic,
        GemmInputRole, LinearMMConfig, ScaledMMConfig)})


def _check_device(device: torch.device) -> None:
    """A GPU without float8 GEMMs (before compute capability 8.9: an A100) is refused before the first step; a
    CPU's are emulated (slow, exact to torchao's casts)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"float8: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has "
                         f"no float8 GEMMs; they need 8.9 or later (Ada, Hopper)")


@dataclass(frozen=True)
class _Operand:
    """How one operand of one GEMM is cast: its cast config (torchao's), its role, the dim its rows of scales
    run along (rowwise recipes), and whether it enters the GEMM transposed."""
    cast: Any
    role: Any
    axis: int
    transposed: bool


class Float8Gemm:
    """A GEMM plan (``Linear.gemm``) running a Linear's local GEMMs in float8 by torchao's ``recipe``."""

    def __init__(self, recipe: str, device: torch.device | None = None):
        """``device``: where the layers compute (a GPU must have float8 GEMMs; None: the CPU)."""
        if recipe not in RECIPES:
            raise ValueError(f"float8 recipe {recipe!r}: give one of {', '.join(RECIPES)}")
        _check_device(device or torch.device("cpu"))
        ao = self.ao = _torchao()
        self.recipe = recipe
        config = self.config = ao.Float8LinearConfig.from_recipe_name(recipe)
        self.mm_config = ao.LinearMMConfig(*(ao.ScaledMMConfig(config.emulate, gemm.use_fast_accum, False,
                                                               config.pad_inner_dim)
                                             for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                                          config.gemm_config_grad_weight)))
        # A GEMM cut into runs of rows (the xy overlap's row chunks, par4d.nn.algorithm1) must give each run the
        # scale the whole would have: true of per-row scales, not of one scale over all rows (tensorwise).
        self.whole_rows = not all(cast.scaling_type is ao.ScalingType.DISABLED
                                  or cast.scaling_granularity is ao.ScalingGranularity.AXISWISE
                                  for cast in (config.cast_config_input, config.cast_config_grad_output))
        role = ao.GemmInputRole
        # par4d's operands of each GEMM (par4d.nn.linear): forward rows @ Aᵀ, input-grad dO @ A, weight-grad
        # dOᵀ @ rows. torchao casts the same products from (rows, Aᵀ) and (dO, rows): A's and dOᵀ's casts are
        # those of Aᵀ and dO, transposed back.
        self.operands = {
            "forward": (_Operand(config.cast_config_input, role.INPUT, -1, False),
                        _Operand(config.cast_config_weight, role.WEIGHT, 0, False)),
            "input-grad": (_Operand(config.cast_config_grad_output, role.GRAD_OUTPUT, -1, False),
                           _Operand(config.cast_config_weight_for_grad_input, role.WEIGHT, -1, True)),
            "weight-grad": (_Operand(config.cast_config_grad_output_for_grad_weight, role.GRAD_OUTPUT, 0, True),
                            _Operand(config.cast_config_input_for_grad_weight, role.INPUT, 0, False)),
        }

    def _cast(self, tensor: torch.Tensor, operand: _Operand) -> torch.Tensor:
        ao = self.ao
        if operand.transposed:
            tensor = tensor.t()
        cast = operand.cast
        if cast.scaling_type is not ao.ScalingType.DISABLED:   # a recipe's high-precision operand stays as it is
            tensor = ao.hp_tensor_to_float8_dynamic(
                tensor, cast.target_dtype, self.mm_config, gemm_input_role=operand.role,
                scaling_granularity=cast.scaling_granularity,
                axiswise_dim=ao.get_maybe_axiswise_dim(operand.axis, cast.scaling_granularity),
                round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)
        return tensor.t() if operand.transposed else tensor

    def mm(self, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
        """``a @ b`` for the Linear's GEMM ``name`` (``forward``, ``input-grad``, ``weight-grad``), in float8;
        the result in ``a``'s dtype."""
        first, second = self.operands[name]
        return torch.mm(self._cast(a, first), self._cast(b, second))

    def __repr__(self) -> str:
        return f"Float8Gemm({self.recipe!r})"


def float8_layers(model: nn.Module) -> list[str]:
    """The paths of ``model``'s Linear layers whose GEMMs run in float8."""
    return [path for path, module in model.named_modules() if isinstance(getattr(module, "gemm", None), Float8Gemm)]


def float8_summary(model: nn.Module) -> dict | None:
    """What a run's summary says of float8 on this rank: the recipe, the layers converted, and whether their GEMMs
    run whole (one scale over all rows: no xy row chunks); None without float8."""
    plans = [module.gemm for module in model.modules() if isinstance(getattr(module, "gemm", None), Float8Gemm)]
    if not plans:
        return None
    return {"recipe": plans[0].recipe, "layers": len(plans), "whole_gemms": plans[0].whole_rows}


def float8(model: nn.Module, recipe: str = "tensorwise", skip: tuple[str, ...] = SKIPPED) -> nn.Module:
    """Train every par4d Linear of ``model`` in float8 by torchao's ``recipe`` (:data:`RECIPES`), but those whose
    name (the last part of the module's path) is in ``skip``; returns the model. Its parameters, their
    gradients and Algorithm 1's collectives keep their dtype; only the local GEMMs change."""
    plan = Float8Gemm(recipe, next(model.parameters()).device)
    converted = 0
    for path, module in model.named_modules():
        if isinstance(module, Linear) and path.rsplit(".", 1)[-1] not in skip:
            if module.gemm is not None and not isinstance(module.gemm, Float8Gemm):
                raise ValueError(f"float8: Linear {path!r} already has a GEMM plan ({module.gemm!r}); a layer's "
                                 f"GEMMs run either tuned or in float8")
            module.gemm = plan
            converted += 1
    if not converted:
        raise ValueError(f"float8: {type(model).__name__} has no par4d Linear to convert (skipping {skip})")
    return model
