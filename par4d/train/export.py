"""What writing a run's checkpoint as a ``transformers`` model folder is made of (the recipes'
:func:`par4d.train.recipes.export_hf` puts it together): the checkpoint chosen and its full tensors, par4d's
GPT as GPT-2 (:mod:`par4d.adopt.gpt2` maps the names), and the files written, each whole or not at all."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from par4d import checkpoint
from par4d.adopt.gpt2 import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    check_dense,
    hf_config,
    hf_key,
    param_shapes,
    whole,
)
from par4d.folder import Folder
from par4d.models.config import GPTConfig

# -- checking a folder ---------------------------------------------------------------


# -- loading at any grid --------------------------------------------------------------


# -- export ---------------------------------------------------------------------------

def check_out(out: Path, force: bool) -> None:
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


def saved_gpt_config(folder: Path, meta: dict) -> GPTConfig:
    record = meta.get("model_config")
    if not isinstance(record, dict):
        raise ValueError(f"{folder / 'meta.json'} has no model_config: not a checkpoint of par4d train")
    try:
        config = GPTConfig(**record)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{folder / 'meta.json'}: model_config is not a GPTConfig ({error})") from None
    check_memory(folder / "meta.json", config.num_params())
    return config


def check_memory(where: Path, params: int) -> None:
    """Refuse a model whose parameters, whole in fp32 (as export holds them), exceed this machine's memory."""
    from par4d.folder import ABSURD_BYTES
    from par4d.launch.host import host_memory

    need, memory = 4 * params, host_memory()
    if need > (memory or ABSURD_BYTES):
        raise ValueError(f"{where}: the model has {params:,} parameters ({need / 1e9:,.1f} GB whole), more than "
                         f"this machine's memory ({(memory or 0) / 1e9:,.1f} GB)")


def full_tensors(chosen: checkpoint.Checkpoint, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Every model parameter of the checkpoint as a full tensor, from its pieces (verified already)."""
    out = {}
    with checkpoint.pieces(chosen, hashed=False) as saved:
        for name, shape in shapes.items():
            problem = checkpoint.full_shape_problem(chosen, f"model/{name}", shape)
            if problem is not None:
                raise ValueError(f"{problem} (from its model_config)")
            full = torch.empty(shape, dtype=getattr(torch, chosen.tensors[f"model/{name}"]["dtype"]))
            saved.fill(f"model/{name}", full, [whole(shape)])
            out[name] = full
    return out


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@torch.no_grad()
def gpt2_state(chosen: checkpoint.Checkpoint, source: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict under GPT-2's names, config.json) of a checkpoint of par4d's dense GPT."""
    config = saved_gpt_config(chosen.path, chosen.meta)
    check_dense(config, f"run {source} (checkpoint {chosen.path.name})")
    full = full_tensors(chosen, param_shapes(config))
    tensors = {}
    for name, tensor in full.items():
        key, transposed = hf_key(name)
        tensors[key] = (tensor.T if transposed else tensor).contiguous()
    return tensors, hf_config(config, full["wte.weight"].dtype)


def write_weights(out: Path, tensors: dict[str, torch.Tensor], text: str, metadata: dict[str, str],
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
            try:
                written.write_file(name, write=lambda path, shard=shard: save_file(shard, path, metadata=metadata))
            except SafetensorError as error:   # safetensors' own error for a full disk, a quota
                raise OSError(None, str(error), str(written.path(name))) from None
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
            written.write_text(INDEX_FILE, text=json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.write_text(CONFIG_FILE, text=text)
    except OSError as error:
        raise ValueError(f"--to hf {out}: cannot write {error.filename or out} ({error.strerror}); the run "
                         f"is untouched: make room and export again") from None
