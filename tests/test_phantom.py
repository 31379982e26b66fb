"""Phantom layers against a single-device block-matrix twin; parameter counts; messages."""

import pytest
import torch
import torch.nn.functional as F

from par4d.layout import shard_activation
from par4d.optim.data_parallel import sync_gradients
from par4d.phantom import PhantomFFN, block_matrix, parameter_count
from tests import cases


@pytest.mark.parametrize("p, k, paper_millions", [(8, 16, 71), (16, 6, 37), (32, 4, 21), (64, 2, 13), (128, 2, 13),
                                                  (256, 4, 36)])
def test_parameter_count_reproduces_table_1(p, k, paper_millions):
    """The phantom paper's Table I: n = 16,384, L = 2 (TP: 537M)."""
    assert round(parameter_count(16384, 2, p, k) / 1e6) == paper_millions
    assert round(2 * 16384 * 16384 / 1e6) == 537


def _phantom_matches_twin(sizes: dict, k: int, widths: list, batch: int) -> int:
    grid = cases.grid(**sizes)
    depth = len(widths) - 1
    model = PhantomFFN(widths, depth, k, grid=grid, axis="x", seed=4)
    p, rank = grid.size("x"), grid.coord("x")

    # The twin: every rank's blocks as leaves of one block matrix per layer.
    twin = [[[t.clone().requires_grad_() for t in per_rank] for per_rank in layer.blocks()] for layer in model.layers]
    gen = torch.Generator().manual_seed(8)
    inp, target = torch.randn(batch, widths[0], generator=gen), torch.randn(batch, widths[-1], generator=gen)
    h = inp
    for layer, blocks in zip(model.layers, twin):
        weight = block_matrix([b[:3] for b in blocks], layer.n_in, layer.n_out)
        h = F.relu(h @ weight.t() + torch.cat([b[3] for b in blocks]))
    ((h - target) ** 2).mean().backward()

    local_in = shard_activation(grid, inp, "x")
    out = model(local_in)
    local_target = shard_activation(grid, target, "x")
    # This rank's part of the mean over its samples (features summed across x by the
    # backward reduce-scatters): sum / (local samples * full width).
    ((out - local_target) ** 2).sum().div(local_in.shape[0] * widths[-1]).backward()
    sync_gradients(model, grid)

    torch.testing.assert_close(out, shard_activation(grid, h.detach(), "x"))
    checked = 0
    for li, (layer, blocks) in enumerate(zip(model.layers, twin)):
        mine = blocks[rank]
        for name, param, ref in zip(("L", "C", "D", "b"), (layer.local, layer.compressor, layer.decompressors,
                                                           layer.bias), mine):
            torch.testing.assert_close(param.grad, ref.grad, msg=lambda m, n=name, i=li: f"layer {i} {n}: {m}")
            checked += 1
    # The module's own parameter count agrees with the formula.
    count = torch.tensor([sum(t.numel() for t in model.parameters())])
    torch.distributed.all_reduce(count, group=grid.group("x"))
    if widths == [widths[0]] * len(widths):
        assert count.item() == parameter_count(widths[0], depth, p, k)
    return checked


@pytest.mark.parametrize("sizes, k", [(dict(x=2, data=2), 1), (dict(x=2, data=2), 5), (dict(x=4), 2),
                                      (dict(x=4), 3)], ids=["p2k1-data2", "p2k5-data2", "p4k2", "p4k3"])
def test_phantom_matches_block_matrix_twin(pool4, sizes, k):
    assert pool4.run(_phantom_matches_twin, sizes, k, [12, 12, 12], 4) == [8] * 4


def test_phantom_p3_and_layer_widths_that_differ(pool3):
    assert pool3.run(_phantom_matches_twin, dict(x=3), 2, [6, 12, 9, 6], 5) == [12] * 3


def _phantom_messages(k: int, batch: int) -> list:
    grid = cases.grid(x=4)
    model = PhantomFFN(8, 2, k, grid=grid, seed=1)
    y = torch.randn(batch, 2, requires_grad=True)
    with grid.ledger.capture() as entries:
        out = model(y)
        forward = [(e.kind, e.axes, e.elements) for e in entries]
        out.sum().backward()
    return [forward, [(e.kind, e.axes, e.elements) for e in entries[len(forward):]]]


def test_messages_are_table_2(pool4):
    """Per layer: all-gather of k x batch ghosts forward; reduce-scatter backward whose
    per-rank result is k x batch (the ledger records its input, p x k x batch)."""
    k, batch, p = 3, 5, 4
    for forward, backward in pool4.run(_phantom_messages, k, batch):
        assert forward == [("all_gather", ("x",), k * batch)] * 2
        assert backward == [("reduce_scatter", ("x",), p * k * batch)] * 2


def _bad_phantom(sizes, n, k):
    return PhantomFFN(n, 2, k, grid=cases.grid(**sizes))


@pytest.mark.parametrize("sizes, n, k, words", [
    (dict(x=4), 10, 2, ["n_in=10 is not divisible by x=4"]),
    (dict(x=2, y=2), 8, 2, ["one axis (x) and data", "y=2 must be 1"]),
    (dict(x=4), 8, 0, ["k=0 ghost neurons must be >= 1"]),
])
def test_phantom_errors(pool4, sizes, n, k, words):
    for message in pool4.errors(_bad_phantom, sizes, n, k, timeout=30):
        for word in words:
            assert word in message, (word, message)


