"""``par4d bench checkpoint``: what one resharding load costs, par4d against torch.distributed.checkpoint.

One job of N ranks (default 4), in turns for ``--repeats`` rounds:

* par4d: the GPT (:func:`par4d.train.recipes.gpt.build_gpt`) on grid A (default ``x=2,z=2``)
  takes one AdamW step (so its optimizer state exists) and is saved
  (:func:`par4d.checkpoint.save`); grid A is closed, the model built again on grid B
  (default ``z=2,data=2``, other initial weights) with a fresh AdamW, and
  :func:`par4d.checkpoint.load` is timed: it must reshard A's pieces onto B.
* torch: the same model's plain-PyTorch twin (:func:`par4d.train.recipes.gpt.build_reference`)
  sharded with FSDP2 (``fully_shard`` per block and root) over all N ranks takes one
  AdamW step and is saved with ``dcp.save`` of ``get_state_dict(model, optimizer)``; then
  the twin is built again as HSDP (FSDP2 on the (2, N/2) mesh of ``par4d bench peers``:
  replicated over 2, sharded over N/2), and the load a PyTorch user writes is timed:
  ``get_state_dict`` (which creates the fresh optimizer's state), ``dcp.load``,
  ``set_state_dict``. DCP reshards: every saved chunk is a quarter of a tensor, every
  rank now holds a half.

The saves are each framework's default: both fsync every file they write (DCP's
``FileSystemWriter`` with ``sync_files=True``); par4d also hashes every piece for
``manifest.json``. par4d's timed load is what ``par4d train --resume`` does: one process
verifies the whole folder (sizes and SHA-256), then every rank reads its slices, checking
sizes only.

Both loads start from a built model and an AdamW without state, and both end with the
model and AdamW state filled; the load on every rank is timed from a common barrier to
its own return, and the slowest rank is the row's number. Before the timed load the
memory freed by the previous phase is handed back to the system (``malloc_trim``).

Per rank and timed call: seconds; the peak resident memory it added (``VmHWM`` after the
call, its peak reset through ``/proc/self/clear_refs`` just before, minus ``VmRSS``
before), the largest ``RssAnon`` and ``RssFile`` added, sampled every 10 ms (VmHWM counts
both: a load through ``mmap`` maps page-cache pages, which are not memory of its own), and
what stays resident (``VmRSS`` after minus before: the optimizer state a load creates, for
instance); bytes written (the checkpoint's files); the tensor bytes the
load read, counted exactly where it reads them: par4d's slices of safetensors pieces
(its handles are wrapped to count what ``get_slice``/``get_tensor`` return) and DCP's
saved chunks (a ``FileSystemReader`` that counts the length of every chunk it opens: DCP
reads a whole saved chunk and narrows it); par4d's verified bytes (the whole folder,
hashed once, on rank 0); and
``/proc/self/io`` ``rchar`` (bytes through ``read()``: DCP's reads and par4d's hashing,
not par4d's slices, which come through ``mmap``) and ``read_bytes`` (from the disk: near
zero here, the files were just written and sit in the page cache; the numbers are those
of a warm cache). Rows report the slowest rank (max over ranks) and, over repeats, the
median.

Every timed load is checked: after it, every parameter and every AdamW tensor (``exp_avg``,
``exp_avg_sq``, ``step``) is unsharded (par4d: :func:`par4d.layout.unshard`; torch:
``DTensor.full_tensor``) and its bytes' SHA-256 compared with that of the same full tensor
before the save, and the pieces that ranks hold as copies of one another (over ``data``, or
HSDP's replicate dim; unsharding reads one copy) are compared between those ranks; a mismatch
fails the job on every rank, so no row times a broken load.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from par4d import checkpoint
from par4d.bench.checkpoint_measure import (
    Reads,
    counting_reads,
    measured,
)
from par4d.bench.common import emit, launch, where
from par4d.grid import Grid, parse_grid, validate_sizes
from par4d.launch import distributed_env, init, join
from par4d.launch.host import threads_per_rank
from par4d.layout import placement_of, shard_batch, shard_name, unshard
from par4d.models import GPTConfig
from par4d.overlap import Overlap
from par4d.train.config import TrainConfig
from par4d.train.recipes.gpt import build_gpt, build_reference
from par4d.train.step import train_step

STEP_TOKENS = 16          # tokens per sequence of the one training step before the save (values only: not timed)
SLOTS = ("exp_avg", "exp_avg_sq", "step")
NAMES = {("par4d", "save"): "par4d save", ("par4d", "load"): "par4d load (A->B)",
         ("torch", "save"): "torch DCP save", ("torch", "load"): "torch DCP load (FSDP2 -> HSDP)"}


@dataclass(frozen=True)
class CheckpointBench:
    config: GPTConfig
    grid_from: dict[str, int]     # complete (every axis), as validate_sizes gives it
    grid_to: dict[str, int]
    repeats: int
    workdir: str                  # checkpoints go here (one folder per phase, removed after it)
    nproc: int

    @property
    def world(self) -> int:
        return self.nproc


# -- what one rank measures ------------------------------------------------------------------------------


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


# -- par4d ---------------------------------------------------------------------------------------------------


def _par4d_state(grid: Grid, model, optimizer) -> tuple[dict[str, str] | None, dict[str, str]]:
    """SHA-256 of every full parameter and AdamW tensor on rank 0 (None elsewhere; collective: unshard),
    and of this rank's own pieces, keyed by name and shard (:func:`par4d.layout.shard_name`, the same
    on the ranks that hold copies of one piece: unshard reads one copy only)."""
    full_digests, local_digests = {}, {}
    for name, param in model.named_parameters():
        placement = placement_of(param)
        for key, tensor in (("param", param.data), *((slot, optimizer.state[param][slot]) for slot in SLOTS)):
            full = tensor if key == "step" else unshard(grid, tensor, placement)
            if grid.rank == 0:
                full_digests[f"{name}/{key}"] = _sha256(full)
            piece = name if key == "step" else shard_name(grid, name, placement)
            local_digests[f"{piece}/{key}"] = _sha256(tensor)
    return (full_digests if grid.rank == 0 else None), local_digests


def _step_batch(config: GPTConfig, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (sequences, min(STEP_TOKENS, config.block_size) + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _other_weights(config: GPTConfig) -> GPTConfig:
    return GPTConfig(**{**config.__dict__, "seed": config.seed + 1})


def _par4d_round(bench: CheckpointBench, folder: Path) -> tuple[dict, dict]:
    overlap = Overlap.none()       # the step before the save is not timed; no prefetch buffers in the way
    grid = init(**bench.grid_from)
    model = build_gpt(bench.config, grid, overlap=overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = _step_batch(bench.config, bench.world)
    train_step(model, optimizer, grid, (shard_batch(grid, inputs), shard_batch(grid, targets)))
    expected = _par4d_state(grid, model, optimizer)
    save: dict = {}
    with measured(save):
        target = checkpoint.save(folder, 1, grid, model, optimizer, {"bench": "checkpoint"}, keep=1)
    save["written_bytes"] = sum(f.stat().st_size for f in target.iterdir()) if grid.rank == 0 else 0
    own = target / f"rank-{grid.rank:05d}.safetensors"
    save["written_bytes_rank"] = own.stat().st_size if own.exists() else 0
    del model, optimizer
    grid.close()

    grid = init(**bench.grid_to)
    model = build_gpt(_other_weights(bench.config), grid, overlap=overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reads, load = Reads(), {}
    with counting_reads(reads), measured(load):
        # As par4d train --resume: the whole folder is verified once (sizes, SHA-256), then every
        # rank reads its slices, checking sizes only.
        if grid.rank == 0:
            checkpoint.verify(target)
        dist.barrier()
        checkpoint.load(folder, grid, model, optimizer, folder=target, verified=True)
    load.update(read_bytes=reads.bytes, files_opened=len(reads.files),
                verified_bytes=sum(f.stat().st_size for f in target.iterdir()) if grid.rank == 0 else 0)
    _check_same(expected, _par4d_state(grid, model, optimizer), f"par4d {_short(bench.grid_from)} -> "
                                                                  f"{_short(bench.grid_to)}")
    del model, optimizer
    grid.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    return save, load


def _short(sizes: dict[str, int]) -> str:
    """``x=2,z=2``: the axes larger than 1, as --from and --to take them."""
    return ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "x=1"


def _check_same(expected: tuple[dict[str, str] | None, dict], got: tuple[dict[str, str] | None, dict],
                what: str) -> None:
    """Collective: every rank raises unless, on rank 0, the full tensors after the load have the digests
    of those before the save, and on every rank the pieces that are copies of one another agree."""
    (saved, _), (loaded, local) = expected, got
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    problem = None
    if dist.get_rank() == 0:
        wrong = sorted(set(saved) ^ set(loaded)) + [key for key in saved if key in loaded and saved[key] != loaded[key]]
        first: dict[str, str] = {}
        copies = sorted({key for digests in every for key, d in digests.items() if first.setdefault(key, d) != d})
        if wrong or copies:
            problem = (f"{what}: after the load {len(wrong)} of {len(saved)} full tensors differ from the saved ones "
                       f"(first: {wrong[:3]}) and {len(copies)} pieces differ between the ranks that hold copies "
                       f"(first: {copies[:3]}); this load is broken, its time is not reported")
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise AssertionError(verdict[0])


# -- torch DCP ------------------------------------------------------------------------------------------------

def _counting_reader(path: Path, counter: dict):
    """DCP's FileSystemReader, counting the bytes of every saved chunk it opens (it reads each whole)."""
    from torch.distributed.checkpoint import FileSystemReader

    class CountingReader(FileSystemReader):
        def _slice_file(self, file, sinfo):
            counter["bytes"] += sinfo.length
            return super()._slice_file(file, sinfo)

    return CountingReader(path)


