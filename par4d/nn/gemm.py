"""GEMM tuning (the 4D paper's "automated tuning of BLAS kernels").

``C = A B`` can be handed to BLAS in equivalent forms that differ in operand order
and layout. For each (pass, shape) a :class:`GemmPlan` times the forms once, keeps
the fastest, and makes the choice identical on every rank of the grid (the summed
times over all ranks decide). Choices persist in a JSON cache keyed by device, dtype
and library versions, so a later run reuses them without timing. The plan's own
collectives go through :mod:`par4d.comm`, so the grid's ledger records them too.
:func:`par4d.nn.linear.tune` gives a plan to every Linear of a model.

Forms of ``a @ b`` (a: m x k, b: k x n):
    0  a @ b                      (as given)
    1  (b^T @ a^T)^T              (operands swapped: BLAS computes C^T)
    2  a @ contiguous(b)          (b copied to row-major first)
    3  contiguous(a) @ b
"""

from __future__ import annotations

import json
import statistics
import time
import zlib
from pathlib import Path
from typing import Protocol

import torch

from par4d import comm
from par4d.grid import AXES, Grid

FORMS = ("a@b", "(bT@aT)T", "a@contig(b)", "contig(a)@b")


def apply(form: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if form == 0:
        return a @ b
    if form == 1:
        return (b.t() @ a.t()).t()
    if form == 2:
        return a @ b.contiguous()
    if form == 3:
        return a.contiguous() @ b
    raise ValueError(f"unknown GEMM form {form}")


def distinct_forms(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """The forms that differ from ``a @ b`` for these layouts (copying an operand that
    is already contiguous is the default form again, and is not timed)."""
    forms = [0, 1]
    if not b.is_contiguous():
        forms.append(2)
    if not a.is_contiguous():
        forms.append(3)
    return forms


def _key(a: torch.Tensor, b: torch.Tensor, name: str) -> str:
    def layout(t):
        return "N" if t.stride(-1) == 1 else "T"

    return f"{name}:{a.shape[0]}x{a.shape[1]}x{b.shape[1]}:{layout(a)}{layout(b)}"


def environment_key(device: torch.device, dtype: torch.dtype, grid: Grid | None = None) -> str:
    """Device, dtype, torch version and threads; with a ``grid``, rank 0's thread count
    stands for all (ranks must look up the same keys)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    threads = torch.tensor([torch.get_num_threads()], device=grid.device if grid is not None else "cpu")
    if grid is not None:
        comm.broadcast(grid, threads, *AXES)
    return f"{name}|{dtype}|torch {torch.__version__}|threads {int(threads)}"


class LocalGemms(Protocol):
    """What a Linear asks of a plan for its three local GEMMs (``Linear.gemm``): this plan's, or float8's
    (par4d.nn.float8.Float8Gemm)."""

    whole_rows: bool    # the GEMMs must see all their rows at once (else the xy overlap may cut them in runs)

    def mm(self, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor: ...


class GemmPlan:
    """Chosen GEMM forms per (pass, shape, layout); see the module docstring."""

    whole_rows = False      # a GEMM may run in runs of rows (the xy overlap's chunks)

    def __init__(self, cache: str | Path | None = None, repeats: int = 5, grid: Grid | None = None):
        """``grid``: agree with every rank of it — sum the timings over all ranks so every
        rank picks the same form (a collective per new key: every rank must meet the same
        keys in the same order, as SPMD training does). None: this process alone."""
        self.grid, self.repeats = grid, repeats
        self.cache = Path(cache) if cache else None
        self.choices: dict[str, dict[str, int]] = {}
        self.timings: dict[str, list[float]] = {}
        self._envs: dict[tuple, str] = {}
        if self.cache and self.cache.is_file():
            self.choices = json.loads(self.cache.read_text())
        if grid is not None:
            # Rank 0's cache is everyone's, so no rank tunes (a collective) alone.
            self.choices = json.loads(_broadcast_text(grid, json.dumps(self.choices)))

    def mm(self, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
        """``a @ b`` in the chosen form (timing the forms the first time a key is seen;
        with ``agree``, every rank must then meet the same key at the same point)."""
        env = self._envs.get((a.device, a.dtype))
        if env is None:   # once per device and dtype (a broadcast with agree)
            env = self._envs[(a.device, a.dtype)] = environment_key(a.device, a.dtype, self.grid)
        key = _key(a, b, name)
        table = self.choices.setdefault(env, {})
        if key not in table:
            table[key] = self._tune(a, b, key)
            self._save()
        return apply(table[key], a, b)

    def _tune(self, a: torch.Tensor, b: torch.Tensor, key: str) -> int:
        seconds = []
        for form in range(len(FORMS)):
            if form not in distinct_forms(a, b):
                seconds.append(float("inf"))
                continue
            apply(form, a, b).contiguous()  # warm-up; timed as used: contiguous
            runs = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                apply(form, a, b).contiguous()
                if a.device.type == "cuda":
                    torch.cuda.synchronize()
                runs.append(time.perf_counter() - start)
            seconds.append(statistics.median(runs))
        total = torch.tensor(seconds, dtype=torch.float64)
        if self.grid is not None:
            # Every rank must be timing the same matmul: compare the key's checksum.
            checksum = zlib.crc32(key.encode())
            extremes = torch.tensor([checksum, -checksum], dtype=torch.int64, device=self.grid.device)
            comm.all_reduce(self.grid, extremes, *AXES, op=torch.distributed.ReduceOp.MAX)
            if extremes[0] != -extremes[1]:
                raise RuntimeError(f"GEMM tuning: ranks met different matmuls at the same point (this rank: {key})")
            total = comm.all_reduce(self.grid, total.to(self.grid.device), *AXES).cpu()   # one decision for all
        self.timings[key] = total.tolist()
        return int(torch.argmin(total))

    def _save(self) -> None:
        if self.cache is None or (self.grid is not None and self.grid.rank != 0):
            return
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.choices, indent=1, sort_keys=True))
        tmp.replace(self.cache)


def _broadcast_text(grid: Grid, text: str) -> str:
    """Rank 0's ``text`` on every rank of ``grid`` (its length first, then its bytes)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=grid.device)
    length = comm.broadcast(grid, torch.tensor([data.numel()], device=grid.device), *AXES)
    if grid.rank != 0:
        data = torch.zeros(int(length), dtype=torch.uint8, device=grid.device)
    return bytes(comm.broadcast(grid, data, *AXES).tolist()).decode()
