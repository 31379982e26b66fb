"""``par4d inspect DIR``: what a run folder, one of its checkpoints, or a prepared dataset holds, on one
screen, for a person deciding what to resume: every checkpoint verified (every file's size and SHA-256,
every tensor covered once), the newest intact one, its step, grid, model and data; the run's data and
tokenizer checked against what it recorded; a dataset's tokenizer and every shard (SHA-256, ids below the
vocabulary). Reads only; nothing in the folder is changed. Whatever is damaged or changed is marked in
capitals on its line, and the report says so (``par4d inspect`` then exits 1)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from par4d.cli.report import buckets
from par4d.folder import Folder


@dataclass
class Report:
    """The lines ``par4d inspect`` prints, and whether any of them marks something damaged or changed."""

    lines: list[str]
    damaged: bool


def inspect(path: Path) -> Report:
    """What ``path`` (a run, a checkpoint, or a dataset folder) holds; raises ``ValueError`` naming it if it
    is none of them."""
    from par4d import checkpoint
    from par4d.folder import path_kind

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} {path_kind(path)}: give a run, checkpoint or dataset folder")
    if (path / "index.json").is_file() and not (path / "manifest.json").exists():
        return _dataset(path)
    if path.parent.name == checkpoint.FOLDER and checkpoint.step_of(path.name) is not None:
        try:
            chosen = checkpoint.verify(checkpoint.checkpoint_folder(path))
        except ValueError as error:
            return Report([f"checkpoint {path}: UNUSABLE: {error}"], True)
        return Report([f"checkpoint {path}: intact (every file's SHA-256 and every tensor checked)",
                       *_meta(chosen.meta)], False)
    if (path / "progress.json").is_file() and not (path / checkpoint.FOLDER).exists():
        raise ValueError(f"{path} is an unfinished dataset (progress.json, no index.json): run the same par4d data "
                         f"prepare again to finish it")
    if not (path / checkpoint.FOLDER).is_dir():
        raise ValueError(f"{path} is not a par4d run folder (no {checkpoint.FOLDER}/), checkpoint or dataset")
    folder = Folder(path).sub(checkpoint.FOLDER)
    lines, newest, damaged = [f"run {path}"], None, False
    named = {checkpoint.step_of(name): name for name in folder.names() if checkpoint.step_of(name) is not None}
    for _, name in sorted(named.items(), reverse=True):     # by step, as --resume takes them
        try:
            if folder.kind(name) != "folder":
                raise ValueError("a link or a file, not a folder")
            chosen = checkpoint.verify(folder.sub(name))
            state = "intact"
            newest = newest or chosen
        except ValueError as error:
            state, damaged = f"UNUSABLE: {str(error)[:150]}", True
        chosen_here = state == "intact" and newest.path.name == name
        lines.append(f"  {name}  {state}" + ("  <- --resume goes on from here" if chosen_here else ""))
    if newest is None:
        return Report(lines + ["no intact checkpoint: nothing to resume" if named else
                               "no checkpoint saved yet: nothing to resume"], damaged)
    data, changed = _data(newest.meta.get("train_config", {}))
    return Report(lines + _meta(newest.meta) + data, damaged or changed)


def _meta(meta: dict) -> list[str]:
    config = meta.get("train_config", {})
    grid = " ".join(f"{a}={n}" for a, n in meta.get("grid", config.get("grid", {})).items())
    shape = ("n_layer", "n_embd", "n_head", "seq_len", "batch_size") + (("experts", "top_k")
                                                                        if config.get("mlp") == "moe" else ())
    sizes = ", ".join(f"{k}={config[k]}" for k in shape if k in config)
    return [f"step       {meta.get('step')} of {config.get('steps')}",
            f"grid       {grid}",
            f"model      {config.get('model', 'gpt')} ({sizes}; vocabulary {config.get('vocab_size', 256)})",
            f"training   lr {config.get('lr')}, precision {config.get('precision', 'fp32')}, "
            f"overlap {config.get('overlap')}{buckets(config)}, seed {config.get('seed')}"]


def _data(config: dict) -> tuple[list[str], bool]:
    """The run's data and tokenizer lines, and whether either changed or is missing."""
    lines, changed = [], False
    data, recorded = config.get("data"), config.get("data_sha256")
    if data is None:
        from par4d.train.recipes import RECIPES

        model = config.get("model", "gpt")
        kind = RECIPES.get(model) if isinstance(model, str) else None
        lines.append("data       generated images" if kind is not None and kind.data == "images"
                     else "data       Python's bundled documentation")
    else:
        target = Path(data) / "index.json" if Path(data).is_dir() else Path(data)
        state, bad = _check(target, recorded)
        lines.append(f"data       {data}: {state}")
        changed |= bad
    if config.get("tokenizer"):
        state, bad = _check(Path(config["tokenizer"]), config.get("tokenizer_sha256"))
        lines.append(f"tokenizer  {config['tokenizer']}: {state}")
        changed |= bad
    else:
        lines.append("tokenizer  bytes (256 tokens)")
    return lines, changed


def _check(file: Path, recorded: str | None) -> tuple[str, bool]:
    """What ``file`` is against the SHA-256 ``recorded``, and whether it is missing or changed."""
    if not file.is_file():
        return "MISSING (a resume needs it)", True
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    digest = digest.hexdigest()
    if recorded is None:
        return f"SHA-256 {digest[:12]}... (none recorded)", False
    if digest == recorded:
        return "the same as recorded", False
    return f"CHANGED (SHA-256 {digest[:12]}..., the run recorded {recorded[:12]}...; a resume refuses it)", True


def _dataset(path: Path) -> Report:
    """A dataset folder: its index, then its tokenizer and every shard checked (:func:`verify`)."""
    from par4d.data.dataset import verify
    from par4d.data.prepare import read_index

    index = read_index(Folder(path.absolute()))
    problems = verify(path)
    state = (f"DAMAGED ({len(problems)} problem{'s' if len(problems) > 1 else ''})" if problems else
             "intact (its tokenizer the index's; every shard's SHA-256 and ids checked)")
    lines = [f"dataset {path}: {state}",
             *(f"  {problem}" for problem in problems),
             f"tokenizer  vocabulary {index['tokenizer']['vocab']:,}, SHA-256 {index['tokenizer']['sha256'][:12]}..., "
             f"end of text {index['tokenizer']['eos']}"]
    for split, record in index["splits"].items():
        lines.append(f"{split:<10} {record['documents']:,} documents, {record['tokens']:,} tokens in "
                     f"{len(record['shards'])} shards ({index['dtype']})")
    lines.append(f"inputs     {len(index['inputs'])} files, {sum(i['size'] for i in index['inputs']) / 1e6:,.1f} MB")
    return Report(lines, bool(problems))
