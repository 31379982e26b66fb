"""Hugging Face GPT-2 weights: a par4d run's checkpoint out as a ``transformers`` model, and such a
model in as the start of a par4d run, at any grid.

A folder has ``config.json`` (``model_type: gpt2``, ``GPT2LMHeadModel``) and one ``model.safetensors``
with ``transformers``' keys. par4d's dense GPT is GPT-2 but for three settings that the config spells
out: exact GELU (``activation_function: gelu``, GPT-2's own is the tanh approximation), an untied head
(``tie_word_embeddings: false``) and no dropout. The parameters map one to one (:func:`hf_key`); GPT-2's
``Conv1D`` keeps its weight as (in, out), the transpose of par4d's (out, in) ``Linear`` weight, so
those are transposed on the way out and read transposed on the way in. Attention needs no mapping:
``c_attn`` splits its output into q, k, v in that order as par4d's ``qkv`` does, and both scale by
``1/sqrt(head_dim)`` under a causal mask. A phantom MLP (``--mlp phantom``) is not a GPT-2 MLP and is
refused both ways.

Export (:func:`export_hf`) runs in one process: it assembles every full tensor from the checkpoint's
pieces, since it writes one file. Loading (:func:`load_hf`) runs on every rank, each reading only the
slices of the file that overlap its own shards, through the same box machinery as
:func:`par4d.checkpoint.load`; :func:`check_hf` validates a folder against a model's config
before any rank starts.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from par4d import checkpoint
from par4d.adopt.pretrained import read_config
from par4d.folder import Folder, is_count
from par4d.grid import AXES, Grid
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


def _check_dense(config: GPTConfig, what: str) -> None:
    if config.mlp != "dense":
        raise ValueError(f"{what} has mlp={config.mlp!r}: its MLP (phantom layers) is not a GPT-2 MLP, so it has no "
                         f"Hugging Face GPT-2 form; only dense-MLP runs (--mlp dense) are exported or loaded")


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter of the dense GPT of ``config``, by par4d name. Built on the meta
    device: names and shapes come from the model itself, without memory for its weights."""
    from par4d.models import ReferenceGPT

    _check_dense(config, "the model")
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
            "dtype": _dtype_name(dtype), "torch_dtype": _dtype_name(dtype)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- checking a folder ---------------------------------------------------------------

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
    _check_dense(model_config, "the par4d model")
    config = read_config(folder)
    if config.get("model_type") != "gpt2":
        raise ValueError(f"{folder / CONFIG_FILE}: model_type is {config.get('model_type')!r}, par4d reads 'gpt2'")
    problems = _config_problems(config, model_config)
    if problems:
        raise ValueError(f"{folder / CONFIG_FILE} does not match the par4d model: {'; '.join(problems)}")
    _check_weights(folder / WEIGHTS_FILE, model_config)
    return config


# -- loading at any grid --------------------------------------------------------------

def _whole(shape: tuple[int, ...]) -> Box:
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
    coords = {a: grid.coord(a) for a in AXES}
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
                fill(param.data, wanted, _whole(full), read)
    return config


# -- export ---------------------------------------------------------------------------

def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--to hf {out} is a file; give a folder")
    above = next((p for p in out.parents if p.exists()), None)
    if not out.exists() and above is not None and not above.is_dir():
        raise ValueError(f"--to hf {out}: {above} is a file, not a folder")
    writable = out if out.exists() else above
    if writable is not None and not os.access(writable, os.W_OK | os.X_OK):
        raise ValueError(f"--to hf {out}: {writable} is not writable (nothing was written)")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not force:
        raise ValueError(f"--to hf {out} is not empty ({len(entries)} entries, e.g. {entries[0]}); pass --force to "
                         f"replace its {CONFIG_FILE} and weights files, or choose a new or empty folder")


