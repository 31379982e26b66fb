"""Staged collectives over groups that span nodes: which groups stage, exact results, the ledger's
stages, and the GPT trained through them against its twin. The pool's ranks share one host, so
their nodes are declared (``cases.grid(nodes=...)``); the emulated cluster's are found
(tests/test_cluster.py)."""

import pytest
import torch

from par4d import comm
from par4d.cli import as_flags
from par4d.grid import groups_of, validate_sizes
from par4d.hierarchy import check_mode, node_indices, split
from tests import cases
from tests.cases import GPT_CONFIG, compare_gpt_with_twin

TWO_BY_TWO = (0, 0, 1, 1)


def _split(sizes: dict, axes: tuple, nodes: tuple):
    return split(groups_of(validate_sizes(sizes, len(nodes)), axes), nodes)


def test_split_of_a_group_across_two_nodes():
    found = _split({"data": 4}, ("data",), TWO_BY_TWO)
    assert (found.nodes, found.per_node) == (2, 2)
    assert found.node_groups == ((0, 1), (2, 3)) and found.link_groups == ((0, 2), (1, 3))
    assert found.order == (0, 2, 1, 3)      # block l*K + k: the k-th rank of link group l
    interleaved = _split({"data": 4}, ("data",), (0, 1, 0, 1))
    assert interleaved.node_groups == ((0, 2), (1, 3)) and interleaved.order is None
    # Rank 3 sits second on node 0 and rank 2 second on node 1: their link group is (2, 3) in torch's (sorted)
    # numbering, so block 1*2 + 0 is rank 2's and block 1*2 + 1 rank 3's.
    mirrored = _split({"data": 4}, ("data",), (0, 1, 1, 0))
    assert mirrored.node_groups == ((0, 3), (1, 2)) and mirrored.link_groups == ((0, 1), (2, 3))
    assert mirrored.order is None


def test_no_split_where_staging_saves_nothing_or_groups_differ():
    assert _split({"x": 2, "data": 2}, ("data",), TWO_BY_TWO) is None       # one rank per node
    assert _split({"x": 2, "data": 2}, ("x",), TWO_BY_TWO) is None          # inside a node
    assert _split({"data": 4}, ("data",), (0, 0, 0, 1)) is None             # 3 ranks on one node, 1 on another
    # Two groups cut differently (one node-major, one interleaved): ranks would issue different stages.
    assert _split({"x": 4, "data": 2}, ("x",), (0, 0, 1, 1, 0, 1, 0, 1)) is None
    assert _split({"x": 2, "data": 4}, ("data",), (0, 0, 0, 0, 1, 1, 1, 1)).per_node == 2


def test_nodes_and_modes():
    assert node_indices(["b/1", "a/1", "b/1", "a/2"]) == (0, 1, 0, 2)
    with pytest.raises(ValueError, match="hierarchical='yes': choose one of auto, on, off"):
        check_mode("yes")
    # par4d train reads its flag, not the call's parameter
    assert as_flags("hierarchical='yes': choose one") == "--hierarchical 'yes': choose one"
    assert as_flags("keep=0: keep at least 1 checkpoint") == "--keep 0: keep at least 1 checkpoint"


def _integers(shape, seed) -> torch.Tensor:
    """Whole numbers in float64: every summation order gives the same bits."""
    return torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(seed)).double()


def _staged_collectives(sizes: dict, nodes: tuple, axis: str) -> dict:
    grid = cases.grid(**sizes, nodes=nodes, hierarchical="on")
    members = grid.group_ranks(axis)
    g, me = len(members), members.index(grid.rank)
    assert grid.stages((axis,), 4) is not None
    out = {}
    with grid.ledger.capture() as entries:
        # An odd length: the node stage pads the message to a multiple of the ranks per node.
        t = _integers((7, 3), grid.rank)
        comm.all_reduce(grid, t, axis)
        expected = sum(_integers((7, 3), r) for r in members)
        out["all_reduce"] = torch.equal(t, expected)
        full = _integers((g * 2, 5), 100 + grid.rank)
        rs = comm.reduce_scatter(grid, full, axis)
        out["reduce_scatter"] = torch.equal(rs, sum(_integers((g * 2, 5), 100 + r) for r in members)[2 * me:2 * me + 2])
        out["input_kept"] = torch.equal(full, _integers((g * 2, 5), 100 + grid.rank))
        ag = comm.all_gather(grid, _integers((2, 5), 200 + grid.rank), axis)
        out["all_gather"] = torch.equal(ag, torch.cat([_integers((2, 5), 200 + r) for r in members]))
        # Async: two in flight at once, waited in the opposite order.
        a, b = _integers((64,), grid.rank), _integers((64,), 300 + grid.rank)
        ha = comm.all_reduce(grid, a, axis, async_op=True)
        hb = comm.all_reduce(grid, b, axis, async_op=True)
        hb.wait()
        ha.wait()
        out["async"] = (torch.equal(a, sum(_integers((64,), r) for r in members))
                        and torch.equal(b, sum(_integers((64,), 300 + r) for r in members)))
        # 2.4 MB: in chunks (staged.CHUNK_BYTES), the last padded.
        big = _integers((300_001,), 400 + grid.rank)
        comm.all_reduce(grid, big, axis)
        out["chunked"] = torch.equal(big, sum(_integers((300_001,), 400 + r) for r in members))
    out["entries"] = [(e.kind, e.stage, e.elements) for e in entries[:7]]
    out["timed"] = all(e.in_flight > 0 for e in entries)
    return out


