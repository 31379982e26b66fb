"""Where ranks sit, and a group's collectives cut into stages that cross the link once.

A *node* is the set of ranks that talk without the network: one host and one network
namespace (so the emulated cluster's namespaces count as nodes, as their links do).
When a group's ranks sit on ``nodes`` nodes, ``per_node`` on each, a collective over it
can go in stages (docs/architecture.md, "Staged collectives"): inside the node, then
across the link on the node's share, then inside the node again, so each byte crosses
the link once instead of a flat ring's ``2 (G - 1) / G`` per rank on the links the ring
happens to cross. Pure: no torch, no collective; ``grid.py`` builds the process groups.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("auto", "on", "off")
"""``--hierarchical``: ``auto`` stages collectives of at least STAGE_MIN_BYTES over groups that span
nodes where a probe at start measures it pays (on gloo; NCCL picks topology-aware algorithms itself),
``on`` stages every one of them (and refuses a grid where no group spans nodes), ``off`` runs every
collective flat."""

STAGE_MIN_BYTES = 64 * 1024
"""Below this a staged collective's three latencies cost more than the link bytes it saves (the
loss's and the norms' scalars stay flat under ``auto``)."""


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"hierarchical={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def node_key() -> str:
    """This process's node: its host name and network namespace (ranks in two namespaces of one
    host talk over a link, not over loopback)."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def node_indices(keys: Sequence[str]) -> tuple[int, ...]:
    """Each rank's node as a small number, in order of first appearance (``keys`` per rank)."""
    first: dict[str, int] = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


@dataclass(frozen=True)
class Split:
    """The staging of every group of one set of axes: ``nodes`` (K) node parts of ``per_node`` (L)
    ranks in each group. ``node_groups`` and ``link_groups`` enumerate the whole job (what
    ``new_subgroups_by_enumeration`` takes): a node group is the ranks of one group on one node,
    a link group the ranks of one group at the same position on every node, each in ascending rank
    order. ``order``: block ``l * K + k`` of a staged reduce-scatter's input (and of a staged
    all-gather's output) is the block of the group member at place ``k`` of link group ``l``, in
    group order; None where that is group order already."""

    nodes: int
    per_node: int
    node_groups: tuple[tuple[int, ...], ...]
    link_groups: tuple[tuple[int, ...], ...]
    order: tuple[int, ...] | None


def split(groups: Sequence[Sequence[int]], nodes: Sequence[int]) -> Split | None:
    """How ``groups`` (the partition of the job by one set of axes, each in group order) stage over
    ``nodes`` (each rank's node), or None when staging saves nothing (a group inside one node, or one
    rank per node) or the groups are not alike (node parts of unequal size, or groups cut differently:
    every rank must issue the same stages). Stage groups are listed in ascending rank order, as torch
    numbers a group's ranks, so a rank's place in its node group and in its link group is its place
    in the sorted list."""
    shapes, node_groups, link_groups = set(), [], []
    order = None
    for group in groups:
        parts: dict[int, list[int]] = {}
        for index, rank in enumerate(group):
            parts.setdefault(nodes[rank], []).append(index)
        sizes = {len(p) for p in parts.values()}
        if len(sizes) != 1:
            return None
        per_node = sizes.pop()
        shapes.add((len(parts), per_node))
        members = [sorted(part, key=lambda i: group[i]) for part in parts.values()]
        mine = []
        for position in range(per_node):
            across = sorted((part[position] for part in members), key=lambda i: group[i])
            link_groups.append(tuple(group[i] for i in across))
            mine += across          # block position * K + k: the k-th lowest rank of link group ``position``
        node_groups += [tuple(group[i] for i in part) for part in members]
        if order is None:
            order = tuple(mine)
        elif order != tuple(mine):
            return None
    if len(shapes) != 1:
        return None
    k, per_node = shapes.pop()
    if k < 2 or per_node < 2:
        return None
    return Split(k, per_node, tuple(node_groups), tuple(link_groups),
                 None if order == tuple(range(len(order))) else order)
