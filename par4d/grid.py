"""The process grid: axis names, sizes, coordinates and process groups.

Rank layout, innermost first (docs/architecture.md, "The grid")::

    rank = ((((pipe * G_data + data) * G_context + context) * G_z + z) * G_y + y) * G_x + x

so ``x`` varies fastest; ``context`` (each sequence cut over its ranks) sits inside ``data``, where its
ring's transfers stay close, and at size 1 changes no rank's place. Single-axis groups come from torch's
DeviceMesh; groups spanning several axes (e.g. ``("z", "data")`` for gradient sync) are built once at
construction, collectively, so nothing is created lazily behind a user's back.
Joining the job is :mod:`par4d.launch`'s work; a Grid is built over a job already joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from par4d.hierarchy import STAGE_MIN_BYTES, Split, check_mode, split
from par4d.ledger import Ledger


class Axis(str, Enum):
    """The grid axes, innermost first: the only names par4d accepts for them."""

    X = "x"
    Y = "y"
    Z = "z"
    CONTEXT = "context"
    DATA = "data"
    PIPE = "pipe"

    def __str__(self) -> str:
        return self.value


AXES: tuple[str, ...] = tuple(a.value for a in Axis)
"""Axis names, innermost first."""

SHOWN_ABOVE_ONE = ("context",)
"""Axes a grid's description names only where they are > 1 (after the five of the papers' grids)."""

TENSOR_AXES: tuple[str, ...] = ("x", "y", "z")
"""The axes of the 3D tensor-parallel grid inside one data replica."""

FOLDED: dict[str, str] = {"expert": "data"}
"""Axes folded over the ranks of another, adding none: ``expert`` spreads a mixture's experts over the
ranks of ``data`` (E consecutive data coordinates hold every expert between them; docs/architecture.md,
"Experts"). A folded axis is in a grid's sizes only where it was given."""

# Multi-axis groups built at construction (each a tuple in AXES order).
_COMBINED: tuple[tuple[str, ...], ...] = (("z", "data"), ("x", "y", "z"))
# ... and with a context axis: what gradients and a batch's statistics are summed over
_WITH_CONTEXT: tuple[tuple[str, ...], ...] = (("z", "context"), ("context", "data"), ("z", "context", "data"))
SHARING = ("x", "y", "z", "context")    # a pipeline stage's ranks that share attention's collectives
STAGE = ("x", "y", "z", "context", "data")     # every rank of a pipeline stage (built on grids with pipe > 1)


def _in_order(axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in (*AXES, *FOLDED) if a in axes)


# Every tuple of up to three distinct axes, in any order, to the same axes in order: a layer asks the grid's sizes
# along its axes several times a step (0.1 us looked up here, 0.6 us sorted by the loop below).
_ORDERED: types.MappingProxyType = types.MappingProxyType({
    axes: _in_order(axes) for n in range(1, 4) for axes in itertools.permutations((*AXES, *FOLDED), n)})


def check_axes(axes: Iterable[str]) -> tuple[str, ...]:
    """``axes`` in AXES order, then the folded ones; an unknown name raises ``ValueError`` listing the valid ones."""
    # Loops, not comprehensions: on Python 3.11 each comprehension is a frame of its own, which dynamo compiles
    # apart (and again for every new tuple of axes) where a compiled block calls this eagerly (par4d.compiled).
    axes = tuple(axes)
    ordered = _ORDERED.get(axes)
    if ordered is not None:
        return ordered
    for axis in axes:
        if axis not in AXES and axis not in FOLDED:
            named = [a for a in AXES if a not in SHOWN_ABOVE_ONE] + [*FOLDED, *SHOWN_ABOVE_ONE]
            raise ValueError(f"unknown grid axis {axis!r}; valid axes are {', '.join(named)}")
    ordered = []
    for axis in (*AXES, *FOLDED):
        if axis in axes:
            ordered.append(axis)
    return tuple(ordered)


def world_of(sizes: dict[str, int]) -> int:
    """The ranks a grid of ``sizes`` has: the product of its axes, a folded one adding none."""
    return math.prod(n for a, n in sizes.items() if a not in FOLDED)


