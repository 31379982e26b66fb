"""``par4d inspect DIR``: what a run folder, one of its checkpoints, or a prepared dataset holds, on one
screen, for a person deciding what to resume: every checkpoint verified (every file's size and SHA-256,
every tensor covered once), the newest intact one, its step, grid, model and data; the run's data and
tokenizer checked against what it recorded. Reads only; nothing in the folder is changed."""

from __future__ import annotations

import hashlib
from pathlib import Path

from par4d.folder import Folder


def inspect(path: Path) -> list[str]:
    """The lines ``par4d inspect`` prints for ``path`` (a run, a checkpoint, or a dataset folder)."""
    from par4d import checkpoint

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder")
    if (path / "index.json").is_file() and not (path / "manifest.json").exists():
        return _dataset(path)
    if path.parent.name == checkpoint.FOLDER and checkpoint.step_of(path.name) is not None:
        chosen = checkpoint.verify(checkpoint.checkpoint_folder(path))
        return [f"checkpoint {path}: intact (every file's SHA-256 and every tensor checked)", *_meta(chosen.meta)]
    if not (path / checkpoint.FOLDER).is_dir():
        raise ValueError(f"{path} is not a par4d run folder (no {checkpoint.FOLDER}/), checkpoint or dataset")
    folder = Folder(path).sub(checkpoint.FOLDER)
    lines, newest = [f"run {path}"], None
    named = {checkpoint.step_of(name): name for name in folder.names() if checkpoint.step_of(name) is not None}
    for _, name in sorted(named.items(), reverse=True):     # by step, as --resume takes them
        try:
            if folder.kind(name) != "folder":
                raise ValueError("a link or a file, not a folder")
            chosen = checkpoint.verify(folder.sub(name))
            state = "intact"
            newest = newest or chosen
        except ValueError as error:
            state = f"UNUSABLE: {str(error)[:150]}"
        chosen_here = state == "intact" and newest.path.name == name
        lines.append(f"  {name}  {state}" + ("  <- --resume goes on from here" if chosen_here else ""))
    if newest is None:
        return lines + ["no intact checkpoint: nothing to resume"]
    return lines + _meta(newest.meta) + _data(newest.meta.get("train_config", {}))


def _meta(meta: dict) -> list[str]:
    config = meta.get("train_config", {})
    grid = " ".join(f"{a}={n}" for a, n in meta.get("grid", config.get("grid", {})).items())
    sizes = ", ".join(f"{k}={config[k]}" for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size")
                      if k in config)
    return [f"step       {meta.get('step')} of {config.get('steps')}",
            f"grid       {grid}",
            f"model      {config.get('model', 'gpt')} ({sizes}; vocabulary {config.get('vocab_size', 256)})",
            f"training   lr {config.get('lr')}, precision {config.get('precision', 'fp32')}, "
            f"overlap {config.get('overlap')}, seed {config.get('seed')}"]


def _data(config: dict) -> list[str]:
    lines = []
    data, recorded = config.get("data"), config.get("data_sha256")
    if data is None:
        from par4d.train.recipes import RECIPES

        model = config.get("model", "gpt")
        kind = RECIPES.get(model) if isinstance(model, str) else None
        lines.append("data       generated images" if kind is not None and kind.data == "images"
                     else "data       Python's bundled documentation")
    else:
        target = Path(data) / "index.json" if Path(data).is_dir() else Path(data)
        lines.append(f"data       {data}: " + _check(target, recorded))
    if config.get("tokenizer"):
        lines.append(f"tokenizer  {config['tokenizer']}: " + _check(Path(config["tokenizer"]),
                                                                     config.get("tokenizer_sha256")))
    else:
        lines.append("tokenizer  bytes (256 tokens)")
    return lines


def _check(file: Path, recorded: str | None) -> str:
    if not file.is_file():
        return "MISSING (a resume needs it)"
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    digest = digest.hexdigest()
    if recorded is None:
        return f"SHA-256 {digest[:12]}... (none recorded)"
    return ("the same as recorded" if digest == recorded else
            f"CHANGED (SHA-256 {digest[:12]}..., the run recorded {recorded[:12]}...; a resume refuses it)")


def _dataset(path: Path) -> list[str]:
    from par4d.data.dataset import open_dataset, verify

    dataset = open_dataset(path, 1)
    index = dataset.index
    bad = verify(path)
    lines = [f"dataset {path}: {'every shard intact' if not bad else 'DAMAGED shards: ' + ', '.join(bad)}",
             f"tokenizer  vocabulary {index['tokenizer']['vocab']:,}, SHA-256 {index['tokenizer']['sha256'][:12]}..., "
             f"end of text {index['tokenizer']['eos']}"]
    for split, record in index["splits"].items():
        lines.append(f"{split:<10} {record['documents']:,} documents, {record['tokens']:,} tokens in "
                     f"{len(record['shards'])} shards ({index['dtype']})")
    lines.append(f"inputs     {len(index['inputs'])} files, {sum(i['size'] for i in index['inputs']) / 1e6:,.1f} MB")
    return lines