def _shard(model, mesh):
    """FSDP2 as ``par4d bench peers`` applies it (its ``_build``, which is fixed to the demo config):
    ``fully_shard`` per block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.blocks:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _torch_state(model, optimizer) -> tuple[dict[str, str] | None, dict[str, str]]:
    """As :func:`_par4d_state`, for DTensors: full tensors (``full_tensor``) on rank 0, and this rank's
    local pieces keyed by name and coordinates on the mesh dims it is sharded over."""
    from torch.distributed.tensor import DTensor

    full_digests, local_digests = {}, {}
    for name, param in model.named_parameters():
        for key, tensor in (("param", param.detach()), *((slot, optimizer.state[param][slot]) for slot in SLOTS)):
            if isinstance(tensor, DTensor):
                full, local = tensor.full_tensor(), tensor.to_local()
                coords = tensor.device_mesh.get_coordinate()
                piece = f"{name}@" + ".".join(f"{d}:{coords[d]}" for d, p in enumerate(tensor.placements)
                                               if p.is_shard())
            else:
                full, local, piece = tensor, tensor, name
            if dist.get_rank() == 0:
                full_digests[f"{name}/{key}"] = _sha256(full)
            local_digests[f"{piece}/{key}"] = _sha256(local)
    return (full_digests if dist.get_rank() == 0 else None), local_digests


def _torch_round(bench: CheckpointBench, folder: Path, meshes) -> tuple[dict, dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    flat, hsdp = meshes
    model = _shard(build_reference(bench.config), flat)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = _step_batch(bench.config, bench.world)
    rank = dist.get_rank()
    model(inputs[rank:rank + 1], targets[rank:rank + 1]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    expected = _torch_state(model, optimizer)
    save: dict = {}
    with measured(save):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    dist.barrier()
    save["written_bytes"] = sum(f.stat().st_size for f in folder.iterdir()) if rank == 0 else 0
    save["written_bytes_rank"] = sum(f.stat().st_size for f in folder.glob(f"__{rank}_*.distcp"))
    del model, optimizer, model_sd, optim_sd

    model = _shard(build_reference(_other_weights(bench.config)), hsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter, load = {"bytes": 0}, {}
    with measured(load):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=_counting_reader(folder, counter))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load["read_bytes"] = counter["bytes"]
    del state, model_sd, optim_sd
    _check_same(expected, _torch_state(model, optimizer), f"torch DCP FSDP2 -> HSDP {tuple(hsdp.shape)}")
    del model, optimizer
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    return save, load


# -- the job ---------------------------------------------------------------------------------------------------

def _gathered(record: dict) -> list[dict]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    return every


def checkpoint_worker(bench: CheckpointBench) -> list[dict] | None:
    """Every round on this job's ranks; rank 0 returns the rows (others None). Leaves the job joined."""
    from par4d.bench.torch_peers import destroy_groups, peer_mesh

    join(distributed_env())
    torch.set_num_threads(threads_per_rank(bench.world))
    # one pair for every round: see peers_worker
    meshes = tuple(peer_mesh(kind, bench.world, bench.nproc, None) for kind in ("fsdp", "hsdp"))
    work = Path(bench.workdir)
    per_rank: dict[tuple[str, str], list[list[dict]]] = {key: [] for key in NAMES}
    for r in range(bench.repeats):
        for framework in ("par4d", "torch"):
            folder = work / f"{framework}-{r}"
            save, load = _par4d_round(bench, folder) if framework == "par4d" else _torch_round(bench, folder, meshes)
            per_rank[(framework, "save")].append(_gathered(save))
            per_rank[(framework, "load")].append(_gathered(load))
    for mesh in meshes:
        destroy_groups(mesh)
    return _rows(bench, per_rank) if dist.get_rank() == 0 else None


