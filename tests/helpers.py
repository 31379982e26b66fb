"""What several test files share: `par4d train` run in a subprocess, on a pool's ranks or in this process,
and its run folder read; a BPE tokenizer trained on the spot; the planner's search against brute force; the
ids of parametrized grids. What runs inside the pool's ranks on a grid is tests/cases.py's.

Nothing here imports torch at import time (the functions that need it import it when called)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from par4d.overlap import NAMES, Overlap
from par4d.plan import Machine, predict
from par4d.plan.cost import communication, factorizations
from par4d.plan.search import Space, _Grid, search, search_top


def grid_id(sizes: dict) -> str:
    """A test id for a grid of every axis: ``dict(x=2, y=1, z=2, data=1)`` -> ``x2y1z2d1``."""
    return "x{x}y{y}z{z}d{data}".format(**sizes)


def sizes_id(sizes: dict) -> str:
    """A test id for the axes a grid names: ``dict(x=2, z=2)`` -> ``x2-z2``."""
    return "-".join(f"{k}{v}" for k, v in sizes.items())


# `par4d train`: the smallest GPT, whatever the grid.
SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "16",
         "--no-progress", "--peak-flops", "1e11"]   # (no half second measuring the peak for every run)


def train_subprocess(*args: str, timeout: float = 240, env_extra: dict | None = None,
                     status: int = 0) -> subprocess.CompletedProcess:
    """`par4d train ARGS` in a process of its own (its ranks launched by it), one thread a rank; its exit
    status must be ``status``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    result = subprocess.run([sys.executable, "-m", "par4d.cli", "train", *args], capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == status, result.stderr[-3000:]
    return result


def run_losses(run: Path) -> list[float]:
    """Every step's loss of a run folder, from its metrics.jsonl."""
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checked_config(*args: str, world: int):
    """The config `par4d train ARGS` launches, checked as the CLI checks it (without measuring the peak)."""
    from dataclasses import replace

    from par4d.cli import _parser
    from par4d.cli.configure import configure

    return replace(configure(_parser().parse_args(["train", *args]), world, inside=False), peak_flops=1.0)


def train_in_pool(config):
    """`par4d train`'s loop on a pool's rank (its worker would leave the pool's job when done). One thread
    per rank, as par4d's launcher gives 4 ranks on 2 cores: the loop, seeing no launcher, would take every
    core in each rank."""
    from unittest import mock

    from par4d.train.loop import run
    from par4d.train.stop import StopRequest

    with mock.patch("par4d.train.loop._threads_per_rank", return_value=1), StopRequest() as stop:
        return run(config, stop)


def train_alone(config) -> None:
    """`par4d train` as one rank in this process (its summary printed), the test's thread count kept."""
    import torch

    from par4d.cli.train import _finish
    from par4d.train.loop import worker

    threads = torch.get_num_threads()
    try:
        assert _finish(worker(config)) == 0
    finally:
        torch.set_num_threads(threads)


def train_pooled(pool, *args: str) -> dict:
    """`par4d train ARGS` on the pool's ranks, its summary printed here as the CLI prints it; rank 0's summary."""
    from par4d.cli.train import _finish

    summary = pool.run(train_in_pool, checked_config(*args, world=pool.world), timeout=240)[0]
    assert _finish(summary) == 0
    return summary


# Text to train a tokenizer on and to prepare: 300 paragraphs of a 50-word vocabulary.
PARAGRAPHS = [f"Paragraph {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(5 + i % 9)) for i in range(300)]


def bpe_tokenizer(folder: Path, vocab: int = 300) -> Path:
    """A byte-level BPE tokenizer trained here on PARAGRAPHS (no download), saved as FOLDER/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PARAGRAPHS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


# Memory tight enough that microbatches, recomputation and the overlap sets decide what fits.
TIGHT = Machine("tight", devices_per_node=4, peak_flops=1e9, memory_bytes=1.2e6, beta_intra=1e9, beta_inter=1e8,
                latency=1e-5, latency_inter=5e-5, bytes_per_element=2)


def brute_force(spec, world, machine):
    """Every grid's fastest fitting choice over every microbatch count, recomputation and every
    subset of the overlap switches (those that act: a pipeline runs without OAG, ORS and dp)."""
    best = {}
    subsets = [Overlap.parse(",".join(names)) if names else Overlap.none()
               for r in range(len(NAMES) + 1) for names in itertools.combinations(NAMES, r)]
    for sizes in factorizations(world, tuple(range(1, spec.n_layer + 1))):
        if spec.check(sizes) or sizes["pipe"] > spec.n_layer:
            continue
        shard = spec.global_batch // (sizes["z"] * sizes["data"])
        for micro in (m for m in range(1, shard + 1) if shard % m == 0):
            # Computed afresh at each count (not the search's two-count interpolation), once for the choices
            # that share it: predict computes the same without terms (the suite 15 s shorter).
            terms = communication(spec, sizes, machine, "full", micro)
            for checkpointing, overlap in itertools.product((False, True), subsets):
                if sizes["pipe"] > 1:           # what acts in a pipeline (TrainConfig.overlap_run)
                    overlap = overlap.in_pipeline()
                pred = predict(spec, sizes, machine, "full", checkpointing,
                               overlap=overlap if overlap.names else None, microbatches=micro, terms=terms)
                key = tuple(sizes.values())
                if pred.fits and (key not in best or pred.t_iter < best[key]):
                    best[key] = pred.t_iter
    return best


def check_the_top_and_its_floors(spec, world, machine, fastest: dict | None = None, space: Space | None = None) -> None:
    """search_top skips a grid where its floors say no choice on it is faster than the top found: on every grid
    both floors are under brute force's fastest choice (``fastest``; else the search's own, in ``space``), and
    search_top's rows are search's first."""
    space = space or Space()
    ranked, excluded = search(spec, world, machine, space)
    if fastest is None:
        fastest = {tuple(p.sizes.values()): p.t_iter for p in ranked}
    recompute = (False, True) if space.checkpointing is None else (space.checkpointing,)
    pipes = (space.pipe,) if space.pipe else tuple(range(1, spec.n_layer + 1))
    for sizes in factorizations(world, pipes):
        key = tuple(sizes.values())
        if key in fastest:
            grid = _Grid(spec, sizes, machine, space, recompute)
            assert grid.compute_floor() <= grid.floor() <= fastest[key] * (1 + 1e-12), (sizes, machine.name)
    for top in (1, 3, len(ranked)):
        first, left_out, fitting = search_top(spec, world, machine, space, top=top)
        assert [p.row() for p in first] == [p.row() for p in ranked[:top]]
        assert [p.row() for p in left_out] == [p.row() for p in excluded] and fitting == len(ranked)