def parse_grid(text: str) -> dict[str, int]:
    """Parse ``"x=2,z=2"`` into ``{"x": 2, "z": 2}``; unknown axes and sizes below 1 raise ``ValueError``."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, sep, value = item.partition("=")
        axis = axis.strip()
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"grid entry {item!r} is not of the form axis=size (e.g. x=2,z=2)")
        if axis in sizes:
            raise ValueError(f"grid axis {axis!r} given twice in {text!r}")
        sizes[axis] = int(value)
    check_axes(sizes)
    small = {axis: n for axis, n in sizes.items() if n < 1}
    if small:        # else the world it multiplies to (0, or negative) is what the user reads about
        axis, n = next(iter(small.items()))
        raise ValueError(f"grid axis {axis}={n} in {text!r}: every axis size must be >= 1 (leave an axis out for 1)")
    return sizes


class Indivisible(ValueError):
    """A size that the grid's axes do not divide (a layer's features or channels, a vocabulary): the
    layer cannot be cut there. ``par4d.parallelize`` keeps such a layer whole instead."""


def validate_sizes(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Check a grid shape against a world size; return it completed with 1s.

    Raises ``ValueError`` naming the numbers. Pure: no collective, so every rank
    raises the same error before any communication starts.
    """
    check_axes(sizes)
    full = {a: 1 for a in AXES}
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"grid axis {axis}={size!r} must be an integer >= 1")
        full[axis] = size
    for axis, host in FOLDED.items():
        if full.get(axis, 1) > 1 and full[host] % full[axis]:
            raise ValueError(f"grid axis {axis}={full[axis]} folds over {host}={full[host]}, which it does not "
                             f"divide: give {host} a multiple of {full[axis]} ({axis} spreads over {host}'s ranks)")
    product = world_of(full)
    if product != world_size:
        shape = " * ".join(f"{a}={full[a]}" for a in AXES if a not in SHOWN_ABOVE_ONE or full[a] > 1)
        raise ValueError(
            f"grid {shape} = {product} ranks, but the job has world size {world_size}; "
            f"the product of the axis sizes must equal the world size"
        )
    for axis in SHOWN_ABOVE_ONE:       # in a grid's sizes only where > 1: a grid without it is the grid it was
        if full[axis] == 1:
            del full[axis]
    return full


def describe(sizes: dict[str, int]) -> str:
    """``"x=2 y=1 z=2 data=1 pipe=1"``: every axis, in AXES order (context, and then a folded one, only where
    it is > 1)."""
    folded = [f"{a}={sizes[a]}" for a in FOLDED if sizes.get(a, 1) > 1]
    return " ".join([*(f"{a}={sizes.get(a, 1)}" for a in AXES if a not in SHOWN_ABOVE_ONE or sizes.get(a, 1) > 1),
                     *folded])