def launched_worker(bench: CheckpointBench) -> list[dict] | None:
    rows = checkpoint_worker(bench)
    dist.destroy_process_group()
    return rows


def _rows(bench: CheckpointBench, per_rank: dict[tuple[str, str], list[list[dict]]]) -> list[dict]:
    from par4d.bench.torch_peers import hsdp_shape

    replicate, shard = hsdp_shape(bench.nproc, None)
    sharding = {("par4d", "save"): _short(bench.grid_from), ("par4d", "load"): _short(bench.grid_to),
                ("torch", "save"): f"FSDP2 over {bench.world}",
                ("torch", "load"): f"HSDP {replicate} x {shard} (replicate x shard)"}
    model = {"n_layer": bench.config.n_layer, "n_embd": bench.config.n_embd, "n_head": bench.config.n_head,
             "seq_len": bench.config.block_size, "vocab_size": bench.config.vocab_size,
             "params": bench.config.num_params()}
    def slowest(repeats: list[list[dict]], field: str) -> list[float]:
        return [max(rank[field] for rank in ranks) for ranks in repeats]

    rows = []
    for (framework, op), repeats in per_rank.items():
        def median_of_slowest(field: str, repeats=repeats) -> float:
            return statistics.median(slowest(repeats, field))

        last = repeats[-1]
        row = {"framework": framework, "name": NAMES[(framework, op)], "op": op, "sharding": sharding[(framework, op)],
               "s_per_iter": median_of_slowest("seconds"), "seconds": slowest(repeats, "seconds"),
               "repeats": len(repeats),
               "peak_added_bytes": median_of_slowest("peak_added_bytes"),
               "resident_added_bytes": median_of_slowest("resident_added_bytes"),
               "anon_peak_added_bytes": median_of_slowest("anon_peak_added_bytes"),
               "file_peak_added_bytes": median_of_slowest("file_peak_added_bytes"),
               "rss_before_bytes": median_of_slowest("rss_before_bytes"),
               "rchar_bytes_max_rank": median_of_slowest("rchar_bytes"),
               "disk_read_bytes": sum(rank["disk_read_bytes"] for rank in last),
               "disk_write_bytes": sum(rank["disk_write_bytes"] for rank in last),
               "ranks": bench.world, "model": model}
        if op == "save":
            row.update(written_bytes=sum(rank["written_bytes"] for rank in last),
                       written_bytes_per_rank=[rank["written_bytes_rank"] for rank in last])
        else:
            row.update(read_bytes_per_rank=[rank["read_bytes"] for rank in last],
                       read_bytes_max_rank=max(rank["read_bytes"] for rank in last),
                       read_bytes=sum(rank["read_bytes"] for rank in last),
                       rchar_bytes_per_rank=[rank["rchar_bytes"] for rank in last])
            if framework == "par4d":
                row.update(verified_bytes_per_rank=[rank["verified_bytes"] for rank in last],
                           files_opened_per_rank=[rank["files_opened"] for rank in last],
                           grid_from=_short(bench.grid_from), grid_to=_short(bench.grid_to))
        rows.append(row)
    for row in rows:
        peer = next(r for r in rows if r["framework"] == "torch" and r["op"] == row["op"])
        row["ratio_to_torch"] = row["s_per_iter"] / peer["s_per_iter"]
    return rows


