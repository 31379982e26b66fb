"""The model a run trains: par4d's GPT with the MLP its config names, and its twin; a
Hugging Face causal language model through ``par4d.parallelize``; or par4d's U-Net (``--model``).

The one place that maps ``GPTConfig.mlp`` to an MLP factory: models cannot (phantom
layers are built on top of them), so the training floor, which knows both, does.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from par4d.auto import load_safetensors, parallelize
from par4d.auto.init import initialize
from par4d.auto.stages import Stage, cut_stage, matmul_weights, tie_across_stages
from par4d.grid import Grid
from par4d.models import GPT, GPTConfig, ReferenceGPT, UNet
from par4d.overlap import Overlap, set_overlap
from par4d.phantom.mlp import PhantomMLP, PhantomMLPTwin
from par4d.train.config import TrainConfig


def build_gpt(config: GPTConfig, grid: Grid, recompute: int = 0, overlap: Overlap | None = None) -> GPT:
    """par4d's GPT on ``grid``, its MLP the one ``config.mlp`` names (dense or phantom),
    recomputing activations every ``recompute`` blocks (0: never), overlapping as ``overlap``
    says (None: every overlap on)."""
    return GPT(config, grid=grid, mlp=PhantomMLP if config.mlp == "phantom" else None, recompute=recompute,
               overlap=overlap)


def build_reference(config: GPTConfig, init: bool = True) -> ReferenceGPT:
    """The single-device twin of :func:`build_gpt`'s model."""
    return ReferenceGPT(config, init=init, mlp=PhantomMLPTwin if config.mlp == "phantom" else None)


class CausalLM(nn.Module):
    """A Hugging Face causal language model as the training loop calls a model:
    ``forward(idx, targets)`` is the mean cross-entropy over this rank's tokens (``targets``
    are already the next tokens), without targets the logits. ``flops_per_token`` and
    ``num_params`` are the whole model's (counted before it was parallelized).

    On a grid with pipe > 1, ``lm`` is this rank's stage (:mod:`par4d.auto.stages`) and the pipeline
    runs it (``stage_forward``, ``stream_shape``, ``first``, ``last``: as par4d's GPT)."""

    def __init__(self, lm: nn.Module, flops_per_token: float, num_params: int, stage: Stage | None = None):
        super().__init__()
        self.lm, self.flops_per_token, self.num_params = lm, flops_per_token, num_params
        self.stage = stage or Stage(0, 1, range(lm.config.num_hidden_layers))
        self.first, self.last = self.stage.first, self.stage.last

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if not (self.first and self.last):
            raise ValueError(f"this model is pipeline stage {self.stage.index} of {self.stage.stages}: train it "
                             f"with par4d.train.step.train_step (the pipeline runs its stages)")
        return self.stage_forward(idx, targets)

    def stage_forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's part of the forward: token ids in on the first stage, else the residual stream from
        the stage before (:meth:`stream_shape`); the stream out, or on the last stage the logits or, with
        ``targets``, the mean cross-entropy over its tokens."""
        given = {"input_ids": inputs} if self.first else {"inputs_embeds": inputs}
        if not self.last:                   # its final norm is the identity (par4d.auto.stages)
            return self.lm.base_model(**given, use_cache=False).last_hidden_state
        logits = self.lm(**given, use_cache=False).logits     # training: no key/value cache
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def stream_shape(self, rows: int, seq: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The residual stream between stages for ``rows`` sequences of ``seq`` tokens: features over y where
        ``parallelize`` sharded it (:mod:`par4d.auto.stream`), else whole, in the parameters' dtype."""
        hidden = self.lm.config.hidden_size // getattr(self.lm, "par4d_stream", 1)
        return (rows, seq, hidden), next(self.parameters()).dtype


def hf_model_config(config: TrainConfig):
    """The ``transformers`` config of the run's Hugging Face model: the pretrained folder's
    (``config.hf_config``, kept in the run), else one at the run's sizes over the run's vocabulary."""
    from transformers import AutoConfig, GPT2Config, LlamaConfig

    if config.hf_config is not None:
        settings = dict(config.hf_config)
        return AutoConfig.for_model(settings.pop("model_type"), **settings)
    if config.model == "hf-gpt2":
        return GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.n_embd,
                          n_layer=config.n_layer, n_head=config.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=4 * config.n_embd,
                       num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                       num_key_value_heads=config.n_head // 2 if config.n_head % 2 == 0 else config.n_head,
                       max_position_embeddings=config.seq_len, bos_token_id=0, eos_token_id=0)