def coords_of(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank`` in a grid of ``sizes`` (the layout above)."""
    coords = {}
    for axis in AXES:
        coords[axis] = rank % sizes.get(axis, 1)
        rank //= sizes.get(axis, 1)
    for axis, host in FOLDED.items():      # the innermost factor of its host: consecutive host coordinates
        if axis in sizes:
            coords[axis] = coords[host] % sizes[axis]
    return coords


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """Inverse of :func:`coords_of`."""
    rank = 0
    for axis in reversed(AXES):
        rank = rank * sizes.get(axis, 1) + coords.get(axis, 0)
    return rank


@dataclass(eq=False)
class Grid:
    """A validated grid over the current torch.distributed job.

    Build it with :func:`par4d.init`. ``size(axis)``, ``coord(axis)`` and
    ``group(*axes)`` answer for this rank; ``ledger`` records every collective
    par4d issues on this grid. A model's policies (overlap, precision) are the model's, not the grid's.
    ``nodes``: each rank's node (None: not known, every collective flat); ``hierarchical``: which
    collectives go in stages over groups that span nodes (par4d.hierarchy.MODES).
    """

    sizes: dict[str, int]
    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    ledger: Ledger = field(default_factory=Ledger)
    nodes: tuple[int, ...] | None = None
    hierarchical: str = "auto"
    _groups: dict[tuple[str, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _within: dict[tuple[tuple[str, ...], str], dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _stages: dict[tuple[str, ...], Stages] = field(default_factory=dict, repr=False)
    _stager: object | None = field(default=None, repr=False)      # par4d.staged's lanes, made on first use
    _closed: bool = field(default=False, repr=False)

    def size(self, *axes: str, within: str | None = None) -> int:
        """Number of ranks along the given axes (their product); ``within`` a folded axis: those of them
        that share this rank's coordinate on it (the data ranks holding the same experts)."""
        size = 1
        for axis in check_axes(axes):        # a loop, not math.prod over a generator: dynamo traces it (--compile)
            size *= self.sizes.get(axis, 1)
        return size // self.size(within) if within is not None and FOLDED[within] in axes else size

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return coords_of(self.rank, self.sizes).get(check_axes((axis,))[0], 0)

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis, the folded ones (``expert``) included."""
        return {a: self.coord(a) for a in (*AXES, *FOLDED)}

    @classmethod
    def virtual(cls, sizes: dict[str, int], rank: int = 0) -> Grid:
        """A grid with no job behind it (meta device, no groups): for validating a
        model against a shape, or planning, before any process is started."""
        full = validate_sizes(sizes, world_of(sizes))
        return cls(sizes=full, rank=rank, device=torch.device("meta"), mesh=None)

    def group(self, *axes: str, within: str | None = None) -> dist.ProcessGroup:
        """Process group of the ranks that differ from this one only along ``axes``; ``within`` a folded
        axis: only those that share this rank's coordinate on it (built where it is > 1)."""
        key = check_axes(axes)
        if within is not None:
            if (key, within) not in self._within:
                raise ValueError(f"no process group for axes {key} within {within}; available: {sorted(self._within)}")
            return self._within[(key, within)]
        if self.mesh is None:
            state = "closed" if self._closed else "virtual"
            raise RuntimeError(f"{self!r} is {state}: it has no process groups")
        if key == AXES or key == tuple(a for a in AXES if a not in SHOWN_ABOVE_ONE or self.size(a) > 1):
            return dist.group.WORLD         # every axis (as comm names them): the whole job
        if key not in self._groups:
            raise ValueError(f"no process group for axes {key}; available: {sorted(self._groups)}")
        return self._groups[key]

    def stages(self, axes: tuple[str, ...], nbytes: int) -> Stages | None:
        """How a collective of ``nbytes`` per rank over ``axes`` goes in stages, or None: flat (the
        group is inside one node, ``hierarchical`` is off, or, under auto, the message is small)."""
        if self.hierarchical == "off":
            return None
        found = self._stages.get(check_axes(axes))
        if found is None or (self.hierarchical == "auto" and (nbytes < STAGE_MIN_BYTES or not found.pays)):
            return None
        return found

    def stage_candidates(self) -> list[tuple[tuple[str, ...], Stages]]:
        """Every set of axes whose group spans nodes, with its stages, whether or not staging pays yet."""
        return sorted(self._stages.items())

    def set_staging(self, axes: tuple[str, ...], pays: bool) -> None:
        """Whether staging ``axes``' collectives pays on this job (``par4d.init``'s probe decides under auto)."""
        key = check_axes(axes)
        self._stages[key] = dataclasses.replace(self._stages[key], pays=pays)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Collectives issued inside go to a ledger of their own, not the grid's (a probe nobody asked for)."""
        ledger, self.ledger = self.ledger, Ledger()
        try:
            yield
        finally:
            self.ledger = ledger

    def staged_axes(self) -> list[tuple[str, ...]]:
        """The sets of axes whose collectives may go in stages (their groups span nodes, and under auto
        staging measured faster)."""
        if self.hierarchical == "off":
            return []
        return sorted(k for k, st in self._stages.items() if st.pays or self.hierarchical == "on")

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of ``group(*axes)``, in axis order (innermost fastest)."""
        key = check_axes(axes)
        folded = [a for a in key if a in FOLDED]
        if folded:
            if len(key) > 1:
                raise ValueError(f"no group of {key}: a folded axis ({folded[0]}) forms groups of its own only")
            return next(g for g in folded_groups(self.sizes, key[0]) if self.rank in g) \
                if self.sizes.get(key[0], 1) > 1 else [self.rank]
        mine = coords_of(self.rank, self.sizes)
        ranges = [range(self.sizes.get(a, 1)) if a in key else [mine[a]] for a in AXES]
        return [rank_of(dict(zip(reversed(AXES), c)), self.sizes) for c in itertools.product(*reversed(ranges))]

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
        stuck = False
        if self._stager is not None:
            stuck = not self._stager.close()     # a lane still inside a collective (a peer gone): its groups stay
            self._stager = None
        if dist.is_initialized():
            world = dist.group.WORLD
            staged = [] if stuck else [g for st in self._stages.values() for g in (st.node, st.link, st.node_out)]
            for group in {id(g): g for g in [*self._groups.values(), *self._within.values(), *staged]}.values():
                if group is world:
                    continue
                try:
                    dist.destroy_process_group(group)
                except ValueError:    # gone already: the job was left (destroy_process_group()) since
                    pass
        self._groups.clear()
        self._within.clear()
        self._stages.clear()
        self.mesh, self._closed = None, True

    @property
    def world_size(self) -> int:
        return world_of(self.sizes)

    def describe(self) -> str:
        return describe(self.sizes)

    def __repr__(self) -> str:
        return f"Grid({self.describe()}, rank={self.rank})"


@dataclass(frozen=True)
class Stages:
    """A staged collective's groups for this rank: ``node`` and ``node_out`` (its group's ranks on its
    node, twice) and ``link`` (its group's ranks at its position on every node), with the Split they
    come from."""

    split: Split
    node: dist.ProcessGroup        # the node's reductions (par4d.staged's REDUCE lane)
    link: dist.ProcessGroup
    node_out: dist.ProcessGroup    # the node's gathers (the GATHER lane: each lane issues on a group of its own)
    pays: bool = True        # under auto: staged measured faster than flat on this job (par4d.launch.init)


def build_grid(sizes: dict[str, int], device: torch.device, nodes: tuple[int, ...] | None = None,
               hierarchical: str = "auto") -> Grid:
    """The grid of validated ``sizes`` over the job this process has joined (collective:
    every rank builds the same groups). :func:`par4d.init` checks first that every rank
    asks for the same shape; call this directly only where that is known (one process
    standing in for a whole job, as the planner's profiler does). ``nodes``: each rank's node
    (par4d.hierarchy.node_indices); where groups span nodes, their stages' groups are built here
    too (gloo only: on NCCL ``auto`` leaves the topology to NCCL and ``on`` is refused)."""
    check_mode(hierarchical)
    if hierarchical == "on" and device.type != "cpu":
        raise ValueError(f"hierarchical='on': staged collectives run on gloo (CPU) only; on {device.type} "
                         f"NCCL chooses its own topology-aware algorithms (use auto or off)")
    names = tuple(reversed(AXES))  # outermost first: pipe, data, context, z, y, x
    mesh = init_device_mesh(device.type, tuple(sizes.get(a, 1) for a in names), mesh_dim_names=names)
    grid = Grid(sizes=dict(sizes), rank=dist.get_rank(), device=device, mesh=mesh, nodes=nodes,
                hierarchical=hierarchical)
    for axis in AXES:
        grid._groups[(axis,)] = mesh.get_group(axis)
    for axis in FOLDED:
        if sizes.get(axis, 1) > 1:
            grid._groups[(axis,)], _ = dist.new_subgroups_by_enumeration(folded_groups(sizes, axis))
            for key in within_keys(sizes, FOLDED[axis]):       # what gradients are summed over, within it
                grid._within[(key, axis)], _ = dist.new_subgroups_by_enumeration(within_groups(sizes, key, axis))
    for combo in _COMBINED + (_WITH_CONTEXT if sizes.get("context", 1) > 1 else ()):
        grid._groups[combo] = _combined_group(grid, combo)
    if sizes.get("pipe", 1) > 1:     # a stage's ranks, all of them: where they agree on the pipeline's order
        for axes in (STAGE, SHARING) if sizes.get("context", 1) > 1 else (STAGE,):
            stage = tuple(a for a in axes if a != "context" or sizes.get(a, 1) > 1)    # as comm names it
            grid._groups[stage] = _combined_group(grid, stage)
    if nodes is not None and device.type == "cpu" and hierarchical != "off":
        made: dict[tuple, tuple[dist.ProcessGroup, ...]] = {}   # ("z",) and ("z", "data") at data=1 share groups
        for key, found in staged_splits(grid.sizes, nodes).items():
            cut = (found.node_groups, found.link_groups, found.node_groups)
            if cut[:2] not in made:
                made[cut[:2]] = tuple(dist.new_subgroups_by_enumeration([list(g) for g in groups])[0] for groups in cut)
            grid._stages[key] = Stages(found, *made[cut[:2]])
    if hierarchical == "on" and not grid._stages:
        grid.close()
        raise ValueError(f"hierarchical='on': no group of grid {describe(sizes)} spans nodes with 2 or more "
                         f"of its ranks on each (ranks' nodes: {list(nodes or [])}); use auto or off")
    return grid


def staged_splits(sizes: dict[str, int], nodes: tuple[int, ...]) -> dict[tuple[str, ...], Split]:
    """The sets of axes with a process group whose groups span ``nodes`` in a way staging pays
    (par4d.hierarchy.split), and how: what build_grid builds stage groups for."""
    full = validate_sizes(sizes, len(nodes))
    keys = sorted([(a,) for a in AXES] + list(_COMBINED) + list(_WITH_CONTEXT if full.get("context", 1) > 1 else ()))
    found = {key: split(groups_of(full, key), nodes) for key in keys}
    return {key: s for key, s in found.items() if s is not None}


def groups_of(sizes: dict[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of ``axes`` in the grid of ``sizes`` (the job partitioned), each in group order
    (innermost axis fastest), the groups in order of their other coordinates."""
    others = [a for a in AXES if a not in axes]
    enumeration = []
    for fixed in itertools.product(*(range(sizes.get(a, 1)) for a in reversed(others))):
        base = dict(zip(reversed(others), fixed))
        members = []
        for varying in itertools.product(*(range(sizes.get(a, 1)) for a in reversed(axes))):
            coords = dict(base, **dict(zip(reversed(axes), varying)))
            members.append(rank_of(coords, sizes))
        enumeration.append(members)
    return enumeration


def folded_groups(sizes: dict[str, int], axis: str) -> list[list[int]]:
    """Every group of the folded ``axis``: the ranks of one group of its host axis, cut into runs of
    ``sizes[axis]`` consecutive host coordinates."""
    size = sizes[axis]
    return [members[start:start + size] for members in groups_of(sizes, (FOLDED[axis],))
            for start in range(0, len(members), size)]


def within_keys(sizes: dict[str, int], host: str) -> list[tuple[str, ...]]:
    """The sets of axes with ``host`` that an expert's gradient is summed over, cut by the folded axis: the host
    and z with it, and the same with a context axis where it has ranks."""
    keys = [(host,), ("z", host)]
    return keys + [("context", host), ("z", "context", host)] if sizes.get("context", 1) > 1 else keys


def within_groups(sizes: dict[str, int], axes: tuple[str, ...], folded: str) -> list[list[int]]:
    """Every group of ``axes`` cut by the coordinate on the folded axis: the ranks of one group that hold
    the same experts."""
    return [[r for r in members if coords_of(r, sizes)[folded] == c]
            for members in groups_of(sizes, axes) for c in range(sizes[folded])]


def _combined_group(grid: Grid, axes: tuple[str, ...]) -> dist.ProcessGroup:
    group, _ = dist.new_subgroups_by_enumeration([sorted(g) for g in groups_of(grid.sizes, axes)])
    return group


def default_grid(world: int) -> dict[str, int]:
    """Deterministic default shape: prime factors of ``world``, largest first, dealt
    round-robin to x, z, y, data (4 -> x=2,z=2; 8 -> x=2,y=2,z=2; 16 -> all four = 2)."""
    factors, n, p = [], world, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    sizes = {a: 1 for a in ("x", "z", "y", "data")}
    for i, factor in enumerate(sorted(factors, reverse=True)):
        axis = ("x", "z", "y", "data")[i % 4]
        sizes[axis] *= factor
    return {a: s for a, s in sizes.items() if s > 1} or {"x": 1}
