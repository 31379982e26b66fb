"""What a recipe says of its model: the questions ``par4d train``'s rooms ask about ``--model``.

The defaults are those of a language model on text with par4d's GPT's shape settings; a recipe
overrides what its model does otherwise. No torch here: the command line reads recipes before
any rank starts, and a recipe imports what builds its model only when it builds one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from par4d.models.config import GPTConfig, parse_recompute

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from par4d.checkpoint import Checkpoint
    from par4d.grid import Grid


# The run's settings (par4d.train.config.TrainConfig): that module imports the recipes, so they do not import
# it back.
Settings = Any


# A mixture of experts' settings (GPTConfig's and TrainConfig's names alike), for --mlp moe
MOE_SETTINGS = ("experts", "top_k", "shared_experts", "capacity_factor", "expert_bias_rate")


class Recipe:
    """One ``--model``: how it is checked, built on a grid and parallelized, counted, fed, saved and exported.

    ``name``: the ``--model`` value. ``describe``: the summary's model line. ``data``: ``"text"`` (token
    windows: the corpus, a dataset, a tokenizer) or ``"images"`` (generated from the seed). ``samples``: what
    a batch's rows are, in messages. ``loss_unit``: the training loss's unit, for the plot. ``unused``: the
    settings it has no use for (refused by name when given), ``unused_why`` says why. ``plannable``:
    ``--grid auto`` plans it. ``mixture``: a mixture of experts by construction (its ``--mlp`` is ``moe``).
    ``context``: it trains on a grid with a context axis. ``documents``: it trains with ``--document-mask``."""

    name: str
    describe: str
    data = "text"
    samples = "sequences"
    loss_unit = "nats/byte"
    unused: tuple[str, ...] = ("image_size",)
    unused_why = "it is for unet"
    plannable = False
    mixture = False     # its blocks are mixtures of experts whatever --mlp says (--mlp moe is implied)
    context = False     # its attention runs on sequences cut over a context axis (par4d.nn.ring)
    documents = False   # its attention stays inside a packed window's documents (--document-mask)

    def check(self, config: Settings) -> None:
        """Refuse the settings this model cannot train with (run when the config is built; no torch)."""

    def model_config(self, config: Settings) -> GPTConfig:
        """The model's own config at the run's sizes."""
        return GPTConfig(vocab_size=config.vocab_size, block_size=config.seq_len, n_layer=config.n_layer,
                         n_embd=config.n_embd, n_head=config.n_head, seed=config.seed, mlp=config.mlp,
                         phantom_k=config.phantom_k, phantom_p=config.grid.get("x", 1),
                         **({name: getattr(config, name) for name in MOE_SETTINGS} if config.mlp == "moe" else {}))

    def sizes(self, config: Settings) -> str:
        """The run's size settings, as an error message names them."""
        return f"n_layer={config.n_layer}, n_embd={config.n_embd}, n_head={config.n_head}, seq_len={config.seq_len}"

    def recompute_every(self, config: Settings) -> int:
        """``--recompute`` as a count of blocks per recomputed segment (0: none)."""
        pipe = config.grid.get("pipe", 1)
        if pipe == 1:
            return parse_recompute(config.recompute, config.n_layer)
        # A segment never spans two stages: N must divide every stage's block count.
        per_stage = math.gcd(*(len(blocks) for blocks in self.model_config(config).stage_blocks(pipe)))
        return parse_recompute(config.recompute, per_stage, config.n_layer)

    def num_params(self, config: Settings) -> int:
        """The whole model's parameters, before anything is built on a grid."""
        return self.model_config(config).num_params()

    def flops_per_token(self, config: Settings, model: nn.Module) -> float:
        """Training FLOPs per token (per pixel for images) of the model built for ``config``."""
        return self.model_config(config).flops_per_token()

    def pretrained_settings(self, folder: str, chosen: dict) -> tuple[dict, dict | None]:
        """(the settings with the sizes of the model in ``folder`` that ``--init-from hf`` starts from, the
        folder's config.json where the model is built from it, else None); a size flag that differs is refused.
        A model that starts from no folder keeps the settings (its :meth:`check` refuses ``--init-from``)."""
        return chosen, None

    def check_pretrained(self, config: Settings) -> None:
        """Before any rank starts: ``config.init_from`` holds every weight the model needs, at its shape."""

    def build(self, config: Settings, grid: Grid) -> nn.Module:
        """The model on ``grid`` with the overlaps ``--overlap`` asks for (on a virtual grid: shapes only)."""
        raise NotImplementedError

    def load_pretrained(self, config: Settings, grid: Grid, model: nn.Module) -> None:
        """Fill a new run's model from ``config.init_from`` (each rank its shards), where :meth:`build` did not."""

    def stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`export_hf`'s state dict as a model folder stores it (the same, but for a mixture's experts)."""
        return tensors

    def export_hf(self, chosen: Checkpoint, source: Path) -> tuple[dict[str, torch.Tensor], str]:
        """(state dict under ``transformers``' names, the ``config.json`` text) of the checkpoint ``chosen``."""
        raise ValueError(f"run {source} trained --model {self.name}: export is for par4d's GPT and the Hugging "
                         f"Face models (--model gpt and hf-*)")
