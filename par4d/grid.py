"""The 4D (+pipe) process grid: sizes, coordinates and process groups.

Rank layout, innermost first (DESIGN §1)::

    rank = (((pipe * G_data + data) * G_z + z) * G_y + y) * G_x + x

so ``x`` varies fastest. Single-axis groups come from torch's DeviceMesh; groups
spanning several axes (e.g. ``("z", "data")`` for gradient sync) are built once at
construction, collectively, so nothing is created lazily behind a user's back.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from par4d.comm import Ledger

if TYPE_CHECKING:
    from par4d.nn.gemm import GemmPlan

AXES: tuple[str, ...] = ("x", "y", "z", "data", "pipe")
"""Axis names, innermost first. The only names par4d accepts for grid axes."""

# Multi-axis groups built at construction (each a tuple in AXES order).
_COMBINED: tuple[tuple[str, ...], ...] = (("z", "data"), ("x", "y", "z"))


def _check_axes(axes: Iterable[str]) -> tuple[str, ...]:
    axes = tuple(axes)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown grid axis {unknown[0]!r}; valid axes are {', '.join(AXES)}")
    return tuple(a for a in AXES if a in axes)


def parse_grid(text: str) -> dict[str, int]:
    """Parse ``"x=2,z=2"`` into ``{"x": 2, "z": 2}``; unknown axes raise ``ValueError``."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, sep, value = item.partition("=")
        axis = axis.strip()
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"grid entry {item!r} is not of the form axis=size (e.g. x=2,z=2)")
        if axis in sizes:
            raise ValueError(f"grid axis {axis!r} given twice in {text!r}")
        sizes[axis] = int(value)
    _check_axes(sizes)
    return sizes


