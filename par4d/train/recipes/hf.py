"""``--model hf-gpt2 | hf-llama | hf-mixtral | hf-qwen3-moe | hf-olmoe``: a Hugging Face causal language
model made parallel by ``par4d.parallelize``, at the run's sizes or a pretrained folder's, and exported as
its own model again. The last three are mixtures of experts (:mod:`par4d.adopt.moe`): their experts spread
over ``--grid ...,expert=E``."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from par4d.train.recipes.base import Recipe, Settings

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from par4d.adopt.causal_lm import CausalLM
    from par4d.checkpoint import Checkpoint
    from par4d.grid import Grid

# par4d's size settings -> a transformers config's names for them
HF_NAMES = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
            "experts": "num_experts (num_local_experts)", "top_k": "num_experts_per_tok"}


def hf_model_config(config: Settings):
    """The ``transformers`` config of the run's Hugging Face model: the pretrained folder's
    (``config.hf_config``, kept in the run), else its recipe's at the run's sizes over the run's vocabulary."""
    from transformers import AutoConfig

    from par4d.train.recipes import recipe

    if config.hf_config is not None:
        settings = dict(config.hf_config)
        return AutoConfig.for_model(settings.pop("model_type"), **settings)
    return recipe(config.model).fresh_config(config)


def pretrained_shape(model: str, folder: str) -> tuple[dict[str, int], dict]:
    """(``n_layer``, ``n_embd``, ``n_head``, ``positions``, ``vocab``; its ``config.json``) of the model in
    ``folder`` that ``--model`` ``model`` starts from, the folder checked first
    (:func:`par4d.adopt.pretrained.read_pretrained`)."""
    from transformers import AutoConfig

    from par4d.adopt.hf_config import EXPERTS_FIELD, check_hf_config
    from par4d.adopt.pretrained import held_apart, read_pretrained
    from par4d.train.say import say

    config = read_pretrained(folder, model)
    check_hf_config(config, Path(folder) / "config.json")    # field by field: nothing left to fail in transformers
    settings = dict(config)
    try:
        hf = AutoConfig.for_model(settings.pop("model_type"), **settings)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{Path(folder) / 'config.json'} is not a {config['model_type']} config ({error})") from None
    dims = {"n_layer": hf.num_hidden_layers, "n_embd": hf.hidden_size, "n_head": hf.num_attention_heads,
            "positions": hf.max_position_embeddings, "vocab": hf.vocab_size}
    if hf.model_type in EXPERTS_FIELD:          # a mixture: its experts and top-k are its shape too
        dims.update(experts=getattr(hf, EXPERTS_FIELD[hf.model_type]), top_k=hf.num_experts_per_tok)
    embedding = "transformer.wte.weight" if hf.model_type == "gpt2" else "model.embed_tokens.weight"
    if hf.tie_word_embeddings and held_apart(folder, "lm_head.weight", embedding):
        # Tying would drop the folder's own head: its weights are followed, and the change is said
        say(f"{Path(folder) / 'config.json'}: tie_word_embeddings is true, but the folder's weights hold an "
            f"lm_head.weight of its own (not {embedding}'s values): par4d trains that head, untied")
        config = dict(config, tie_word_embeddings=False)
    return dims, config


