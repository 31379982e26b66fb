"""GPT-2's weights and par4d's dense GPT: the names and transposes that map one onto the other, a folder
checked against a model before any rank starts (:func:`check_hf`), and read into any grid's shards
(:func:`load_hf`).

A folder has ``config.json`` (``model_type: gpt2``, ``GPT2LMHeadModel``) and one ``model.safetensors``
with ``transformers``' keys. par4d's dense GPT is GPT-2 but for three settings that the config spells
out: exact GELU (``activation_function: gelu``, GPT-2's own is the tanh approximation), an untied head
(``tie_word_embeddings: false``) and no dropout. The parameters map one to one (:func:`hf_key`); GPT-2's
``Conv1D`` keeps its weight as (in, out), the transpose of par4d's (out, in) ``Linear`` weight, so
those are transposed on the way out and read transposed on the way in. Attention needs no mapping:
``c_attn`` splits its output into q, k, v in that order as par4d's ``qkv`` does, and both scale by
``1/sqrt(head_dim)`` under a causal mask. A phantom MLP (``--mlp phantom``) is not a GPT-2 MLP and is
refused both ways. Loading runs on every rank, each reading only the slices of the file that overlap its
own shards, through the same box machinery as :func:`par4d.checkpoint.load`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from par4d import checkpoint
from par4d.adopt.pretrained import read_config
from par4d.folder import is_count
from par4d.grid import Grid
from par4d.layout import Box, Placement, Reader, boxes, fill, slice_reader
from par4d.models.config import GPTConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Module names of a par4d block (as ReferenceGPT names them) -> GPT-2's; the four Linears are Conv1D there.
_BLOCK = {"ln1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "ln2": "ln_2",
          "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_CONV1D = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
_TOP = {"wte": "transformer.wte", "wpe": "transformer.wpe", "ln_f": "transformer.ln_f", "head": "lm_head"}
# Buffers older transformers saved with GPT-2 (the causal mask): no weights, so a file may carry them.
_BUFFERS = (".attn.bias", ".attn.masked_bias")

# GPT2Config's defaults for the keys checked here, where a config.json leaves one out.
_HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
                "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False, "tie_word_embeddings": True}
LAYER_NORM_EPS = 1e-5   # par4d.nn.LayerNorm's and nn.LayerNorm's default, which both twins use


def hf_key(name: str) -> tuple[str, bool]:
    """(``transformers``' key, whether its tensor is the transpose of par4d's) of par4d parameter
    ``name``, e.g. ``blocks.0.attn.qkv.weight`` -> (``transformer.h.0.attn.c_attn.weight``, True)."""
    module, _, leaf = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}", False
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"transformer.h.{parts[1]}.{_BLOCK[parts[2]]}.{leaf}", parts[2] in _CONV1D and leaf == "weight"
    raise ValueError(f"par4d parameter {name!r} has no GPT-2 counterpart")


def check_dense(config: GPTConfig, what: str) -> None:
    if config.mlp != "dense":
        raise ValueError(f"{what} has mlp={config.mlp!r}: its MLP (phantom layers) is not a GPT-2 MLP, so it has no "
                         f"Hugging Face GPT-2 form; only dense-MLP runs (--mlp dense) are exported or loaded")


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter of the dense GPT of ``config``, by par4d name. Built on the meta
    device: names and shapes come from the model itself, without memory for its weights."""
    from par4d.models import ReferenceGPT

    check_dense(config, "the model")
    with torch.device("meta"):
        twin = ReferenceGPT(config, init=False)
    return {name: tuple(param.shape) for name, param in twin.named_parameters()}