def _tp_matches_plain(depth: int) -> int:
    from par4d.phantom import TensorParallelFFN

    grid = cases.grid(x=4)
    n, batch = 8, 3
    model = TensorParallelFFN(n, depth, grid=grid, seed=2)
    plain = torch.nn.Sequential(*[torch.nn.Linear(n, n) for _ in range(depth)])
    with torch.no_grad():
        for layer, ref in zip(model.layers, plain):
            ref.weight.copy_(layer.full_weight())
            ref.bias.copy_(layer.full_bias())
    gen = torch.Generator().manual_seed(3)
    inp, target = torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen)
    h = inp
    for ref in plain:
        h = F.relu(ref(h))
    ((h - target) ** 2).mean().backward()
    out = model(inp)
    local_target = shard_activation(grid, target, "x") if model.output_sharded else target
    ((out - local_target) ** 2).sum().div(batch * n).backward()
    sync_gradients(model, grid)
    expected = shard_activation(grid, h.detach(), "x") if model.output_sharded else h.detach()
    torch.testing.assert_close(out, expected)
    for layer, ref in zip(model.layers, plain):
        torch.testing.assert_close(layer.full_weight(grad=True), ref.weight.grad)
        torch.testing.assert_close(layer.full_bias(grad=True), ref.bias.grad)
    return depth


@pytest.mark.parametrize("depth", [2, 3])
def test_tensor_parallel_baseline_matches_plain_ffn(pool4, depth):
    assert pool4.run(_tp_matches_plain, depth) == [depth] * 4


def test_energy_model_and_monitor():
    from par4d.phantom.energy import FRONTIER_GCD, DeviceProfile, EnergyMonitor

    assert FRONTIER_GCD.energy(busy_seconds=2.0, comm_seconds=10.0) == 560 * 2 + 90 * 10
    with pytest.raises(ValueError, match="busy_watts >= idle_watts"):
        DeviceProfile("bad", 10, 20)
    monitor = EnergyMonitor()
    if not monitor.available:   # this machine: no sensor, and it says so
        assert "no power sensor" in monitor.reason and monitor.start().stop() is None
    monitor.samples = [(0.0, 100.0), (1.0, 100.0), (3.0, 200.0)]   # trapezoid: 100 + 300
    assert monitor.joules == 400.0


def test_synthetic_teacher_is_the_papers_task():
    from par4d.phantom import SyntheticTeacher

    teacher = SyntheticTeacher(6, seed=1)
    x, y = teacher.batch(step=3, batch_size=4)
    torch.testing.assert_close(y, torch.relu(torch.relu(x) @ teacher.weight.t()))
    assert torch.equal(teacher.batch(3, 4)[0], x) and not torch.equal(teacher.batch(4, 4)[0], x)
    assert torch.equal(SyntheticTeacher(6, seed=1).weight, teacher.weight)


def test_compare_rows_and_exact_bytes(tmp_path):
    from par4d.bench.phantom import run_compare, write_report

    n, batch, ks = 16, 4, [1, 3]
    rows, fits = run_compare(n, 2, [2], ks, batch=batch, lr=1e-2, iters=4, max_iters=30, target_loss=None, seed=0)
    assert [(r["scheme"], r["k"]) for r in rows] == [("tp", None), ("phantom", 1), ("phantom", 3)]
    tp, *pps = rows
    # TP (x = 2, two layers): one all-reduce of the (batch x n) output forward; the
    # input gradient of the first layer is not needed, so no all-reduce backward. fp32.
    assert tp["comm_bytes_per_iter"] == batch * n * 4
    assert tp["params"] == 2 * (n * n + n)
    for pp, k in zip(pps, ks):
        # Per layer: all-gather of k x batch ghosts, reduce-scatter of p x k x batch.
        assert pp["comm_bytes_per_iter"] == 2 * (k * batch + 2 * k * batch) * 4
        assert pp["params"] == parameter_count(n, 2, 2, k)
        assert pp["s_per_iter"] > 0 and pp["energy_j"] > 0 and "estimate" in pp["energy_source"]
    report = tmp_path / "phantom.md"
    write_report(rows, fits, "par4d phantom compare (test)", report)
    assert "| PP | 2 | 3 |" in report.read_text() and (tmp_path / "figures" / "phantom.png").is_file()


def test_compare_never_overwrites_a_report_or_its_figure(tmp_path, capsys, monkeypatch):
    import par4d.bench.phantom
    from par4d.cli import main

    calls = []

    def compared(args):                                # the experiment, without starting ranks
        calls.append(args.report)
        (tmp_path / "phantom.md").write_text("new\n")
        return 0

    monkeypatch.setattr(par4d.bench.phantom, "main", compared)
    report = tmp_path / "phantom.md"
    report.write_text("mine\n")
    assert main(["phantom", "compare", "--report", str(report)]) == 2
    assert (f"par4d phantom: error: --report {report} already exists; pass --force to overwrite it, or choose "
            f"another --report" in capsys.readouterr().err)
    assert report.read_text() == "mine\n"
    report.unlink()
    figure = tmp_path / "figures" / "phantom.png"      # write_report's figure for this report
    figure.parent.mkdir()
    figure.write_bytes(b"mine")
    assert main(["phantom", "compare", "--report", str(report)]) == 2
    assert f"--report {report}: its figure {figure} already exists" in capsys.readouterr().err
    assert figure.read_bytes() == b"mine" and not report.exists() and calls == []
    assert main(["phantom", "compare", "--report", str(tmp_path / "figures")]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["phantom", "compare", "--report", str(report), "--force"]) == 0
    assert calls == [str(report)] and report.read_text() == "new\n"