def pretrained_sizes(model: str, folder: str, chosen: dict) -> tuple[dict, dict]:
    """(the settings with the pretrained model's sizes, its config.json): a size flag that differs is
    refused, and so is a --seq-len beyond its positions or a vocabulary smaller than the bytes."""
    from par4d.train.config import VOCAB_BYTES, default, flag
    from par4d.train.say import say

    dims, hf_config = pretrained_shape(model, folder)
    where = Path(folder) / "config.json"
    shape = [name for name in ("n_layer", "n_embd", "n_head", "experts", "top_k") if name in dims]
    for name in shape:
        if name in chosen and chosen[name] != dims[name]:
            raise ValueError(f"{flag(name)} {chosen[name]}, but {where} gives the model {HF_NAMES[name]} "
                             f"{dims[name]}: a pretrained model keeps its shape (leave {flag(name)} out)")
    seq_len = chosen.get("seq_len", default("seq_len"))
    if seq_len > dims["positions"]:
        raise ValueError(f"--seq-len {seq_len} exceeds the {dims['positions']} positions of the model in {where}")
    if dims["vocab"] < VOCAB_BYTES:
        raise ValueError(f"{where}: vocab_size {dims['vocab']} is below the {VOCAB_BYTES} byte tokens par4d trains "
                         f"on")
    dropped = {k: v for k, v in hf_config.items() if k.endswith(("dropout", "pdrop")) and isinstance(v, (int, float))
               and not isinstance(v, bool) and v > 0}
    if dropped:    # each rank would draw its own masks on activations its axis holds whole
        say(f"{where}: {', '.join(f'{k}={v}' for k, v in sorted(dropped.items()))} set to 0: par4d trains without "
            f"dropout (ranks holding the same activations would draw different masks)")
    hf_config = dict(hf_config, **{k: 0.0 for k in dropped})
    if "experts" in dims and hf_config["model_type"] != "deepseek_v3" and not hf_config.get("output_router_logits"):
        say(f"{where}: output_router_logits is false: the mixture trains without its load-balancing loss, as "
            f"transformers would (set it true in the folder's config.json to balance the experts)")
    return dict(chosen, **{k: dims[k] for k in shape}), hf_config


def hf_lm(config: Settings) -> nn.Module:
    """The Hugging Face model ``config.model`` names, at the run's sizes (or its pretrained folder's), in
    fp32. Built on the meta device: its values come from a folder or from :mod:`par4d.adopt.init`."""
    from par4d.nn.float8 import quiet_torchao

    with quiet_torchao():     # transformers' model classes import torchao
        from transformers import AutoModelForCausalLM

    from par4d.train.recipes import recipe

    hf = hf_model_config(config)
    if config.hf_config is not None:
        return AutoModelForCausalLM.from_config(hf).float()
    return recipe(config.model).lm_class()(hf).float()


def _hf_model(config: Settings, grid: Grid) -> CausalLM:
    """Built on the meta device and made parallel, then filled shard by shard: from the pretrained folder
    (each rank reads its slices), or by the model's own initialisation a block at a time from the run's
    seed (:mod:`par4d.adopt.init`); no rank holds the model whole. On a virtual grid only the shapes."""
    import torch

    from par4d.adopt import load_safetensors, parallelize
    from par4d.adopt.causal_lm import CausalLM
    from par4d.adopt.init import initialize
    from par4d.adopt.moe import SparseMoE
    from par4d.adopt.stages import cut_stage, matmul_weights, tie_across_stages

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
    if config.expert_bias_rate:             # DeepSeek-V3's correction bias, stepped (MixtureRecipe.check)
        for module in lm.modules():
            if isinstance(module, SparseMoE):
                module.step_correction(config.expert_bias_rate)
    tie_across_stages(lm, stage)            # a head tied to the embeddings, on the first and last stage
    if grid.device.type != "meta" and config.init_from is not None and not config.resume:
        load_safetensors(lm, config.init_from, grid)
    elif grid.device.type != "meta":        # (a resume's checkpoint overwrites these values next)
        initialize(lm, twin, grid, config.seed)
    return CausalLM(lm, flops, params, stage, grid)


def lm_state(chosen: Checkpoint) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, config.json) of a run's Hugging Face model: the checkpoint's ``lm.*`` parameters under
    the model's own names, the config it was built from."""
    import json
    import math

    import torch

    from par4d.adopt.gpt2 import dtype_name
    from par4d.train.export import check_memory, full_tensors

    where = chosen.path / "meta.json"
    record = chosen.meta.get("train_config")
    if not isinstance(record, dict) or not all(isinstance(k, str) for k in record):
        raise ValueError(f"{where}: train_config is not a run's settings")
    if isinstance(record.get("hf_config"), dict):     # a pretrained model's config.json, as the run kept it
        from par4d.adopt.hf_config import check_hf_config

        check_hf_config(record["hf_config"], f"{where}: train_config.hf_config")
    # The saved settings as hf_lm reads them (TrainConfig's fields; its module imports the recipes, so it is
    # not imported back here): whatever in them does not make the model is the file's fault, named.
    try:
        with torch.device("meta"):
            lm = hf_lm(SimpleNamespace(**{"hf_config": None, **record}))
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: train_config does not make a {record.get('model')} model ({error})") from None
    shapes = {f"lm.{name}": tuple(p.shape) for name, p in lm.named_parameters()}   # a tied head once
    # and the persistent buffers the checkpoint holds (DeepSeek-V3's score correction bias)
    shapes.update({f"lm.{prefix}.{name}": tuple(b.shape) for prefix, module in lm.named_modules()
                   for name, b in module.named_buffers(recurse=False)
                   if name not in module._non_persistent_buffers_set and f"model/lm.{prefix}.{name}" in chosen.tensors})
    check_memory(where, sum(math.prod(s) for s in shapes.values()))
    full = full_tensors(chosen, shapes)
    tensors = {name.removeprefix("lm."): t.contiguous() for name, t in full.items()}
    settings = lm.config.to_diff_dict()
    dtype = dtype_name(next(iter(full.values())).dtype)
    settings.update(architectures=[type(lm).__name__], dtype=dtype)
    settings.pop("torch_dtype", None)
    return tensors, json.dumps(settings, indent=2, sort_keys=True) + "\n"