# -- the command -------------------------------------------------------------------------------------------------

def settings(args: argparse.Namespace, workdir: str) -> CheckpointBench:
    """The benchmark's settings from the CLI's arguments; every check that can fail, before any rank starts."""
    from par4d.models import GPT

    if args.nproc < 2 or args.nproc % 2:
        raise ValueError(f"--nproc {args.nproc}: HSDP's (2, nproc/2) mesh needs an even --nproc >= 2")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    grids = {}
    for flag, text in (("--from", args.grid_from), ("--to", args.grid_to)):
        try:
            grids[flag] = validate_sizes(parse_grid(text), args.nproc)
        except ValueError as error:
            raise ValueError(f"{flag} {text}: {error}") from None
    if grids["--from"] == grids["--to"]:
        raise ValueError(f"--from and --to are the same grid ({_short(grids['--from'])}): a load there does not "
                         f"reshard")
    config = TrainConfig(grid=grids["--from"], out=None, n_layer=args.n_layer, n_embd=args.n_embd,
                         n_head=args.n_head).model_config()
    for flag, sizes in grids.items():
        try:
            GPT(config, grid=Grid.virtual(sizes))      # shape errors, on the meta device
        except ValueError as error:
            raise ValueError(f"{flag} {_short(sizes)}: {error}") from None
    return CheckpointBench(config, grids["--from"], grids["--to"], args.repeats, workdir, args.nproc)


