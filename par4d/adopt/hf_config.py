"""What a Hugging Face ``config.json`` must hold before par4d builds its model: a table of rules per
family ``parallelize`` takes, checked field by field (a wrong type, a size that is not a positive count,
heads that do not divide what they share, an unknown activation or RoPE scaling), so that no value reaches
``transformers`` or torch to fail there; and the parameter count of the model a config makes, from its
numbers alone (a config of a million layers is refused by its size before anything is built).

Fields the tables do not name go to ``transformers`` as they are; a field a table names may be absent
(``transformers`` then takes its default), never of the wrong kind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

Rule = Callable[[object], "str | None"]    # a value -> what is wrong with it, None when nothing


def _show(value: object) -> str:
    """A value as the file writes it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: object) -> str:
    return "null" if value is None else {bool: "a boolean", str: "a string", list: "a list",
                                         dict: "an object"}.get(type(value), type(value).__name__)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def count(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{_kind(value)}, not an integer >= 1"
    return None if value >= 1 else "not an integer >= 1"


def whole(value: object) -> str | None:
    """An integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{_kind(value)}, not an integer >= 0"
    return None if value >= 0 else "not an integer >= 0"


def positive(value: object) -> str | None:
    return None if _number(value) and value > 0 else "not a finite number > 0"


def at_least_one(value: object) -> str | None:
    return None if _number(value) and value >= 1 else "not a finite number >= 1"


def probability(value: object) -> str | None:
    return None if _number(value) and 0 <= value < 1 else "not a number from 0 up to 1"


def non_negative(value: object) -> str | None:
    return None if _number(value) and value >= 0 else "not a finite number >= 0"


def number(value: object) -> str | None:
    return None if _number(value) else "not a finite number"


def boolean(value: object) -> str | None:
    return None if isinstance(value, bool) else f"{_kind(value)}, not true or false"


def false(value: object) -> str | None:
    """A feature par4d's decoder-only training does not build (cross-attention)."""
    return None if value is False else "not false: par4d trains decoder-only language models"


def optional(rule: Rule) -> Rule:
    return lambda value: None if value is None else rule(value)


def one_of(names: Callable[[], list[str]]) -> Rule:
    """A string among ``names()`` (called when checked: transformers' own lists, read lazily)."""
    def check(value: object) -> str | None:
        known = names()
        if isinstance(value, str) and value in known:
            return None
        return f"not one of {', '.join(known)}"
    return check


def layer_list(value: object) -> str | None:
    """A list of layer indices (Qwen3-MoE's mlp_only_layers)."""
    ok = isinstance(value, list) and all(whole(i) is None for i in value)
    return None if ok else "not a list of layer indices (integers >= 0)"


def token_ids(value: object) -> str | None:
    """A token id, a list of them (several end-of-text ids), or null."""
    ids = value if isinstance(value, list) else [value]
    if value is None or all(whole(i) is None for i in ids):
        return None
    return "not a token id (an integer >= 0) or a list of them"


def _activations() -> list[str]:
    from transformers.activations import ACT2FN

    return sorted(ACT2FN)


def _scaling(value: object) -> str | None:
    """``rope_scaling`` (older configs) or ``rope_parameters``: an object of a known type with its factors."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"{_kind(value)}, not an object of rope_type and its factors"
    kind = value.get("rope_type", value.get("type", "default"))
    if kind not in ROPE:
        return f"of rope_type {_show(kind)}, not one of {', '.join(ROPE)}"
    for key, rule in ROPE[kind].items():
        if key not in value:
            return f"of rope_type {kind!r} without {key} (it needs {', '.join(ROPE[kind])})"
        if (why := rule(value[key])) is not None:
            return f"of rope_type {kind!r} with {key} {_show(value[key])} ({why})"
    for key, rule in ROPE_OPTIONAL.items():
        if value.get(key) is not None and (why := rule(value[key])) is not None:
            return f"with {key} {_show(value[key])} ({why})"
    if kind == "llama3" and not value["high_freq_factor"] > value["low_freq_factor"]:
        return "of rope_type 'llama3' with high_freq_factor not above low_freq_factor"
    if kind == "yarn" and value.get("beta_fast", 32) <= value.get("beta_slow", 1):
        return "of rope_type 'yarn' with beta_fast not above beta_slow"
    return None


def _factors(value: object) -> str | None:
    ok = isinstance(value, list) and value and all(_number(v) and v > 0 for v in value)
    return None if ok else "not a list of numbers > 0"


# rope_type -> what each needs (transformers' RoPE variants); the keys any of them may have
ROPE: dict[str, dict[str, Rule]] = {
    "default": {},
    "linear": {"factor": at_least_one},
    "dynamic": {"factor": at_least_one},
    "yarn": {"factor": at_least_one, "original_max_position_embeddings": count},
    "longrope": {"short_factor": _factors, "long_factor": _factors, "original_max_position_embeddings": count},
    "llama3": {"factor": at_least_one, "low_freq_factor": positive, "high_freq_factor": positive,
               "original_max_position_embeddings": count},
}
ROPE_OPTIONAL: dict[str, Rule] = {"rope_theta": positive, "factor": at_least_one, "attention_factor": positive,
                                  "beta_fast": number, "beta_slow": number, "mscale": number,
                                  "mscale_all_dim": number, "partial_rotary_factor": positive}

_TOKENS = {"bos_token_id": token_ids, "eos_token_id": token_ids, "pad_token_id": token_ids}
_DECODER: dict[str, Rule] = {
    "vocab_size": count, "hidden_size": count, "intermediate_size": count, "num_hidden_layers": count,
    "num_attention_heads": count, "num_key_value_heads": optional(count), "head_dim": optional(count),
    "max_position_embeddings": count, "rms_norm_eps": positive, "rope_theta": positive,
    "hidden_act": one_of(_activations), "attention_dropout": probability, "initializer_range": non_negative,
    "tie_word_embeddings": boolean, "use_cache": boolean, "rope_scaling": _scaling,
    "rope_parameters": _scaling, **_TOKENS,
}
# A mixture of experts' fields, every family's (their expert counts have family names)
_MIXTURE: dict[str, Rule] = {"num_experts_per_tok": count, "output_router_logits": boolean,
                             "router_aux_loss_coef": non_negative}
# model_type -> {field: its rule}
RULES: dict[str, dict[str, Rule]] = {
    "llama": {**_DECODER, "attention_bias": boolean, "mlp_bias": boolean, "pretraining_tp": count},
    "mistral": {**_DECODER, "sliding_window": optional(count)},
    "qwen2": {**_DECODER, "sliding_window": optional(count), "use_sliding_window": boolean,
              "max_window_layers": optional(whole)},
    "gpt2": {"vocab_size": count, "n_positions": count, "n_ctx": count, "n_embd": count, "n_layer": count,
             "n_head": count, "n_inner": optional(count), "activation_function": one_of(_activations),
             "layer_norm_epsilon": positive, "resid_pdrop": probability, "embd_pdrop": probability,
             "attn_pdrop": probability, "initializer_range": non_negative, "scale_attn_weights": boolean,
             "scale_attn_by_inverse_layer_idx": boolean, "reorder_and_upcast_attn": boolean,
             "add_cross_attention": false, "tie_word_embeddings": boolean, "use_cache": boolean, **_TOKENS},
    "mixtral": {**_DECODER, **_MIXTURE, "sliding_window": optional(count), "num_local_experts": count,
                "router_jitter_noise": probability},
    "qwen3_moe": {**_DECODER, **_MIXTURE, "attention_bias": boolean, "sliding_window": optional(count),
                  "use_sliding_window": boolean, "max_window_layers": optional(whole), "num_experts": count,
                  "moe_intermediate_size": count, "decoder_sparse_step": count, "norm_topk_prob": boolean,
                  "mlp_only_layers": layer_list},
    "olmoe": {**_DECODER, **_MIXTURE, "attention_bias": boolean, "clip_qkv": optional(positive), "num_experts": count,
              "norm_topk_prob": boolean},
    "deepseek_v3": {**_DECODER, **_MIXTURE, "attention_bias": boolean, "moe_intermediate_size": count,
                    "n_routed_experts": count, "n_shared_experts": whole, "routed_scaling_factor": positive,
                    "n_group": count, "topk_group": count, "first_k_dense_replace": whole, "norm_topk_prob": boolean,
                    "q_lora_rank": optional(count), "kv_lora_rank": count, "qk_nope_head_dim": count,
                    "qk_rope_head_dim": count, "v_head_dim": count, "rope_interleave": boolean},
}
# model_type -> the field of its experts per mixture
EXPERTS_FIELD = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "olmoe": "num_experts",
                 "deepseek_v3": "n_routed_experts"}


def check_hf_config(config: dict, where: str | Path) -> None:
    """Raise a ValueError naming ``where`` and the field unless every field :data:`RULES` names for the
    config's ``model_type`` meets its rule, and the sizes divide as the model needs: heads into the
    hidden size (each head's width is a whole number, even for rotary embeddings), key/value heads into
    heads. Token ids beyond the vocabulary are left to transformers' warning: training reads none."""
    kind = config.get("model_type")
    if kind not in RULES:
        raise ValueError(f"{where}: model_type {_show(kind)} is not one par4d checks "
                         f"({', '.join(RULES)})")
    for field, rule in RULES[kind].items():
        if field in config and (why := rule(config[field])) is not None:
            raise ValueError(f"{where}: {field} is {_show(config[field])} ({why})")
    if config.get("quantization_config") is not None:   # read as plain numbers, they would be wrong, silently
        raise ValueError(f"{where}: quantization_config is {_show(config['quantization_config'])}: par4d reads "
                         f"bf16, fp16 or fp32 weights, not quantized ones (convert the folder first)")
    sizes = _sizes(config)
    if sizes["hidden"] % sizes["heads"] and config.get("head_dim") is None:
        raise ValueError(f"{where}: {sizes['heads']} attention heads do not divide the hidden size "
                         f"{sizes['hidden']} (give head_dim, or heads that divide it)")
    if sizes["heads"] % sizes["kv_heads"]:
        raise ValueError(f"{where}: num_key_value_heads {sizes['kv_heads']} does not divide num_attention_heads "
                         f"{sizes['heads']} (each key/value head serves a whole group of heads)")
    head_dim = config.get("head_dim") or sizes["hidden"] // sizes["heads"]
    if kind != "gpt2" and head_dim % 2:
        raise ValueError(f"{where}: each head is {head_dim} wide, odd: rotary embeddings turn pairs of a head's "
                         f"dimensions")


def _sizes(config: dict) -> dict[str, int]:
    """The sizes the relations between fields use, with transformers' defaults where a field is absent."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(config["model_type"])
    if config["model_type"] == "gpt2":
        names = {"hidden": "n_embd", "heads": "n_head"}
    else:
        names = {"hidden": "hidden_size", "heads": "num_attention_heads"}
    sizes = {k: config.get(name, getattr(defaults, name)) for k, name in names.items()}
    sizes["kv_heads"] = config.get("num_key_value_heads") or sizes["heads"]
    return sizes


def parameter_count(hf: object) -> int:
    """The parameters of the causal LM ``transformers`` builds from config ``hf`` (a tied head once),
    from its sizes alone: Llama, Mistral and Qwen2 (bias where each has it), GPT-2, and the mixtures of
    experts Mixtral, Qwen3-MoE and OLMoE (every expert and the router; Qwen3's and OLMoE's query and key
    norms)."""
    vocab, tied = hf.vocab_size, hf.tie_word_embeddings
    if hf.model_type == "gpt2":
        width, inner = hf.n_embd, hf.n_inner or 4 * hf.n_embd
        block = 2 * width + (3 * width * width + 3 * width) + (width * width + width) + 2 * width \
            + (width * inner + inner) + (inner * width + width)
        return vocab * width + hf.n_positions * width + hf.n_layer * block + 2 * width + (0 if tied else vocab * width)
    width, heads = hf.hidden_size, hf.num_attention_heads
    kv_heads = hf.num_key_value_heads or heads
    head_dim = getattr(hf, "head_dim", None) or width // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = width * q + 2 * width * kv + q * width
    mlp = 3 * width * hf.intermediate_size
    if hf.model_type == "deepseek_v3":
        return _deepseek_count(hf)
    if hf.model_type in EXPERTS_FIELD:
        return _mixture_count(hf, width, attention, q, kv, head_dim)
    if hf.model_type == "qwen2":
        attention += q + 2 * kv                        # q, k and v carry a bias, the output none
    if getattr(hf, "attention_bias", False):
        attention += q + 2 * kv + width
    if getattr(hf, "mlp_bias", False):
        mlp += 2 * hf.intermediate_size + width
    block = attention + mlp + 2 * width                # and two RMSNorm weights
    return vocab * width + hf.num_hidden_layers * block + width + (0 if tied else vocab * width)


def _mixture_count(hf: object, width: int, attention: int, q: int, kv: int, head_dim: int) -> int:
    """:func:`parameter_count` of a mixture-of-experts family (``attention``: its q, k, v, o weights)."""
    experts = getattr(hf, EXPERTS_FIELD[hf.model_type])
    inner = hf.moe_intermediate_size if hf.model_type == "qwen3_moe" else hf.intermediate_size
    mixture = experts * 3 * width * inner + experts * width           # the experts and the router
    if getattr(hf, "attention_bias", False):
        attention += q + 2 * kv + width
    if hf.model_type == "qwen3_moe":
        attention += 2 * head_dim                                      # q_norm, k_norm: per head
    if hf.model_type == "olmoe":
        attention += q + kv                                            # q_norm, k_norm: over every head
    layers = 0
    for index in range(hf.num_hidden_layers):
        sparse = hf.model_type != "qwen3_moe" or (
            index not in hf.mlp_only_layers and experts > 0 and (index + 1) % hf.decoder_sparse_step == 0)
        layers += attention + 2 * width + (mixture if sparse else 3 * width * hf.intermediate_size)
    vocab, tied = hf.vocab_size, hf.tie_word_embeddings
    return vocab * width + layers + width + (0 if tied else vocab * width)


def _deepseek_count(hf: object) -> int:
    """:func:`parameter_count` of DeepSeek-V3: multi-head latent attention (queries through a rank-q_lora
    projection and its norm, or directly; keys and values through a rank-kv_lora one, the rotary key shared by
    the heads), dense MLPs in the first blocks, then a router, routed experts and shared experts."""
    d, heads = hf.hidden_size, hf.num_attention_heads
    qk, v = hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim
    bias = hf.attention_bias
    if hf.q_lora_rank is None:
        query = d * heads * qk
    else:
        query = d * hf.q_lora_rank + bias * hf.q_lora_rank + hf.q_lora_rank + hf.q_lora_rank * heads * qk
    kv_a = hf.kv_lora_rank + hf.qk_rope_head_dim
    attention = query + d * kv_a + bias * kv_a + hf.kv_lora_rank + hf.kv_lora_rank * heads * (hf.qk_nope_head_dim + v) \
        + heads * v * d + bias * d
    moe = hf.n_routed_experts * (d + 3 * d * hf.moe_intermediate_size) + 3 * d * hf.moe_intermediate_size * \
        hf.n_shared_experts
    dense = min(hf.first_k_dense_replace, hf.num_hidden_layers)
    blocks = hf.num_hidden_layers * (attention + 2 * d) + dense * 3 * d * hf.intermediate_size \
        + (hf.num_hidden_layers - dense) * moe
    return hf.vocab_size * d + blocks + d + (0 if hf.tie_word_embeddings else hf.vocab_size * d)