def kv_heads(heads: int) -> int:
    """A fresh model's key/value heads: grouped-query attention, half the heads where they are even."""
    return heads // 2 if heads % 2 == 0 else heads


class HFRecipe(Recipe):
    """One Hugging Face architecture par4d builds at the run's sizes (:meth:`fresh_config`) or a pretrained
    folder's (``--init-from hf``)."""

    def __init__(self, name: str):
        self.name = name
        self.describe = f"{name}: Hugging Face's, made parallel by par4d.parallelize"

    def fresh_config(self, config: Settings):
        """The ``transformers`` config at the run's sizes and vocabulary, without dropout."""
        raise NotImplementedError

    def lm_class(self) -> type:
        """The ``transformers`` causal LM class a fresh config builds."""
        raise NotImplementedError

    def check(self, config: Settings) -> None:
        self.check_kept_config(config)
        if config.mlp != "dense":
            raise ValueError(f"--model {self.name}: --mlp {config.mlp} is for par4d's GPT (--model gpt); a Hugging "
                             f"Face model trains without phantom MLPs")

    @staticmethod
    def check_kept_config(config: Settings) -> None:
        """A resumed run's pretrained config.json, as its meta.json kept it, meets its family's rules."""
        from par4d.adopt.hf_config import check_hf_config

        if config.hf_config is not None:
            check_hf_config(config.hf_config, "the run's hf_config (the pretrained folder's config.json)")

    def recompute_every(self, config: Settings) -> int:
        """transformers checkpoints each decoder layer on its own: 0 or 1."""
        from par4d.models.config import parse_recompute

        every = parse_recompute(config.recompute, config.n_layer)
        if every > 1 and config.recompute.strip().lower() != "auto":
            raise ValueError(f"--recompute {config.recompute}: a Hugging Face model recomputes each decoder layer "
                             f"on its own (transformers' gradient checkpointing); give none, auto or 1")
        return min(every, 1)

    def num_params(self, config: Settings) -> int:
        """Its own count, from its transformers config's sizes (its vocabulary, MLP width and key/value heads
        are its own, not par4d's GPT's): a model too large for memory is refused before it is built."""
        from par4d.adopt.hf_config import parameter_count

        return parameter_count(hf_model_config(config))

    def flops_per_token(self, config: Settings, model: nn.Module) -> float:
        return model.flops_per_token          # counted when it was built, before it was parallelized

    def pretrained_settings(self, folder: str, chosen: dict) -> tuple[dict, dict | None]:
        return pretrained_sizes(self.name, folder, chosen)

    def check_pretrained(self, config: Settings) -> None:
        import torch

        from par4d.adopt.load import check_weights

        with torch.device("meta"):
            check_weights(hf_lm(config), config.init_from)   # every weight there, at its shape

    def build(self, config: Settings, grid: Grid) -> nn.Module:
        """Made parallel, then its overlaps; recomputed, every decoder layer with its gathered weights cached
        by the runtime (the cache)."""
        from par4d.nn.ring import set_context_form
        from par4d.overlap import set_overlap
        from par4d.parallel import state

        model = set_context_form(set_overlap(_hf_model(config, grid), config.overlap_run()), config.context_form)
        if config.recompute_every():
            runtime = state(model).runtime
            context = {"context_fn": runtime.gathers.checkpoint_contexts} if runtime is not None else {}
            model.lm.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False, **context})
        return model

    def export_hf(self, chosen: Checkpoint, source: Path) -> tuple[dict[str, torch.Tensor], str]:
        return lm_state(chosen)


    def check_context(self, config: Settings, kinds: tuple[str, ...]) -> None:
        """On a context axis: a pretrained folder of one of the ``kinds`` (model_type) whose attention par4d runs
        there, without a sliding window shorter than the sequence."""
        context = config.grid.get("context", 1)
        if context == 1 or config.hf_config is None:
            return
        kind = config.hf_config.get("model_type")
        if kind not in kinds:
            raise ValueError(f"--grid context={context}: --init-from hf {config.init_from} is a {kind} model, whose "
                             f"attention par4d does not run on a context axis yet ({', '.join(kinds)} do)")
        window = config.hf_config.get("sliding_window")
        if window is not None and config.hf_config.get("use_sliding_window", True) and config.seq_len > window:
            raise ValueError(f"--grid context={context}: --init-from hf {config.init_from} attends within a sliding "
                             f"window of {window} tokens, shorter than --seq-len {config.seq_len} (ring attention "
                             f"attends over the whole sequence: give --seq-len {window} or less)")