def markdown(rows: list[dict]) -> str:
    def mb(value) -> str:
        return "" if value is None else f"{value / 1e6:,.1f}"

    lines = ["| row | sharding | s (median) | x torch | MB written (all ranks) | MB read per rank | "
             "MB read() per rank | peak MB added | of it anon (sampled) | MB resident after |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['sharding']} | {r['s_per_iter']:.3f} | {r['ratio_to_torch']:.2f} | "
                     f"{mb(r.get('written_bytes'))} | {mb(r.get('read_bytes_max_rank'))} | "
                     f"{mb(r['rchar_bytes_max_rank'])} | {mb(r['peak_added_bytes'])} | "
                     f"{mb(r['anon_peak_added_bytes'])} | {mb(r['resident_added_bytes'])} |")
    return "\n".join(lines)


def run_bench_checkpoint(args: argparse.Namespace) -> int:
    parent = getattr(args, "workdir", None)
    if parent is not None and not Path(parent).is_dir():
        raise ValueError(f"--workdir {parent} is not a folder")
    bench = settings(args, "")
    workdir = tempfile.mkdtemp(prefix="par4d-bench-checkpoint-", dir=parent)
    try:
        bench = CheckpointBench(bench.config, bench.grid_from, bench.grid_to, bench.repeats, workdir, bench.nproc)
        rows = launch(launched_worker, (bench,), args.nproc, None, "", "par4d-bench-checkpoint")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if emit(rows, args.out, args.json):
        sys.stdout.flush()
        return 0
    config = bench.config
    print(f"GPT {config.n_layer} layers x {config.n_embd} wide, {config.n_head} heads, seq {config.block_size}: "
          f"{config.num_params():,} params, fp32, AdamW; {where(args.nproc, None, '')}; "
          f"median of {bench.repeats} repeats of the slowest rank")
    print(markdown(rows))
    by = {(r["framework"], r["op"]): r for r in rows}
    for op in ("save", "load"):
        ours, peer = by[("par4d", op)], by[("torch", op)]
        print(f"{op}: par4d {ours['s_per_iter']:.3f} s, torch DCP {peer['s_per_iter']:.3f} s: "
              f"par4d/torch = {ours['ratio_to_torch']:.2f}")
    print("every load checked: all parameters and AdamW tensors equal the saved ones bit for bit")
    sys.stdout.flush()
    return 0


__all__ = ["CheckpointBench", "checkpoint_worker", "markdown", "run_bench_checkpoint", "settings"]