def pretrained_shape(model: str, folder: str) -> tuple[dict[str, int], dict]:
    """(``n_layer``, ``n_embd``, ``n_head``, ``positions``, ``vocab``; its ``config.json``) of the model in
    ``folder`` that ``--model`` ``model`` starts from, the folder checked first
    (:func:`par4d.auto.pretrained.read_pretrained`)."""
    from transformers import AutoConfig

    from par4d.auto.pretrained import read_pretrained

    config = read_pretrained(folder, model)
    settings = dict(config)
    try:
        hf = AutoConfig.for_model(settings.pop("model_type"), **settings)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{Path(folder) / 'config.json'} is not a {config['model_type']} config ({error})") from None
    dims = {"n_layer": hf.num_hidden_layers, "n_embd": hf.hidden_size, "n_head": hf.num_attention_heads,
            "positions": hf.max_position_embeddings, "vocab": hf.vocab_size}
    return dims, config


def hf_lm(config: TrainConfig) -> nn.Module:
    """The Hugging Face model ``config.model`` names, at the run's sizes (or its pretrained folder's), in
    fp32. Built on the meta device: its values come from a folder or from :mod:`par4d.auto.init`."""
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

    hf = hf_model_config(config)
    if config.hf_config is not None:
        return AutoModelForCausalLM.from_config(hf).float()
    return (GPT2LMHeadModel if config.model == "hf-gpt2" else LlamaForCausalLM)(hf).float()


def build_model(config: TrainConfig, grid: Grid) -> nn.Module:
    """The model a run trains on ``grid``: par4d's GPT (``--model gpt``), or the Hugging Face
    model made parallel by ``par4d.parallelize``, or par4d's U-Net, with the overlaps
    ``--overlap`` asks for. On a virtual grid (meta device) only the shapes are built: what the
    CLI checks before any rank starts.

    The order: the model's layers on the grid (recomputation is inside the GPT's forward), then
    its overlaps, one runtime for all its Algorithm 1 layers (they must exist, and the recomputed
    segments are where the cache acts); mixed precision and the data-parallel sync wrap the
    finished model later (``loop``), since the sync's buckets follow the overlap settings."""
    settings = config.overlap_settings()
    if config.model == "gpt":
        return build_gpt(config.model_config(), grid, config.recompute_every(), settings)
    if config.model == "unet":
        return UNet(config.model_config(), grid=grid, overlap=settings)
    model = set_overlap(_hf_model(config, grid), config.overlap_run())
    if config.recompute_every():            # every decoder layer, its gathered weights cached by the runtime (cache)
        runtime = model.par4d_runtime
        context = {"context_fn": runtime.gathers.checkpoint_contexts} if runtime is not None else {}
        model.lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, **context})
    return model


def _hf_model(config: TrainConfig, grid: Grid) -> CausalLM:
    """Built on the meta device and made parallel, then filled shard by shard: from the pretrained folder
    (each rank reads its slices), or by the model's own initialisation a block at a time from the run's
    seed (:mod:`par4d.auto.init`); no rank holds the model whole. On a virtual grid only the shapes."""
    with torch.device("meta"):
        twin = hf_lm(config)
    # Training FLOPs per token: 6 per matmul weight (forward and backward), plus attention's
    # scores (the GPT's count, the same for both: causal attention over seq_len tokens).
    attention = config.model_config().attention_flops_per_token(recompute=False)
    flops = 6 * matmul_weights(twin) + attention
    params = sum(p.numel() for p in twin.parameters())
    lm = copy.deepcopy(twin)
    stage = cut_stage(lm, grid, config.seq_len)   # pipe > 1: this rank's decoder layers, names kept
    lm = parallelize(lm, grid)
    tie_across_stages(lm, stage)            # a head tied to the embeddings, on the first and last stage
    if grid.device.type != "meta" and config.init_from is not None and not config.resume:
        load_safetensors(lm, config.init_from, grid)
    elif grid.device.type != "meta":        # (a resume's checkpoint overwrites these values next)
        initialize(lm, twin, grid, config.seed)
    return CausalLM(lm, flops, params, stage)
