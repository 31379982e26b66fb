"""A Hugging Face model folder as ``save_pretrained`` writes it: ``config.json`` and the weights
in safetensors, one ``model.safetensors`` or shards named by ``model.safetensors.index.json``.

Read without running or unpickling anything: a folder whose config names its own code
(``auto_map``) is refused, and so is one whose weights are only in a pickle
(``pytorch_model.bin`` and the like: unpickling runs code). Only headers are read here;
:func:`par4d.adopt.load.load_safetensors` then reads each rank's slices.

Links are followed (a Hugging Face cache's snapshot folder is links into its blobs), but the
index may only name files by their bare names: every file read is one the folder lists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# par4d train --model -> the Hugging Face model types it starts from
FAMILIES = {"hf-llama": ("llama", "mistral", "qwen2"), "hf-gpt2": ("gpt2",), "hf-mixtral": ("mixtral",),
            "hf-qwen3-moe": ("qwen3_moe",), "hf-olmoe": ("olmoe",), "hf-deepseek-v3": ("deepseek_v3",)}


def read_config(folder: Path) -> dict:
    """``folder``'s ``config.json`` as a dict; refused if it is not a JSON object with a model_type or
    names code of its own (``auto_map``: par4d never runs a folder's code)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: {folder} is not a Hugging Face model folder")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not JSON ({error})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{path} is not a model config (a JSON object with a model_type)")
    if "auto_map" in config:
        raise ValueError(f"{path} has auto_map: the model is code shipped in the folder, which par4d never runs; "
                         f"give a folder of a model type transformers itself implements")
    return config


def _index(folder: Path) -> dict[str, Path]:
    """{tensor key: its file} from ``model.safetensors.index.json``; file names must be bare names."""
    path = folder / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not JSON ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path} has no weight_map (an object of tensor name -> file)")
    files = {}
    for key, name in weight_map.items():
        if not (isinstance(name, str) and name.endswith(".safetensors") and name == Path(name).name
                and name not in (".", "..")):
            raise ValueError(f"{path}: {key} is in {str(name)[:80]!r}, not a .safetensors file of this folder "
                             f"(the index may name files by their bare names only)")
        files[key] = folder / name
    return files


def _weight_files(folder: Path) -> dict[str, Path] | Path:
    """The index's {key: file}, or the one weights file; refused with what the folder has instead."""
    if (folder / INDEX_FILE).is_file():
        return _index(folder)
    if (folder / SINGLE_FILE).is_file():
        return folder / SINGLE_FILE
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLES))
    if pickles:
        raise ValueError(f"{folder} has its weights in {pickles[0]}, a pickle, which par4d never loads (unpickling "
                         f"runs code); save the model with safetensors (save_pretrained's default) and try again")
    raise ValueError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: no weights to start from")


def read_pretrained(folder: str | Path, model: str) -> dict:
    """Check that ``folder`` holds a model ``par4d train --model`` ``model`` starts from (its type one of
    :data:`FAMILIES`; safetensors weights, floating point, every tensor the index lists where it says)
    from its headers; returns its ``config.json``. Needs no ``torch.distributed``: call it before any
    rank starts. Raises ``ValueError`` naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (a Hugging Face model folder has {CONFIG_FILE} and safetensors)")
    config = read_config(folder)
    types = FAMILIES[model]
    if config["model_type"] not in types:
        raise ValueError(f"{folder / CONFIG_FILE}: model_type is {config['model_type']!r}; --model {model} starts "
                         f"from {', '.join(types)}")
    found = _weight_files(folder)
    keys_of: dict[Path, list[str]] = {}
    for key, path in (found.items() if isinstance(found, dict) else []):
        keys_of.setdefault(path, []).append(key)
    files, dtypes = {}, {}
    for path in (sorted(keys_of) if isinstance(found, dict) else [found]):
        if not path.is_file():
            raise ValueError(f"{folder / INDEX_FILE} names {path.name}, which is not in {folder}")
        try:
            with safe_open(str(path), "pt") as f:
                held = list(f.keys())
                dtypes.update({key: f.get_slice(key).get_dtype() for key in held})
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
        listed = keys_of.get(path, held)
        absent = sorted(set(listed) - set(held))
        if absent:
            raise ValueError(f"{folder / INDEX_FILE} puts {absent[0]} in {path.name}, which does not hold it")
        files.update({key: path for key in listed})
    odd = sorted(k for k in files if not dtypes[k].startswith(("F", "BF")) and not _buffer(k))
    if odd:
        raise ValueError(f"{files[odd[0]]}: {odd[0]} has dtype {dtypes[odd[0]]}, not a floating-point type")
    return config


def held_apart(folder: str | Path, head: str, embedding: str) -> bool:
    """Whether ``folder``'s weights hold ``head`` with values of its own: present, and not ``embedding``'s
    (``save_pretrained`` writes a tied head once; a folder may still hold both copies, equal)."""
    files = weight_files(folder)
    if head not in files:
        return False
    if embedding not in files:
        return True
    with opened({k: files[k] for k in (head, embedding)}) as handles:
        one, other = (handles[k].get_tensor(k) for k in (head, embedding))
    return one.shape != other.shape or not bool((one == other).all())


def _buffer(key: str) -> bool:
    """Buffers older transformers saved with GPT-2 (its causal mask): not weights, never read."""
    return key.endswith((".attn.bias", ".attn.masked_bias"))


@contextmanager
def opened(files: dict[str, Path]) -> Iterator[dict[str, object]]:
    """{tensor key: the open ``safe_open`` handle of its file}, each file opened once."""
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), "pt")) for path in sorted(set(files.values()))}
        yield {key: handles[path] for key, path in files.items()}


def weight_files(path: str | Path) -> dict[str, Path]:
    """{tensor key: file} of one safetensors file, or of a model folder's (one file or sharded)."""
    path = Path(path)
    if path.is_dir():
        found = _weight_files(path)
        if isinstance(found, dict):
            return found
        path = found
    if not path.is_file():
        raise ValueError(f"no such file {path}")
    try:
        with safe_open(str(path), "pt") as f:
            return {key: path for key in f.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
