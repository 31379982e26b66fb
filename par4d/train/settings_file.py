"""``par4d train --config run.toml``: every option of ``par4d train`` in TOML sections; flags given on the
command line override the file. Unknown sections and keys, and values of the wrong type, are refused
with the file and line. A run keeps its resolved settings as ``config.toml`` (:func:`resolved`), so
``par4d train --config runs/X/config.toml`` trains the same run again, in a new folder.

A key is the flag's name with ``_`` for ``-``; the grid's axes are keys of ``[grid]`` (``auto = true``
for ``--grid auto``); ``init_from = "DIR"`` is ``--init-from hf DIR``; ``offload_optimizer = N`` is
``--offload-optimizer N``; ``progress = false`` is ``--no-progress``. docs/config.md has the table.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from par4d.folder import Folder
from par4d.grid import AXES, FOLDED, SHOWN_ABOVE_ONE

# What a run's config.toml leaves out: --grid auto (the grid it chose is there), the launch, its folder.
NOT_KEPT = ("grid_auto", "nproc", "machine", "out", "max_restarts")
# section -> {key: (the argparse destination, the type(s) a value must have); a destination is also the
# TrainConfig field (the grid's axes aside) that a run's resolved settings take it from}
INT, FLOAT, STR, BOOL = (int,), (int, float), (str,), (bool,)
SECTIONS: dict[str, dict[str, tuple[str, tuple]]] = {
    "model": {"model": ("model", STR), "n_layer": ("n_layer", INT), "n_embd": ("n_embd", INT),
              "n_head": ("n_head", INT), "mlp": ("mlp", STR), "phantom_k": ("phantom_k", INT),
              "experts": ("experts", INT), "top_k": ("top_k", INT), "shared_experts": ("shared_experts", INT),
              "capacity_factor": ("capacity_factor", FLOAT), "expert_bias_rate": ("expert_bias_rate", FLOAT),
              "image_size": ("image_size", INT), "init_from": ("init_from", STR)},
    "data": {"data": ("data", STR), "tokenizer": ("tokenizer", STR), "seq_len": ("seq_len", INT),
             "document_mask": ("document_mask", BOOL), "restart_positions": ("restart_positions", BOOL),
             "batch_size": ("batch_size", INT), "seed": ("seed", INT)},
    "grid": {**{axis: (f"axis_{axis}", INT) for axis in (*AXES, *FOLDED)}, "auto": ("grid_auto", BOOL),
             "nproc": ("nproc", INT), "machine": ("machine", STR), "hierarchical": ("hierarchical", STR),
             "overlap": ("overlap", STR), "bucket_mb": ("bucket_mb", FLOAT), "context_form": ("context_form", STR),
             "recompute": ("recompute", STR), "compile": ("compile", STR), "float8": ("float8", STR),
             "microbatches": ("microbatches", INT), "pipeline_limit": ("pipeline_limit", INT)},
    "optimizer": {"lr": ("lr", FLOAT), "grad_clip": ("grad_clip", FLOAT), "precision": ("precision", STR),
                  "grad_reduce": ("grad_reduce", STR), "offload_optimizer": ("offload_bsize", INT)},
    "schedule": {"steps": ("steps", INT)},
    "checkpoint": {"out": ("out", STR), "save_every": ("save_every", INT), "keep": ("keep", INT),
                   "max_restarts": ("max_restarts", INT)},
    "logging": {"progress": ("progress", BOOL), "tensorboard": ("tensorboard", BOOL),
                "eval_every": ("eval_every", INT), "peak_flops": ("matmul_peak", FLOAT)},
}


def _line(text: str, section: str | None, key: str | None = None) -> int:
    """The line of ``[section]`` (or of ``key`` inside it) in ``text``: 0 when not found."""
    lines, inside = text.splitlines(), section is None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        header = re.match(r"^\[\s*([^\]]+?)\s*\]", stripped)
        if header:
            if key is not None and header.group(1) == f"{section}.{key}":
                return number            # a table inside a section: [model.sizes] where a value belongs
            inside = header.group(1) == section
            if inside and key is None:
                return number
            continue
        if inside and key is not None and re.match(rf"^\"?{re.escape(key)}\"?\s*=", stripped):
            return number
    return 0


MOE = ("experts", "top_k", "shared_experts", "capacity_factor", "expert_bias_rate")   # kept for a mixture's run only

# Destinations whose value names a file or folder: an empty string names none (it would not mean "the default").
PATHS = ("data", "tokenizer", "init_from", "out")


def read(path: str | Path, choices: dict[str, tuple] | None = None) -> dict[str, object]:
    """{argparse destination: value} of the settings file at ``path``; raises ``ValueError`` naming the
    file and line of the first unknown section or key, wrongly typed value, value outside its flag's
    ``choices`` (destination -> the values its flag takes), or empty path."""
    try:
        import tomllib  # the standard library's TOML reader (Python 3.11 on)
    except ImportError:
        raise ValueError("--config needs Python 3.11 or newer (its tomllib reads TOML)") from None
    path = Path(path).absolute()
    # A config is the user's own file, read only: a link to one is followed (a dotfiles folder, a shared
    # recipe). What it ends at must be a regular file, read up to a limit: never a FIFO that blocks or a
    # device that never ends, whoever planted the link.
    real = Path(os.path.realpath(path))
    try:
        text = Folder(real.parent).read_text(real.name, limit=1 << 20)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        target = f" (a link to {real})" if real != path else ""
        raise ValueError(f"--config {path}{target}: {error}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"--config {path}: not TOML ({error})") from None
    out: dict[str, object] = {}
    for section, values in document.items():
        if section not in SECTIONS or not isinstance(values, dict):
            where = f"{path}:{_line(text, section) or _line(text, None, section)}"
            raise ValueError(f"{where}: unknown section [{section}]; par4d train's are "
                             f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        for key, value in values.items():
            where = f"{path}:{_line(text, section, key)}"
            if key not in SECTIONS[section]:
                close = [k for s, keys in SECTIONS.items() for k in keys if k == key]
                hint = f" (it belongs in [{next(s for s, ks in SECTIONS.items() if key in ks)}])" if close else ""
                raise ValueError(f"{where}: unknown key {key!r} in [{section}]{hint}; valid: "
                                 f"{', '.join(SECTIONS[section])}")
            dest, kinds = SECTIONS[section][key]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                names = " or ".join({int: "an integer", float: "a number", str: "a string", bool: "true or false"}[k]
                                    for k in kinds if not (k is int and float in kinds))
                raise ValueError(f"{where}: {key} = {value!r} must be {names}")
            if dest in (choices or {}) and value not in choices[dest]:
                raise ValueError(f"{where}: {key} = {value!r}: give one of {', '.join(choices[dest])} (as its flag "
                                 f"takes)")
            if dest in PATHS and not value.strip():
                raise ValueError(f"{where}: {key} = {value!r} names no file or folder (remove the key for the "
                                 f"default)")
            out[dest] = value
    return out


def apply(args, settings: dict[str, object], source: str) -> None:
    """Fill ``args`` (parsed ``par4d train`` flags) from a settings file's values wherever the command line
    gave nothing (None): flags override the file."""
    axes = {axis: settings.pop(f"axis_{axis}") for axis in (*AXES, *FOLDED) if f"axis_{axis}" in settings}
    auto = settings.pop("grid_auto", False)
    if axes and auto:
        raise ValueError(f"--config {source}: [grid] gives both axis sizes and auto = true")
    if args.grid is None and (axes or auto):
        args.grid = "auto" if auto else ",".join(f"{a}={n}" for a, n in axes.items())
    if "init_from" in settings and args.init_from is None:
        args.init_from = ["hf", settings.pop("init_from")]
    settings.pop("init_from", None)
    if "progress" in settings:
        if args.no_progress is None:
            args.no_progress = not settings["progress"]
        settings.pop("progress")
    for dest, value in settings.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def resolved(config) -> str:
    """A run's settings (``TrainConfig``) as a settings file: what ``--config`` reads to train the same run
    again. Its folder, resume state and what par4d derives (hashes, the vocabulary, a pretrained config)
    are left out, and so are sizes the model does not use; the grid is the one the run chose."""
    from par4d.train.recipes import recipe

    def value(dest: str):
        if dest.startswith("axis_"):
            axis = dest.removeprefix("axis_")
            return None if axis in (*FOLDED, *SHOWN_ABOVE_ONE) and axis not in config.grid else config.grid.get(axis, 1)
        if dest in MOE and config.mlp != "moe":       # (given without --mlp moe, they are refused)
            return None
        return None if dest in NOT_KEPT else getattr(config, dest)

    lines = ["# par4d train's settings for this run, resolved (par4d train --config FILE trains it again;",
             "# flags override them; --out picks the new run's folder)"]
    for section, keys in SECTIONS.items():
        body = [f"{key} = {_toml(value(dest))}" for key, (dest, _) in keys.items()
                if value(dest) is not None and key not in recipe(config.model).unused]
        if body:
            lines += ["", f"[{section}]", *body]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