def find_checkpoint(source: Path, report: Callable[[str], None] | None = None) -> checkpoint.Checkpoint:
    """The checkpoint ``source`` names, verified: a run folder's newest intact one (each one skipped is
    reported), or ``source`` itself when it is a ``checkpoints/step-N`` folder."""
    if source.absolute().parent.name == checkpoint.FOLDER and checkpoint.step_of(source.name) is not None:
        return checkpoint.verify(source)     # reached from its run folder: the step and checkpoints/ are no links
    if not source.is_dir():
        raise ValueError(f"--run {source} does not exist or is not a folder")
    if not (source / checkpoint.FOLDER).is_dir():
        raise ValueError(f"--run {source} is not a par4d run: it has no {checkpoint.FOLDER}/ folder (give a run "
                         f"folder, or one of its {checkpoint.FOLDER}/step-N folders)")
    try:
        return checkpoint.choose_checkpoint(source, report)
    except ValueError as error:   # choose speaks of --resume, the flag of its other caller
        raise ValueError(f"--run {source}: {str(error).removeprefix(f'--resume {source}: ')}") from None


def _model_config(folder: Path, meta: dict) -> GPTConfig:
    record = meta.get("model_config")
    if not isinstance(record, dict):
        raise ValueError(f"{folder / 'meta.json'} has no model_config: not a checkpoint of par4d train")
    try:
        config = GPTConfig(**record)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{folder / 'meta.json'}: model_config is not a GPTConfig ({error})") from None
    _check_memory(folder / "meta.json", config.num_params())
    return config


def _check_memory(where: Path, params: int) -> None:
    """Refuse a model whose parameters, whole in fp32 (as export holds them), exceed this machine's memory."""
    from par4d.folder import ABSURD_BYTES
    from par4d.launch.host import host_memory

    need, memory = 4 * params, host_memory()
    if need > (memory or ABSURD_BYTES):
        raise ValueError(f"{where}: the model has {params:,} parameters ({need / 1e9:,.1f} GB whole), more than "
                         f"this machine's memory ({(memory or 0) / 1e9:,.1f} GB)")