class GPT2Recipe(HFRecipe):
    def lm_class(self) -> type:
        from par4d.nn.float8 import quiet_torchao

        with quiet_torchao():     # transformers' model classes import torchao
            from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel

    def fresh_config(self, config: Settings):
        from transformers import GPT2Config

        return GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.n_embd,
                          n_layer=config.n_layer, n_head=config.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


class LlamaRecipe(HFRecipe):
    context = True          # Llama, Mistral and Qwen2 (a folder's) run ring attention on a context axis
    documents = True        # ... and keep attention inside documents (a 4-D mask, or the ring's)

    def check(self, config: Settings) -> None:
        super().check(config)
        self.check_context(config, ("llama", "mistral", "qwen2"))

    def lm_class(self) -> type:
        from par4d.nn.float8 import quiet_torchao

        with quiet_torchao():     # transformers' model classes import torchao
            from transformers import LlamaForCausalLM

        return LlamaForCausalLM

    def fresh_config(self, config: Settings):
        """Grouped-query attention (:func:`kv_heads`)."""
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.n_embd,
                           intermediate_size=4 * config.n_embd, num_hidden_layers=config.n_layer,
                           num_attention_heads=config.n_head, num_key_value_heads=kv_heads(config.n_head),
                           max_position_embeddings=config.seq_len, bos_token_id=0, eos_token_id=0)