@pytest.mark.parametrize("nodes", [TWO_BY_TWO, (0, 1, 0, 1), (0, 1, 1, 0)],
                         ids=["node-major", "interleaved", "mirrored"])
def test_staged_collectives_are_exact(pool4, nodes):
    for rank, out in enumerate(pool4.run(_staged_collectives, {"z": 4}, nodes, "z")):
        assert {k: v for k, v in out.items() if k != "entries"} == {
            "all_reduce": True, "reduce_scatter": True, "input_kept": True, "all_gather": True, "async": True,
            "chunked": True, "timed": True}, f"rank {rank}"
        # Per stage, the ring model's per-rank message: all-reduce of 21 elements padded to 22, reduce-scattered
        # inside the node, its 11-element share all-reduced across the link, gathered inside; reduce-scatter of
        # 8 x 5 rows inside, this node's 4 rows x 5 across; all-gather of 2 x 5 across, 4 x 5 inside.
        assert out["entries"] == [
            ("reduce_scatter", "node", 22), ("all_reduce", "link", 11), ("all_gather", "node", 11),
            ("reduce_scatter", "node", 40), ("reduce_scatter", "link", 20),
            ("all_gather", "link", 10), ("all_gather", "node", 20)], f"rank {rank}"


def test_staged_over_four_per_node(pool8):
    """8 ranks, 4 per node: the data group stages with L = 4."""
    for rank, out in enumerate(pool8.run(_staged_collectives, {"data": 8}, (0,) * 4 + (1,) * 4, "data")):
        assert all(out[k] for k in ("all_reduce", "reduce_scatter", "input_kept", "all_gather", "async", "chunked")), \
            f"rank {rank}: {out}"


def _gpt_staged(sizes: dict, nodes: tuple) -> tuple[int, list]:
    with cases.float64():
        grid = cases.grid(**sizes, nodes=nodes, hierarchical="on")
        with grid.ledger.capture() as entries:
            params = compare_gpt_with_twin(grid, sizes, GPT_CONFIG)
    return params, sorted({(e.kind, e.axes, e.stage) for e in entries if e.stage})


def _check_staged(results: list, sizes: dict, expected: set) -> None:
    for rank, (_, staged) in enumerate(results):
        assert {axes for _, axes, _ in staged} == expected, f"{sizes} rank {rank}"
        assert {stage for _, _, stage in staged} == {"node", "link"}, f"{sizes} rank {rank}"


BATCH_AXES = {("z", "data")}      # the gradient sync and the loss's mean over the batch shards


@pytest.mark.parametrize("sizes, expected", [(dict(data=4), {("data",), ("z", "data")}),
                                             (dict(z=4), {("z",), ("z", "data")}), (dict(z=2, data=2), BATCH_AXES)],
                         ids=["data=4", "z=4", "z=2,data=2"])
def test_gpt_trains_through_staged_collectives(pool4, sizes, expected):
    """Loss, every gradient and the parameters after AdamW steps against the single-device twin, with
    every collective over a group that spans the declared nodes staged (``on``): the data sync, the
    loss's mean, and z's all-gathers and reduce-scatters where z spans the nodes."""
    _check_staged(pool4.run(_gpt_staged, sizes, TWO_BY_TWO), sizes, expected)


def test_gpt_trains_through_staged_collectives_3d(pool8):
    """x inside a node, the batch axes (z, data) across two nodes of 4."""
    sizes = dict(x=2, z=2, data=2)
    _check_staged(pool8.run(_gpt_staged, sizes, (0,) * 4 + (1,) * 4), sizes, BATCH_AXES)


def test_train_refuses_hierarchical_on_for_its_own_local_ranks():
    """Before any rank starts: par4d's local ranks share one node, so `on` could stage nothing."""
    from par4d.cli import _parser
    from par4d.cli.configure import configure

    args = _parser().parse_args(["train", "--grid", "data=4", "--hierarchical", "on", "--out", "unused"])
    with pytest.raises(ValueError, match="--hierarchical on stages collectives over groups that span nodes"):
        configure(args, 4, inside=False)