def _full_tensors(chosen: checkpoint.Checkpoint, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Every model parameter of the checkpoint as a full tensor, from its pieces (verified already)."""
    out = {}
    with checkpoint.pieces(chosen, hashed=False) as saved:
        for name, shape in shapes.items():
            problem = checkpoint.full_shape_problem(chosen, f"model/{name}", shape)
            if problem is not None:
                raise ValueError(f"{problem} (from its model_config)")
            full = torch.empty(shape, dtype=getattr(torch, chosen.tensors[f"model/{name}"]["dtype"]))
            saved.fill(f"model/{name}", full, [_whole(shape)])
            out[name] = full
    return out


MAX_SHARD_BYTES = 5 * 10**9   # per weights file, as transformers' save_pretrained once defaulted to ("5GB")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@torch.no_grad()
def export_hf(source: Path, out: Path, force: bool = False, report: Callable[[str], None] | None = None,
              shard_bytes: int = MAX_SHARD_BYTES) -> tuple[Path, dict]:
    """Write the model of a par4d checkpoint as a ``transformers`` model folder ``out``: ``config.json``
    and the weights as ``save_pretrained`` writes them (``model.safetensors``, or files of at most
    ``shard_bytes`` named by ``model.safetensors.index.json``); returns (the checkpoint exported, its meta).
    par4d's GPT becomes a GPT2LMHeadModel; a run of ``--model hf-llama`` / ``hf-gpt2`` its own model
    again, under its own names (a tied head is written once, as ``save_pretrained`` does).

    ``source``: a run folder (its newest intact checkpoint; each one skipped is ``report``-ed) or one of its
    ``checkpoints/step-N`` folders. One process, no ``torch.distributed``. Refused, before anything is
    written: ``out`` not empty without ``force`` (which replaces config.json and the weights files, those
    of an earlier export included, and leaves the others), a folder that is not a par4d run, a damaged
    checkpoint, a U-Net or phantom-MLP run."""
    source, out = Path(source), Path(out)
    if not is_count(shard_bytes, 1):
        raise ValueError(f"the largest weights file must be >= 1 byte, got {shard_bytes}")
    _check_out(out, force)
    chosen, tensors, text = hf_state(source, report)
    _write_weights(out, tensors, text, {"format": "pt", "par4d_step": str(chosen.meta.get("step"))}, shard_bytes)
    return chosen.path, chosen.meta


def hf_state(source: Path, report: Callable[[str], None] | None = None
             ) -> tuple[checkpoint.Checkpoint, dict[str, torch.Tensor], str]:
    """(the checkpoint chosen, its model's state dict under ``transformers``' names, the ``config.json``
    text) of the run or checkpoint ``source``, as :func:`export_hf` writes them (and ``par4d generate``
    builds them): whole tensors, in one process."""
    from par4d.train.recipes import RECIPES

    source = Path(source)
    chosen = find_checkpoint(source, report)
    trained = chosen.meta.get("train_config", {}).get("model", "gpt")
    if not isinstance(trained, str) or trained not in RECIPES:
        raise ValueError(f"{chosen.path / 'meta.json'}: train_config's model is {str(trained)[:40]!r}, not one par4d "
                         f"trains ({', '.join(RECIPES)})")
    tensors, text = RECIPES[trained].export_hf(chosen, source)     # the model's own recipe says how
    return chosen, tensors, text


def gpt2_state(chosen: checkpoint.Checkpoint, source: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict under GPT-2's names, config.json) of a checkpoint of par4d's dense GPT."""
    config = _model_config(chosen.path, chosen.meta)
    _check_dense(config, f"run {source} (checkpoint {chosen.path.name})")
    full = _full_tensors(chosen, param_shapes(config))
    tensors = {}
    for name, tensor in full.items():
        key, transposed = hf_key(name)
        tensors[key] = (tensor.T if transposed else tensor).contiguous()
    return tensors, hf_config(config, full["wte.weight"].dtype)


def lm_state(chosen: checkpoint.Checkpoint) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, config.json) of a run's Hugging Face model: the checkpoint's ``lm.*`` parameters under
    the model's own names, the config it was built from."""
    from par4d.train.config import TrainConfig
    from par4d.train.recipes.hf import hf_lm

    where = chosen.path / "meta.json"
    record = chosen.meta.get("train_config")
    TrainConfig.check_record(record, f"{where}: train_config")
    try:
        config = TrainConfig(**record)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: train_config is not a run's settings ({error})") from None
    with torch.device("meta"):
        lm = hf_lm(config)
    shapes = {f"lm.{name}": tuple(p.shape) for name, p in lm.named_parameters()}   # a tied head once
    _check_memory(where, sum(math.prod(s) for s in shapes.values()))
    full = _full_tensors(chosen, shapes)
    tensors = {name.removeprefix("lm."): t.contiguous() for name, t in full.items()}
    settings = lm.config.to_diff_dict()
    dtype = _dtype_name(next(iter(full.values())).dtype)
    settings.update(architectures=[type(lm).__name__], dtype=dtype)
    settings.pop("torch_dtype", None)
    return tensors, json.dumps(settings, indent=2, sort_keys=True) + "\n"


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], text: str, metadata: dict[str, str],
                   shard_bytes: int) -> None:
    """``config.json`` and the weights into ``out`` as ``save_pretrained`` lays them out, each file whole
    or not at all and never through a link planted there; weights files of an earlier export that this
    one does not write are removed (they would be read with the new ones)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    names = ([WEIGHTS_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written = Folder(out)
    try:
        stale = [n for n in (written.names() if out.is_dir() else [])
                 if (n in (WEIGHTS_FILE, INDEX_FILE) or _SHARD.fullmatch(n)) and n not in names]
        for name in stale:
            written.remove_file(name)
        for name, shard in zip(names, shards):
            written.write_file(name, write=lambda path, shard=shard: save_file(shard, path, metadata=metadata))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
            written.write_text(INDEX_FILE, text=json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.write_text(CONFIG_FILE, text=text)
    except OSError as error:
        raise ValueError(f"--to hf {out}: cannot write {error.filename or out} ({error.strerror})") from None