def validate_sizes(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Check a grid shape against a world size; return it completed with 1s.

    Raises ``ValueError`` naming the numbers. Pure: no collective, so every rank
    raises the same error before any communication starts.
    """
    _check_axes(sizes)
    full = {a: 1 for a in AXES}
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"grid axis {axis}={size!r} must be an integer >= 1")
        full[axis] = size
    product = math.prod(full.values())
    if product != world_size:
        shape = " * ".join(f"{a}={full[a]}" for a in AXES)
        raise ValueError(
            f"grid {shape} = {product} ranks, but the job has world size {world_size}; "
            f"the product of the axis sizes must equal the world size"
        )
    return full


@dataclass(eq=False)
class Grid:
    """A validated grid over the current torch.distributed job.

    Build it with :func:`par4d.init`. ``size(axis)``, ``coord(axis)`` and
    ``group(*axes)`` answer for this rank; ``ledger`` records every collective
    par4d issues on this grid.
    """

    sizes: dict[str, int]
    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    ledger: Ledger = field(default_factory=Ledger)
    gemm: GemmPlan | None = None   # set to tune the matmuls of this grid's layers (par4d.nn.gemm)
    _groups: dict[tuple[str, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _closed: bool = field(default=False, repr=False)

    def size(self, *axes: str) -> int:
        """Number of ranks along the given axes (their product)."""
        return math.prod(self.sizes[a] for a in _check_axes(axes))

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return coords_of(self.rank, self.sizes)[_check_axes((axis,))[0]]

    @classmethod
    def virtual(cls, sizes: dict[str, int], rank: int = 0) -> Grid:
        """A grid with no job behind it (meta device, no groups): for validating a
        model against a shape, or planning, before any process is started."""
        full = validate_sizes(sizes, math.prod(sizes.values()))
        return cls(sizes=full, rank=rank, device=torch.device("meta"), mesh=None)

    def group(self, *axes: str) -> dist.ProcessGroup:
        """Process group of the ranks that differ from this one only along ``axes``."""
        key = _check_axes(axes)
        if self.mesh is None:
            state = "closed" if self._closed else "virtual"
            raise RuntimeError(f"{self!r} is {state}: it has no process groups")
        if key not in self._groups:
            raise ValueError(f"no process group for axes {key}; available: {sorted(self._groups)}")
        return self._groups[key]

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of ``group(*axes)``, in axis order (innermost fastest)."""
        key = _check_axes(axes)
        mine = coords_of(self.rank, self.sizes)
        ranges = [range(self.sizes[a]) if a in key else [mine[a]] for a in AXES]
        ranks = [rank_of(dict(zip(reversed(AXES), c)), self.sizes) for c in itertools.product(*reversed(ranges))]
        return ranks

    def close(self) -> None:
        """Destroy the process groups this grid made; the job's default group stays.

        Idle gloo groups are not free: with 19 grids' groups alive in one job of 8
        CPU ranks, a training step ran 1.5x slower and switched context 16x more
        often than with its own groups only. Call this on every rank, after the
        grid's last collective, before building another grid in the same job; the
        grid cannot communicate afterwards.
        """
        if self.mesh is None:
            return
        if dist.is_initialized():
            world = dist.group.WORLD
            for group in {id(g): g for g in self._groups.values()}.values():
                if group is world:
                    continue
                try:
                    dist.destroy_process_group(group)
                except ValueError:    # gone already: the job was left (destroy_process_group()) since
                    pass
        self._groups.clear()
        self.mesh, self._closed = None, True

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    def describe(self) -> str:
        return " ".join(f"{a}={self.sizes[a]}" for a in AXES)

    def __repr__(self) -> str:
        return f"Grid({self.describe()}, rank={self.rank})"


def coords_of(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank`` in a grid of ``sizes`` (DESIGN §1 layout)."""
    coords = {}
    for axis in AXES:
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """Inverse of :func:`coords_of`."""
    rank = 0
    for axis in reversed(AXES):
        rank = rank * sizes[axis] + coords[axis]
    return rank


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_JOB: dict = {}   # the env:// store, this rank, the world size, and how often this process joined


def _join_or_init_job() -> None:
    """Join the torch.distributed job of the environment (torchrun, srun, par4d's
    launcher), or start a one-rank job when there is none."""
    if dist.is_initialized():
        return
    from par4d.launch import distributed_env, free_port

    env = distributed_env()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if env is None:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return
    # env:// lets torchrun's workers reuse the agent's store; srun's variables are
    # translated to the same names first.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    timeout = timedelta(minutes=10)
    if "store" not in _JOB:
        _JOB["store"], _JOB["rank"], _JOB["world"] = next(dist.rendezvous("env://", timeout=timeout))
        _JOB["joins"] = 0
        # Release the store while the interpreter is whole, not in its final teardown
        # (the likely cause of one rank aborting at exit in CI: "terminate called").
        atexit.register(_JOB.clear)
    # destroy_process_group() restarts torch's group numbering, so joining again on
    # the same store would read the previous join's keys and connect to stale peers
    # (pytorch/pytorch#55967): every join gets its own key prefix. The store is kept
    # so a second join needs no new server and cannot race for the port.
    _JOB["joins"] += 1
    store = dist.PrefixStore(f"par4d/join{_JOB['joins']}", _JOB["store"])
    dist.init_process_group(backend, store=store, rank=_JOB["rank"], world_size=_JOB["world"], timeout=timeout)


def init(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1) -> Grid:
    """Build the grid ``x * y * z * data * pipe`` over the current job.

    Joins an existing torch.distributed job or initializes one from the
    environment (torchrun, srun, or par4d's launcher): gloo on CPU, NCCL where CUDA
    is present. The shape is validated on every rank before any collective.
    """
    requested = {"x": x, "y": y, "z": z, "data": data, "pipe": pipe}
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        from par4d.launch import distributed_env

        env = distributed_env()
        world = env.world_size if env is not None else 1
    sizes = validate_sizes(requested, world)
    _join_or_init_job()
    _check_same_on_every_rank(sizes)
    return _build(sizes)


def _check_same_on_every_rank(sizes: dict[str, int]) -> None:
    """Ranks that ask for different grids would build mismatched groups and hang."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sizes)
    if any(other != sizes for other in every):
        shapes = {}
        for rank, other in enumerate(every):
            shapes.setdefault(" ".join(f"{a}={other[a]}" for a in AXES), []).append(rank)
        listing = "; ".join(f"ranks {ranks}: {shape}" for shape, ranks in shapes.items())
        raise ValueError(f"ranks asked par4d.init for different grids ({listing})")


def _build(sizes: dict[str, int]) -> Grid:
    device = _device()
    names = tuple(reversed(AXES))  # outermost first: pipe, data, z, y, x
    mesh = init_device_mesh(device.type, tuple(sizes[a] for a in names), mesh_dim_names=names)
    grid = Grid(sizes=sizes, rank=dist.get_rank(), device=device, mesh=mesh)
    for axis in AXES:
        grid._groups[(axis,)] = mesh.get_group(axis)
    for combo in _COMBINED:
        grid._groups[combo] = _combined_group(grid, combo)
    return grid


def _combined_group(grid: Grid, axes: tuple[str, ...]) -> dist.ProcessGroup:
    others = [a for a in AXES if a not in axes]
    enumeration = []
    for fixed in itertools.product(*(range(grid.sizes[a]) for a in others)):
        base = dict(zip(others, fixed))
        members = []
        for varying in itertools.product(*(range(grid.sizes[a]) for a in reversed(axes))):
            coords = dict(base, **dict(zip(reversed(axes), varying)))
            members.append(rank_of(coords, grid.sizes))
        enumeration.append(sorted(members))
    group, _ = dist.new_subgroups_by_enumeration(enumeration)
    return group