class MixtureRecipe(HFRecipe):
    """A transformers mixture of experts (:mod:`par4d.adopt.moe`): ``--experts`` and ``--top-k`` at the
    run's sizes, every expert the width of a Llama MLP (4 * n_embd), trained with its own load-balancing
    loss (``output_router_logits``) at its family's weight (DeepSeek-V3: its score correction bias instead);
    or the pretrained folder's shape and loss
    settings (a folder's config that leaves the loss off trains without it, and par4d says so). Routed as
    transformers routes it, dropless; par4d's GPT's --shared-experts, --capacity-factor and --expert-bias-rate
    are refused, but DeepSeek-V3's --expert-bias-rate, which steps its score correction bias (DeepSeek-V3's own
    balancing), kept as loaded without it.
    Recomputed as the dense models are (each decoder layer, its exchanges run again in backward); on the pipe
    axis only without its balance loss (which pools every layer's counts: refused by name with it)."""

    mixture = True
    family = ""                 # the transformers config's class name
    lm_name = ""                # its causal LM's
    model_type = ""             # its config.json's model_type

    def __init__(self, name: str):
        super().__init__(name)
        self.describe = f"{name}: Hugging Face's mixture of experts, made parallel by par4d.parallelize"

    def lm_class(self) -> type:
        import transformers

        return getattr(transformers, self.lm_name)

    def check(self, config: Settings) -> None:
        self.check_kept_config(config)
        if config.mlp != "moe":
            raise ValueError(f"--model {self.name} is a mixture of experts: --mlp {config.mlp} does not apply "
                             f"(leave --mlp out)")
        if not 1 <= config.top_k <= config.experts:
            raise ValueError(f"--top-k {config.top_k}: give 1 to the {config.experts} experts (--experts)")
        for name, flag, what in (("shared_experts", "--shared-experts", "no shared experts"),
                                 ("capacity_factor", "--capacity-factor", "no capacity (dropless)"),
                                 ("expert_bias_rate", "--expert-bias-rate", "no loss-free bias")):
            if name == "expert_bias_rate" and self.model_type == "deepseek_v3":
                continue                  # its own score correction bias, stepped so (SparseMoE.step_correction)
            if getattr(config, name):
                raise ValueError(f"{flag} {getattr(config, name)}: --model {self.name} routes as transformers "
                                 f"does, with {what}; that flag is for par4d's GPT (--model gpt --mlp moe)")
        if self.context:
            self.check_context(config, (self.model_type,))
        balanced = config.hf_config is None or config.hf_config.get("output_router_logits", False)
        if config.grid.get("pipe", 1) > 1 and balanced:
            raise ValueError(f"--model {self.name} on pipe={config.grid['pipe']}: its load-balancing loss pools every "
                             f"layer's counts, which no stage holds; a mixture is cut into stages only without it (a "
                             f"folder whose config.json has output_router_logits false), else give pipe=1")

    def stored(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each block's experts one matrix per expert, under its family's names (par4d.adopt.expert_files)."""
        from par4d.adopt.expert_files import per_expert

        return per_expert(tensors, self.model_type)

    def fresh_config(self, config: Settings):
        import transformers

        sizes = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, num_hidden_layers=config.n_layer,
                     num_attention_heads=config.n_head, num_key_value_heads=kv_heads(config.n_head),
                     max_position_embeddings=config.seq_len, num_experts_per_tok=config.top_k,
                     output_router_logits=True, bos_token_id=0, eos_token_id=0)
        return getattr(transformers, self.family)(**{**sizes, **self.expert_sizes(config)})

    def expert_sizes(self, config: Settings) -> dict:
        """The family's names for the experts' count and width."""
        return {"num_experts": config.experts, "intermediate_size": 4 * config.n_embd}


class MixtralRecipe(MixtureRecipe):
    family, lm_name, model_type = "MixtralConfig", "MixtralForCausalLM", "mixtral"
    context = True          # its attention is Mistral's: ring attention on a context axis

    def expert_sizes(self, config: Settings) -> dict:
        return {"num_local_experts": config.experts, "intermediate_size": 4 * config.n_embd}


class Qwen3MoeRecipe(MixtureRecipe):
    """Every layer a mixture, its top-k weights renormalised (Qwen3-30B-A3B's norm_topk_prob)."""

    family, lm_name, model_type = "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe"
    context = True          # q and k normalised per head before the attention function: ring attention too

    def expert_sizes(self, config: Settings) -> dict:
        return {"num_experts": config.experts, "moe_intermediate_size": 4 * config.n_embd,
                "intermediate_size": 4 * config.n_embd, "head_dim": config.n_embd // config.n_head,
                "norm_topk_prob": True}


class OlmoeRecipe(MixtureRecipe):
    family, lm_name, model_type = "OlmoeConfig", "OlmoeForCausalLM", "olmoe"


class DeepseekV3Recipe(MixtureRecipe):
    """DeepSeek-V3: multi-head latent attention (its projections lone layers: their norms are over the
    low-rank widths), the first block's MLP dense, then mixtures of sigmoid-scored experts in groups with a
    score correction bias and shared experts. Fresh: one shared expert, the experts in as many groups as
    --top-k with half of them open to a token, q and kv ranks of n_embd / 2 and / 4."""

    family, lm_name, model_type = "DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3"

    def expert_sizes(self, config: Settings) -> dict:
        head = config.n_embd // config.n_head
        groups = config.top_k if config.experts % config.top_k == 0 else 1
        return {"n_routed_experts": config.experts, "moe_intermediate_size": 4 * config.n_embd,
                "intermediate_size": 4 * config.n_embd, "n_shared_experts": 1, "n_group": groups,
                "topk_group": max(1, groups // 2), "first_k_dense_replace": 1 if config.n_layer > 1 else 0,
                "q_lora_rank": config.n_embd // 2, "kv_lora_rank": config.n_embd // 4, "qk_nope_head_dim": head,
                "qk_rope_head_dim": head // 2 if head % 4 == 0 else head, "v_head_dim": head,
                "num_key_value_heads": config.n_head, "output_router_logits": False}   # balanced by its bias