def hf_config(config: GPTConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` of ``config``'s GPT: GPT2LMHeadModel with exact GELU, an untied head, no dropout, and
    no special tokens (bytes are the vocabulary; GPT-2's default ids 50256 would lie outside it)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": 4 * config.n_embd,
            "activation_function": "gelu", "layer_norm_epsilon": LAYER_NORM_EPS,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "tie_word_embeddings": False,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            # transformers 5 reads "dtype"; "torch_dtype" is the same for readers before it.
            "dtype": dtype_name(dtype), "torch_dtype": dtype_name(dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gpt_dims(folder: Path) -> dict[str, int]:
    """The shape of par4d's GPT that ``folder``'s GPT-2 model has, in ``par4d train``'s terms
    (``n_layer``, ``n_embd``, ``n_head``, ``seq_len``): what a run started from it defaults to."""
    config = read_config(Path(folder))
    dims = {}
    for name, key in (("n_layer", "n_layer"), ("n_embd", "n_embd"), ("n_head", "n_head"), ("seq_len", "n_positions")):
        value = config.get(key, _HF_DEFAULTS[key])
        if not is_count(value, 1):
            raise ValueError(f"{Path(folder) / CONFIG_FILE}: {key} is {json.dumps(value)[:40]}, not a size >= 1")
        dims[name] = value
    return dims


def _config_problems(config: dict, model: GPTConfig) -> list[str]:
    """What in a GPT-2 ``config.json`` differs from the par4d model of ``model``: shapes first, then the
    settings that change what the weights compute."""
    def get(key):
        return config.get(key, _HF_DEFAULTS[key])

    wanted = {"vocab_size": (model.vocab_size, "vocab_size"), "n_embd": (model.n_embd, "n_embd"),
              "n_layer": (model.n_layer, "n_layer"), "n_head": (model.n_head, "n_head"),
              "n_positions": (model.block_size, "block_size (--seq-len)")}
    problems = [f"{key}={get(key)} but the par4d model has {label} {value}"
                for key, (value, label) in wanted.items() if get(key) != value]
    if get("n_inner") not in (None, 4 * model.n_embd):
        problems.append(f"n_inner={get('n_inner')} but par4d's MLP has 4 * n_embd = {4 * model.n_embd}")
    settings = {"activation_function": ("gelu", "par4d's GELU is exact"),
                "tie_word_embeddings": (False, "par4d's head is not tied to wte"),
                "layer_norm_epsilon": (LAYER_NORM_EPS, "par4d's LayerNorm eps"),
                "scale_attn_weights": (True, "par4d scales attention by 1/sqrt(head_dim)"),
                "scale_attn_by_inverse_layer_idx": (False, "par4d does not scale attention by layer"),
                "add_cross_attention": (False, "par4d's GPT has no cross-attention")}
    problems += [f"{key}={json.dumps(get(key))} but {why} ({json.dumps(value)})"
                 for key, (value, why) in settings.items() if get(key) != value]
    return problems


def expected_tensors(config: GPTConfig) -> dict[str, tuple[str, bool, tuple[int, ...]]]:
    """Per ``transformers`` key: (par4d name, transposed, shape in the file) of ``config``'s GPT."""
    out = {}
    for name, shape in param_shapes(config).items():
        key, transposed = hf_key(name)
        out[key] = (name, transposed, shape[::-1] if transposed else shape)
    return out


def _some(keys: list[str], shown: int = 4) -> str:
    return ", ".join(keys[:shown]) + (f" (and {len(keys) - shown} more)" if len(keys) > shown else "")


def _check_weights(path: Path, config: GPTConfig) -> None:
    """Every tensor ``config``'s GPT needs is in ``path`` with its shape, and nothing else (the header only)."""
    if not path.is_file():
        raise ValueError(f"{path} is missing (a sharded model.safetensors.index.json is not read: "
                         f"save the model as one file)")
    expected = expected_tensors(config)
    try:
        with safe_open(str(path), "pt") as f:
            found = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
    missing = [key for key in expected if key not in found]
    if missing:
        raise ValueError(f"{path} has no {_some(missing)}")
    extra = sorted(key for key in found if key not in expected and not key.endswith(_BUFFERS))
    if extra:
        raise ValueError(f"{path} has tensors par4d's GPT lacks: {_some(extra)}")
    for key, (_, _, shape) in expected.items():
        if found[key] != shape:
            raise ValueError(f"{path}: {key} has shape {found[key]}, the par4d model needs {shape}")
        if not dtypes[key].startswith(("F", "BF")):
            raise ValueError(f"{path}: {key} has dtype {dtypes[key]}, not a floating-point type")


def check_hf(folder: Path, model_config: GPTConfig) -> dict:
    """Check that ``folder`` holds a GPT-2 model that par4d's GPT of ``model_config`` can start from;
    returns its ``config.json``. Reads the config and the weights' header only, needs no
    ``torch.distributed``: call it before any rank starts. Raises ``ValueError`` naming the file and
    the numbers that differ (all of them for the config)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (a Hugging Face model folder has {CONFIG_FILE} and {WEIGHTS_FILE})")
    check_dense(model_config, "the par4d model")
    config = read_config(folder)
    if config.get("model_type") != "gpt2":
        raise ValueError(f"{folder / CONFIG_FILE}: model_type is {config.get('model_type')!r}, par4d reads 'gpt2'")
    problems = _config_problems(config, model_config)
    if problems:
        raise ValueError(f"{folder / CONFIG_FILE} does not match the par4d model: {'; '.join(problems)}")
    _check_weights(folder / WEIGHTS_FILE, model_config)
    return config


def whole(shape: tuple[int, ...]) -> Box:
    """The box of a whole tensor of ``shape`` (a placement with no splits: one box)."""
    return boxes(checkpoint.WHOLE, shape, {}, {})[0]


def _transposed_reader(reader, key: str) -> Reader:
    """Reads a Conv1D weight (in, out) by par4d's (out, in) slices: the transposed slices, transposed."""
    return lambda src: reader.get_slice(key)[src[::-1]].T


@torch.no_grad()
def load_hf(folder: Path, grid: Grid, model: nn.Module) -> dict:
    """Fill ``model`` (par4d's GPT on ``grid``, ``model.config`` its :class:`GPTConfig`) with the weights of
    the GPT-2 model in ``folder``; returns its ``config.json``. Checks the folder first (:func:`check_hf`).

    Not collective: each rank reads only the slices of ``model.safetensors`` that overlap its own shards,
    whatever the grid. The optimizer's state is not touched (a run started from these weights begins
    with a fresh one)."""
    folder = Path(folder)
    config = check_hf(folder, model.config)
    shapes = param_shapes(model.config)
    coords = grid.coords()
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        for name, record in checkpoint.placements(grid, model).items():
            placement, full = Placement.from_dict(record), tuple(record["shape"])
            if full != shapes.get(name):
                raise ValueError(f"par4d parameter {name} has full shape {full} on this grid, its config gives "
                                 f"{shapes.get(name)}")
            key, transposed = hf_key(name)
            read = _transposed_reader(f, key) if transposed else slice_reader(f, key)
            param = model.get_parameter(name)
            for wanted in boxes(placement, full, coords, grid.sizes):
                fill(param.data, wanted, whole(full), read)
    return config
