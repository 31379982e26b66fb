"""The ledger pins the exact collectives of Algorithm 1 (message sizes: docs/architecture.md, Notation)."""

import pytest
import torch

import par4d
from par4d.layout import shard_activation
from tests import cases
from tests.helpers import grid_id

BATCH, SEQ, K, N = 4, 3, 12, 20
F32 = 4


def _linear_entries(sizes: dict, transposed: bool) -> list:
    grid = cases.grid(**sizes)
    layer = par4d.nn.Linear(K, N, True, transposed, grid=grid)
    inp = shard_activation(grid, torch.randn(BATCH, SEQ, K), layer.in_axis).requires_grad_()
    with grid.ledger.capture() as entries:
        out = layer(inp)
        forward = len(entries)
        out.sum().backward()
    return [(e.kind, e.axes, e.elements, e.bytes) for e in entries] + [forward]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("sizes", [dict(x=2, y=2, z=2, data=1), dict(x=2, y=2, z=1, data=2),
                                   dict(x=1, y=2, z=2, data=2)], ids=grid_id)
def test_linear_moves_the_model_message_sizes(pool8, sizes, transposed):
    gx, gy, gz, gd = sizes["x"], sizes["y"], sizes["z"], sizes["data"]
    g_in, g_out = (gx, gy) if transposed else (gy, gx)
    in_axis, out_axis = ("x", "y") if transposed else ("y", "x")
    m = BATCH * SEQ // gd                # rows of one data replica (the model's m)
    k, n = K, N
    expected_forward = [
        ("all_gather", ("z",), k * n // (gx * gy * gz)),      # t_AG,z: the Ŵ shard
        ("all_reduce", (in_axis,), m * n // (gz * g_out)),   # t_AR,y (x if transposed)
    ]
    expected_backward = [
        ("all_reduce", (out_axis,), m * k // (gz * g_in)),   # t_AR,x (y if transposed)
        ("reduce_scatter", ("z",), k * n // (gx * gy)),      # t_RS,z: the full block
    ]
    sizes_of = {"x": gx, "y": gy, "z": gz}
    expected = [(kind, axes, elems, elems * F32) for kind, axes, elems in expected_forward + expected_backward
                if sizes_of[axes[0]] > 1]   # collectives over an axis of size 1 are not issued
    n_forward = sum(1 for kind, axes, _ in expected_forward if sizes_of[axes[0]] > 1)
    for rank, entries in enumerate(pool8.run(_linear_entries, sizes, transposed)):
        *recorded, forward = entries
        assert recorded == expected, f"rank {rank}"
        assert forward == n_forward, f"rank {rank}"


def _megatron_mlp_entries(hidden: int) -> list:
    grid = cases.grid(x=4)
    fc = par4d.nn.Linear(hidden, 4 * hidden, grid=grid)                       # column-parallel
    proj = par4d.nn.Linear(4 * hidden, hidden, transposed=True, grid=grid)   # row-parallel
    inp = torch.randn(BATCH, SEQ, hidden, requires_grad=True)
    with grid.ledger.capture() as entries:
        out = proj(torch.nn.functional.gelu(fc(inp)))
        forward = [(e.kind, e.axes, e.elements) for e in entries]
        out.sum().backward()
    return [forward, [(e.kind, e.axes, e.elements) for e in entries[len(forward):]]]


def test_x_with_transposed_alternation_is_megatron_mlp(pool4):
    """Megatron-LM's MLP block: one all-reduce of the (m x h) output in forward (g),
    one of the (m x h) input gradient in backward (f), nothing else."""
    hidden = 8
    m = BATCH * SEQ
    for forward, backward in pool4.run(_megatron_mlp_entries, hidden):
        assert forward == [("all_reduce", ("x",), m * hidden)]
        assert backward == [("all_reduce", ("x",), m * hidden)]


def _async_all_reduce() -> list:
    from par4d import comm

    grid = cases.grid(x=2, y=2)
    t = torch.full((1000,), float(grid.rank))
    with grid.ledger.capture() as entries:
        handle = comm.all_reduce(grid, t, "x", async_op=True)
        result = handle.wait()
    # booked by the wait: an Entry starts at 0.0 s, and any wait or flight measured by perf_counter is > 0
    waited = entries[0].seconds > 0 and entries[0].in_flight > 0
    return [result[0].item(), [(e.kind, e.axes, e.elements, e.bytes) for e in entries], waited]


def test_async_collective_is_recorded_once_with_its_wait(pool4):
    for rank, (value, entries, waited) in enumerate(pool4.run(_async_all_reduce)):
        partner = rank ^ 1                      # x varies fastest: ranks (0,1), (2,3)
        assert value == rank + partner
        assert entries == [("all_reduce", ("x",), 1000, 4000)] and waited


def _completed_before_its_wait() -> dict:
    """An async all-reduce seen completed by a probe long before its wait: its time in flight ends at the probe
    (no callback on the backend's thread), and a waited handle is no longer watched (it would hold its result)."""
    import time

    from par4d import comm

    grid = cases.grid(x=2, y=2)
    t = torch.ones(1000)
    with grid.ledger.capture() as entries:
        handle = comm.all_reduce(grid, t, "x", async_op=True)
        watched = handle in grid.ledger.watched
        while not handle._work.is_completed():       # completed, not yet seen so
            time.sleep(0.001)
        unseen = handle in grid.ledger.watched
        before = time.perf_counter()
        grid.ledger.probe()
        after = time.perf_counter()
        dropped = handle not in grid.ledger.watched
        time.sleep(0.05)                               # the wait comes well after the probe
        waiting = time.perf_counter()
        handle.wait()
        late = comm.all_reduce(grid, torch.ones(10), "x", async_op=True)   # waited before any probe saw it done
        late.wait()
    done = entries[0].issued_at + entries[0].in_flight
    return {"watched": watched, "unseen": unseen, "dropped": dropped,
            "ended_at_probe": before - 1e-6 <= done <= after + 1e-6,     # (the sum issued_at + in_flight rounds)
            "before_wait": done < waiting, "left": not {id(handle), id(late)} & {id(w) for w in grid.ledger.watched},
            "sum": t[0].item()}


def test_a_collective_completes_when_a_probe_first_sees_it(pool4):
    for out in pool4.run(_completed_before_its_wait):
        assert out == {"watched": True, "unseen": True, "dropped": True, "ended_at_probe": True,
                       "before_wait": True, "left": True, "sum": 2.0}
