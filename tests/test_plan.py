"""The planner's equations against hand-computed values, and its rules against the layers."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from par4d.cli import main
from par4d.grid import Grid
from par4d.models import GPT, GPTConfig
from par4d.plan import GPTSpec, Layer, Machine, bandwidths, factorizations, predict, rank_configurations, ring_time
from par4d.plan.cost import divisors
from par4d.plan.machines import load_machine
from par4d.plan.terms import layer_comm
from par4d.plan.workload import gpt_spec

NODE4 = Machine("test", devices_per_node=4, peak_flops=100e12, memory_bytes=40e9, beta_intra=200.0,
                beta_inter=50.0, bytes_per_element=1)


def test_ring_collectives_eqs_1_to_3():
    assert ring_time("all_gather", 4, 100, 10) == 3 * 100 / 10
    assert ring_time("reduce_scatter", 4, 100, 10) == 0.75 * 100 / 10
    assert ring_time("all_reduce", 4, 100, 10) == 2 * 0.75 * 100 / 10
    assert ring_time("all_reduce", 1, 100, 10) == 0
    assert ring_time("all_reduce", 4, 100, 10, latency=0.5) == 15 + 6 * 0.5


def test_layer_eqs_4_to_8_by_hand():
    layer = Layer("l", m=64, k=8, n=16)
    sizes = dict(x=2, y=2, z=2, data=2)
    beta = dict(x=1.0, y=2.0, z=4.0, data=8.0)
    t = layer_comm(layer, sizes, beta, bytes_per_element=1)
    m = 64 / 2                                                          # rows of one data replica
    ag_z = (2 - 1) * (8 * 16 / 8) / 4.0                                 # Eq 4
    rs_z = (1 / 2) * (8 * 16 / 4) / 4.0                                 # Eq 5
    ar_y = 2 * (1 / 2) * (m * 16 / 4) / 2.0                             # Eq 6
    ar_x = 2 * (1 / 2) * (m * 8 / 4) / 1.0                              # Eq 7
    ar_d = 2 * (1 / 2) * (8 * 16 / 8) / 8.0                             # Eq 8
    assert t == {"x": ar_x, "y": ar_y, "z": ag_z + rs_z, "data": ar_d}
    # Transposed: x and y swap sizes and bandwidths.
    flipped = layer_comm(Layer("l", 64, 8, 16, transposed=True), dict(x=2, y=4, z=1, data=1), beta, 1)
    assert flipped["x"] == 2 * (1 / 2) * (64 * 16 / 4) / 1.0           # forward all-reduce over x: m n/(z y)
    assert flipped["y"] == 2 * (3 / 4) * (64 * 8 / 2) / 2.0            # backward all-reduce over y: m k/(z x)


def test_placement_aware_bandwidth_eq_10():
    # Inside a node: intra.
    assert bandwidths(dict(x=2, y=2, z=1, data=1), NODE4, aware=True) == dict(x=200, y=200, z=200, data=200)
    # Fig. 5: one ring of 8 across two nodes of 4 -> beta_inter.
    assert bandwidths(dict(x=8, y=1, z=1, data=1), NODE4, aware=True)["x"] == 50
    # Fig. 6: x=2 inside the node, y=4 spans two nodes: two rings share the link -> beta_inter / 2.
    assert bandwidths(dict(x=2, y=4, z=1, data=1), NODE4, aware=True)["y"] == 25
    # Bounded by the devices per node: at most 4 rings cross.
    assert bandwidths(dict(x=2, y=2, z=2, data=4), NODE4, aware=True) == dict(x=200, y=200, z=50 / 4, data=50 / 4)
    assert set(bandwidths(dict(x=8, y=1, z=1, data=1), NODE4, aware=False).values()) == {50}
    # x = 3 on 4-device nodes: groups of 3 do not tile the nodes, one straddles two.
    assert bandwidths(dict(x=3, y=1, z=1, data=4), NODE4, aware=True)["x"] == 50


def test_factorizations_are_complete_and_unique():
    assert len(factorizations(16)) == math.comb(4 + 3, 3)   # 2^4 into 4 ordered factors
    assert len(factorizations(16384)) == math.comb(14 + 3, 3)
    for world in (12, 32):
        rows = factorizations(world)
        assert len({tuple(r.values()) for r in rows}) == len(rows)
        assert all(r["x"] * r["y"] * r["z"] * r["data"] == world for r in rows)
    for n in (1, 2, 12, 36, 97, 2048, 3600):                # squares, primes, powers of two
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("world", [4, 8, 12])
def test_divisibility_rules_match_the_layers(world):
    """spec.check says 'fits' exactly when par4d's GPT builds on that grid."""
    spec = GPTSpec("t", n_layer=1, hidden=24, heads=6, seq_len=8, global_batch=12, vocab=48)
    config = GPTConfig(vocab_size=48, block_size=8, n_layer=1, n_head=6, n_embd=24)
    for sizes in factorizations(world):
        reason = spec.check(sizes)
        try:
            GPT(config, grid=Grid.virtual(sizes))
            builds = 12 % (sizes["z"] * sizes["data"]) == 0
        except ValueError:
            builds = False
        assert (reason is None) == builds, (sizes, reason)


def test_flops_split_and_params():
    spec = gpt_spec("gpt-5b").with_batch(16, 2048)
    matmul, attention = spec.flops_split(checkpointing=False)
    assert matmul + attention == pytest.approx(spec.flops_per_iteration(False))
    assert attention == 12 * 16 * 2048**2 * 24 * 4096
    assert 5.0e9 < spec.params() < 5.3e9      # "GPT-5B"


def test_gpt_spec_takes_the_models_arithmetic():
    """GPTSpec's parameters, FLOPs and layers are its GPTConfig's, and the FLOPs are Narayanan et al.'s."""
    from par4d.plan.workload import GPT_MODELS

    small = GPTSpec("small", n_layer=2, hidden=64, heads=4, seq_len=64, global_batch=16, vocab=256)
    for spec in [*GPT_MODELS.values(), small]:
        config = GPTConfig(vocab_size=spec.vocab, block_size=spec.seq_len, n_layer=spec.n_layer, n_head=spec.heads,
                           n_embd=spec.hidden)
        assert spec.config == config
        assert GPTSpec.from_config(spec.name, config, spec.global_batch) == spec
        assert spec.params() == config.num_params()
        linears = config.linear_layers()
        assert [(l.name, l.m, l.k, l.n, l.transposed, l.count) for l in spec.layers()] == [
            (l.name, spec.tokens, l.k, l.n, l.transposed, l.count) for l in linears]
        assert sum(l.k * l.n * l.count for l in linears) + config.embedding_params() + config.vector_params() == (
            config.num_params())
        for checkpointing in (False, True):
            matmul, attention = spec.flops_split(checkpointing)
            assert matmul + attention == spec.flops_per_iteration(checkpointing) == (
                spec.tokens * config.flops_per_token(recompute=checkpointing))
            assert attention == spec.tokens * config.attention_flops_per_token(recompute=checkpointing)
        # The async-pipeline paper's Eq. 3; recomputation runs the blocks' forward again, not the head's.
        b, s, n, h, v = spec.global_batch, spec.seq_len, spec.n_layer, spec.hidden, spec.vocab
        assert spec.flops_per_iteration(False) == pytest.approx(
            72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)), rel=1e-12)
        assert spec.flops_per_iteration(True) == pytest.approx(
            96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)), rel=1e-12)
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=4"):
        GPTSpec("bad", n_layer=1, hidden=10, heads=4, seq_len=8, global_batch=4, vocab=16)
    # The planner plans the dense GPT: a phantom MLP has no dense fc/proj to list.
    phantom = GPTConfig(mlp="phantom", phantom_p=2)
    with pytest.raises(ValueError, match="only a dense MLP"):
        phantom.linear_layers()
    with pytest.raises(ValueError, match="dense GPT only"):
        GPTSpec.from_config("p", phantom, 4)


def test_ranking_and_exclusions():
    spec = gpt_spec("gpt-20b").with_batch(16, 2048)
    ranked, excluded = rank_configurations(spec, 32, NODE4, "full", checkpointing=True)
    assert len(ranked) + len(excluded) == len(factorizations(32))
    assert [p.t_iter for p in ranked] == sorted(p.t_iter for p in ranked)
    assert all(p.mem_bytes <= NODE4.memory_bytes for p in ranked)
    assert all(p.excluded for p in excluded)
    # Mostly data parallel: half the AdamW state of 20B parameters per device does not fit.
    data_only = predict(spec, dict(x=2, y=1, z=1, data=16), NODE4, "full", True)
    assert not data_only.fits and data_only.excluded.startswith("needs")


def test_plan_cli_json(capsys):
    assert main(["plan", "--model", "gpt-20b", "--gpus", "32", "--gpus-per-node", "4", "--machine", "perlmutter",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(factorizations(32, tuple(range(1, 33))))   # every 5-axis grid (pipe up to 32 blocks)
    for row in rows:
        assert {"x", "y", "z", "data", "pipe", "microbatches", "checkpointing", "overlap", "t_comm", "t_iter",
                "mem_bytes", "fits"} <= set(row)
    ranked = [r for r in rows if r["fits"]]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    assert rows[:len(ranked)] == ranked                                    # what fits first, fastest first
    assert [r["t_iter"] for r in ranked] == sorted(r["t_iter"] for r in ranked)


def test_plan_cli_errors(capsys, tmp_path):
    assert main(["plan", "--gpus", "8", "--batch-tokens", "0"]) == 2
    assert "--batch-tokens and --seq-len must be >= 1 (got 0, 2048)" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-3", "--gpus", "8"]) == 2
    assert "unknown model 'gpt-3'; built-in models are gpt-5b" in capsys.readouterr().err
    bad = tmp_path / "m.toml"
    bad.write_text('[machine]\nname = "m"\ndevices_per_node = 4\nbogus = 1\n')
    assert main(["plan", "--gpus", "8", "--machine", str(bad)]) == 2
    assert "unknown keys ['bogus']" in capsys.readouterr().err
    good = tmp_path / "good.toml"
    good.write_text(NODE4.to_toml())
    assert main(["plan", "--gpus", "8", "--machine", str(good), "--model", "gpt-5b"]) == 0
    capsys.readouterr()
    # validate: bad counts are refused before any calibration or rank starts
    assert main(["plan", "validate", "--passes", "0", "--machine", str(good)]) == 2
    assert "--passes must be >= 1, got 0" in capsys.readouterr().err
    assert main(["plan", "validate", "--iters", "0", "--machine", str(good)]) == 2
    assert "--iters must be >= 1, got 0" in capsys.readouterr().err


def test_train_grid_auto_takes_the_planners_first_choice(tmp_path, capsys):
    """--grid auto runs the full search (axes, pipe, microbatches, recomputation, overlaps) and applies its first
    choice, or among those within TIE of it the one that communicates least; flags the user gave stay fixed;
    it names the choice and the runner-up."""
    from par4d.cli import _parser
    from par4d.cli.configure import configure
    from par4d.measure.choose import TIE, planned_run
    from par4d.overlap import Overlap
    from par4d.plan.search import Space, search

    profile = tmp_path / "local.toml"
    # Memory for a few microbatches' activations: the search must choose them.
    local = Machine("local", devices_per_node=4, peak_flops=50e9, memory_bytes=6e6, beta_intra=1e9, beta_inter=1e9,
                    latency=5e-4, bytes_per_element=4, all_gather_scale=0.3, reduce_scatter_scale=0.25,
                    memory_bandwidth=5e9, kernel_latency=2e-5)
    profile.write_text(local.to_toml())
    dims = dict(n_layer=2, n_embd=64, n_head=4, seq_len=64, batch_size=16)
    plan = planned_run(4, machine=str(profile), inside=False, **dims)
    assert plan.peak is None                             # a given profile: nothing was measured here
    spec = GPTSpec("train", n_layer=2, hidden=64, heads=4, seq_len=64, global_batch=16, vocab=256)
    ranked = search(spec, 4, local)[0]
    tied = [p for p in ranked if p.t_iter <= ranked[0].t_iter * (1 + TIE)]
    best = min(tied, key=lambda p: p.t_comm)
    assert {**dict(x=1, y=1, z=1, data=1, pipe=1), **plan.grid} == best.sizes
    assert best.microbatches > 1 and plan.recompute == ("1" if best.checkpointing else "none")
    assert plan.overlap == (best.overlap or "none")
    out = capsys.readouterr().out
    assert "--grid auto chose" in out and "runner-up" in out
    # The run gets every choice; a flag the user gave is kept and the search honours it.
    flags = ["train", "--grid", "auto", "--machine", str(profile), "--n-layer", "2", "--n-embd", "64", "--n-head",
             "4", "--seq-len", "64", "--batch-size", "16", "--out", str(tmp_path / "run")]
    config = configure(_parser().parse_args(flags), 4, inside=False, planner=planned_run)
    assert config.grid == plan.grid and config.recompute == plan.recompute and config.overlap == plan.overlap
    assert config.microbatches == plan.microbatches
    config = configure(_parser().parse_args([*flags, "--overlap", "none", "--recompute", "none"]), 4,
                       inside=False, planner=planned_run)
    fixed = search(spec, 4, local, Space(checkpointing=False, overlap=Overlap.none()))[0]
    assert config.overlap == "none" and config.recompute == "none"
    assert {**dict(x=1, y=1, z=1, data=1, pipe=1), **config.grid} == min(
        (p for p in fixed if p.t_iter <= fixed[0].t_iter * (1 + TIE)), key=lambda p: p.t_comm).sizes
    # The cache named without --recompute: it keeps weights only for recomputation, so the run recomputes.
    cached = configure(_parser().parse_args([*flags, "--overlap", "oar,cache"]), 4, inside=False, planner=planned_run)
    assert cached.recompute == "1" and cached.overlap == "oar,cache"
    # Under a launcher there is no way to calibrate first: a profile is required.
    with pytest.raises(ValueError, match="needs --machine PROFILE"):
        planned_run(4, machine=None, inside=True, **dims)


def test_workload_recorded_from_a_module():
    import torch

    from par4d.plan.workload import ModuleWorkload

    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, stride=2, padding=1))
    work = ModuleWorkload.record(mlp, torch.zeros(8, 5, 32))
    assert [(l.m, l.k, l.n, l.transposed) for l in work.layers()] == [(40, 32, 64, False), (40, 64, 32, True)]
    assert work.params() == 2 * 32 * 64
    assert work.flops_per_iteration() == 3 * 2 * 40 * (32 * 64 + 64 * 32)
    convs = ModuleWorkload.record(conv, torch.zeros(4, 3, 16, 16)).layers()
    assert [(l.m, l.k, l.n) for l in convs] == [(4 * 16 * 16, 27, 8), (4 * 8 * 8, 72, 16)]
    machine = Machine("m", devices_per_node=4, peak_flops=1e12, memory_bytes=1e9, beta_intra=1e10, beta_inter=1e9)
    ranked, excluded = rank_configurations(work, 4, machine, "full")
    assert ranked and all(p.t_iter > 0 for p in ranked)
    assert len(ranked) + len(excluded) == len(factorizations(4)) and all(p.excluded for p in excluded)
    # A width that no grid axis of 4 divides is excluded with the layer's name.
    odd = ModuleWorkload.record(torch.nn.Linear(30, 6), torch.zeros(8, 30))
    assert "Linear0 (30 -> 6) does not divide the grid" in predict(odd, dict(x=1, y=4, z=1, data=1), machine).excluded


def test_overlap_hides_communication_only_behind_compute():
    """The full model with overlap: nothing hidden without compute; with ample compute only
    what cannot overlap stays exposed (forward all-reduces, norm and loss collectives, the
    first gather, the last reduce-scatter and bucket); every added switch hides more, never
    less; and Overlap.none() is the synchronous prediction."""
    from itertools import combinations

    from par4d.overlap import NAMES, Overlap
    from par4d.plan.terms import ROLES, exposed_comm, layer_terms

    spec = GPTSpec("t", n_layer=2, hidden=64, heads=4, seq_len=32, global_batch=8, vocab=256)
    for sizes in (dict(x=2, y=1, z=2, data=1), dict(x=1, y=1, z=2, data=2), dict(x=2, y=2, z=2, data=2)):
        sync = predict(spec, sizes, NODE4, "full", compute_seconds=1.0)
        assert sync.t_exposed is None and sync.t_iter == pytest.approx(1.0 + sync.t_comm)
        none = predict(spec, sizes, NODE4, "full", compute_seconds=1.0, overlap=Overlap.none())
        assert none.t_exposed == pytest.approx(sync.t_comm)
        idle = predict(spec, sizes, NODE4, "full", compute_seconds=0.0, overlap=Overlap())
        assert idle.t_exposed == pytest.approx(idle.t_comm)            # nothing to hide behind
        previous = sync.t_comm
        for count in range(1, len(NAMES) + 1):                         # none < oar < +ors < ... (Fig. 3's order)
            names = NAMES[:count]
            pred = predict(spec, sizes, NODE4, "full", compute_seconds=1.0, overlap=Overlap.parse(",".join(names)))
            assert pred.t_exposed <= previous + 1e-15, (sizes, names)
            previous = pred.t_exposed
        for r in range(len(NAMES) + 1):
            for names in combinations(NAMES, r):
                settings = Overlap.parse(",".join(names)) if names else Overlap.none()
                pred = predict(spec, sizes, NODE4, "full", compute_seconds=1.0, overlap=settings)
                assert previous - 1e-15 <= pred.t_exposed <= sync.t_comm + 1e-15, (sizes, names)

    # Ample compute: exactly what cannot overlap, by hand from the per-role terms.
    sizes = dict(x=2, y=1, z=2, data=2)
    beta = bandwidths(sizes, NODE4, aware=True)
    roles = {r: 0.0 for r in ROLES}
    for layer in spec.layers():
        for (_, role), t in layer_terms(layer, sizes, beta, 1, NODE4.latency, NODE4, False).items():
            roles[role] += t
    gathers = sum(layer.count for layer in spec.layers())
    exposed = exposed_comm(roles, 1e6, Overlap(), gathers, buckets=2, checkpointing=False)
    # xy: the layers' forward sums of the first of 2 row chunks hide; the other forward collectives never do.
    assert roles["in_sum"] > 0
    assert exposed == pytest.approx(roles["forward"] + roles["in_sum"] / 2 + roles["backward"]
                                    + roles["gather"] / gathers + roles["reduce_scatter"] / gathers + roles["sync"] / 2)


def _profile(tmp_path, line: str):
    """NODE4's profile with ``line`` in place of its key's line (or added to [machine])."""
    key = line.partition(" = ")[0]
    lines = [kept for kept in NODE4.to_toml().splitlines() if kept.partition(" = ")[0] != key]
    path = tmp_path / "m.toml"
    path.write_text("\n".join([*lines, line]) + "\n")
    return path


@pytest.mark.parametrize("line, message", [
    ("devices_per_node = true", "machine.devices_per_node must be a number, got True"),
    ("peak_flops = false", "machine.peak_flops must be a number, got False"),
    ("beta_inter = nan", "machine.beta_inter must be a finite number, got nan"),
    ("memory_bytes = inf", "machine.memory_bytes must be a finite number, got inf"),
    ("latency = -inf", "machine.latency must be a finite number, got -inf"),
    ("devices_per_node = 2.5", "machine.devices_per_node must be a whole number, got 2.5"),
    ("bytes_per_element = 1.5", "machine.bytes_per_element must be a whole number, got 1.5"),
    ("beta_intra = -1e9", "machine.beta_intra must be > 0, got -1000000000.0"),
    ("devices_per_node = 0", "machine.devices_per_node must be > 0, got 0"),
    ("memory_bytes = 0", "machine.memory_bytes must be > 0, got 0"),
    ("all_gather_scale = -0.5", "machine.all_gather_scale must be > 0, got -0.5"),
    ("latency = -1e-6", "machine.latency must be >= 0, got -1e-06"),
    ("efficiency = 1.5", "machine.efficiency is a fraction of peak, in (0, 1]; got 1.5"),
    ("cores_shared = 0.5", "machine.cores_shared counts ranks per core, at least 1; got 0.5"),
    ("comm_cpu_share = 2", "machine.comm_cpu_share is a share, in [0, 1]; got 2"),
    ("name = 3", "machine.name must be a non-empty string, got 3"),
    ('peak_flops = "fast"', "machine.peak_flops must be a number, got 'fast'"),
    ("gpus_per_node = 4", "unknown keys ['gpus_per_node'] in [machine]"),
    ("staged = 1", "machine.staged must be true or false, got 1"),
    ("host_bandwidth = 0", "machine.host_bandwidth must be > 0, got 0"),
    ("reduce_scatter_scale_inter = -0.4", "machine.reduce_scatter_scale_inter must be > 0, got -0.4"),
])
def test_machine_profile_values_are_checked(tmp_path, line, message):
    path = _profile(tmp_path, line)
    with pytest.raises(ValueError) as error:
        load_machine(str(path))
    assert str(error.value).startswith(f"{path}: {message}"), str(error.value)


def test_machine_profile_syntax_error_names_the_file(tmp_path, capsys):
    path = tmp_path / "broken.toml"
    path.write_text('[machine]\nname = "m\ndevices_per_node = 4\n')
    with pytest.raises(ValueError, match=r"broken\.toml: not valid TOML: .*line 2, column"):
        load_machine(str(path))
    assert main(["plan", "--gpus", "8", "--machine", str(path)]) == 2
    assert f"par4d plan: error: {path}: not valid TOML" in capsys.readouterr().err


def test_machine_profiles_that_load(tmp_path):
    # A whole float is the count it names; 0 latency is the paper's model; an int peak is a number.
    machine = load_machine(str(_profile(tmp_path, "devices_per_node = 4.0")))
    assert machine.devices_per_node == 4 and type(machine.devices_per_node) is int
    assert load_machine(str(_profile(tmp_path, "latency = 0"))).latency == 0
    assert load_machine(str(_profile(tmp_path, "peak_flops = 312"))).peak_flops == 312
    staged = load_machine(str(_profile(tmp_path, "staged = true")))      # and it writes back as TOML's true
    assert staged.staged is True and "staged = true" in staged.to_toml()
    # The profiles in docs/ (written by par4d calibrate, with their [fit] tables) load.
    bundled = sorted((Path(__file__).parent.parent / "docs" / "profiles").glob("*.toml"))
    assert len(bundled) >= 4
    for path in bundled:
        assert load_machine(str(path)).name == path.stem
    # Built in code, the same checks hold.
    for bad in (dict(devices_per_node=True), dict(peak_flops=math.inf), dict(bytes_per_element=2.5)):
        with pytest.raises(ValueError, match=f"machine 'test': {next(iter(bad))} must be"):
            replace(NODE4, **bad)


def test_what_calibrate_writes_loads(tmp_path):
    from par4d.measure.calibrate import _toml_fit

    machine = Machine('emulated-2x2-"1gbit"', devices_per_node=2, peak_flops=52270423031.342705,
                      memory_bytes=6331317248.0, beta_intra=611201825.4235398, beta_inter=126612047.76046872,
                      latency=0.0005996755236718624, efficiency=0.5, bytes_per_element=4,
                      all_gather_scale=0.6679025336063775, reduce_scatter_scale=0.487086089044996,
                      memory_bandwidth=1.9e10, kernel_latency=2.8e-6, layer_overhead=5.8e-5)
    fits = {"all_reduce": {"alpha": 6e-4, "beta": 6.1e8, "points": 8, "c1": 6e-3, "c2": 1e-8, "c3": -6e-3},
            "gemm": {"efficiency": 0.97, "kernel_latency": 2.8e-6, "memory_bandwidth": 1.9e10, "median_error": 0.04,
                     "points": 36}}
    path = tmp_path / "local.toml"
    path.write_text(_toml_fit(machine, fits, 2.09e11, 4))
    assert load_machine(str(path)) == machine


def test_the_gemm_fit_recovers_a_roofline():
    """GEMM times made from a known roofline (with 5% noise either way, alternating) give back its efficiency
    and kernel latency."""
    from par4d.measure.calibrate import GEMM_ROWS, GEMM_SIDES, fit_gemms
    from par4d.plan.compute import gemm_seconds

    truth = Machine("cpu", devices_per_node=1, peak_flops=5e10, memory_bytes=1e10, beta_intra=1e9, beta_inter=1e9,
                    efficiency=0.8, memory_bandwidth=1e10, kernel_latency=3e-6, bytes_per_element=4)
    shapes = [(m, n, k) for m in GEMM_ROWS for n in GEMM_SIDES for k in GEMM_SIDES]
    rows = [{"m": m, "n": n, "k": k, "seconds": gemm_seconds(m, n, k, truth) * (1.05 if i % 2 else 0.95)}
            for i, (m, n, k) in enumerate(shapes)]
    fitted = fit_gemms(rows, truth.peak_flops, truth.memory_bandwidth)
    assert fitted["efficiency"] == pytest.approx(0.8, abs=0.05)
    assert fitted["kernel_latency"] == pytest.approx(3e-6, rel=0.3) and fitted["median_error"] <= 0.06
    exact = fit_gemms([dict(r, seconds=gemm_seconds(r["m"], r["n"], r["k"], truth)) for r in rows],
                      truth.peak_flops, truth.memory_bandwidth)
    assert exact["efficiency"] == 0.8 and exact["kernel_latency"] == pytest.approx(3e-6, rel=1e-6)


def test_calibrate_never_overwrites_a_profile(tmp_path, capsys, monkeypatch):
    import par4d.measure.calibrate

    calls = []

    def measured(nproc, out, repeats, cluster):     # par4d calibrate's work, without measuring anything
        calls.append(out)
        out.write_text("measured\n")
        return {"machine": NODE4, "fits": {}, "peak_total": 1e9, "world": nproc,
                "gemm": {"efficiency": 0.9, "kernel_latency": 1e-6, "memory_bandwidth": 1e10, "median_error": 0.05,
                         "points": 36, "attention_efficiency": 0.5},
                "sync": {"p": nproc, "compute_seconds": 3e-3, "collective_seconds": 1e-3, "both_seconds": 4.5e-3,
                         "sync_seconds": 5e-4},
                "host": {"microbatch_seconds": 1.5e-3, "layer_overhead": 4e-5, "step_seconds": 4e-3, "batch": 4,
                         "seq_len": 2, "layer_passes": 51}}

    monkeypatch.setattr(par4d.measure.calibrate, "calibrate", measured)
    profile = tmp_path / "local.toml"
    profile.write_text("mine\n")
    assert main(["calibrate", "--out", str(profile)]) == 2
    assert (f"par4d calibrate: error: --out {profile} already exists; pass --force to overwrite it, or choose "
            f"another --out" in capsys.readouterr().err)
    assert main(["calibrate", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(profile / "sub.toml")]) == 2
    assert f"{profile} is a file, not a folder" in capsys.readouterr().err
    assert profile.read_text() == "mine\n" and calls == []
    assert main(["calibrate", "--out", str(profile), "--force"]) == 0
    assert profile.read_text() == "measured\n" and calls == [profile]


def test_plan_validate_never_overwrites_its_plot(tmp_path, capsys):
    from par4d.cli import main

    plot = tmp_path / "ranking.png"
    plot.write_bytes(b"a figure the user keeps")
    assert main(["plan", "validate", "--nproc", "2", "--plot", str(plot)]) == 2
    assert f"--plot {plot} already exists; pass --force to overwrite it" in capsys.readouterr().err
    assert plot.read_bytes() == b"a figure the user keeps"


def _two_by_two(staged: bool) -> Machine:
    return Machine("2x2", devices_per_node=2, peak_flops=1e12, memory_bytes=1e12, beta_intra=10e9, beta_inter=1e9,
                   staged=staged)


def test_group_placement_and_staged_time_are_the_stages_ring_times():
    from par4d.plan.collectives import collective_time, group_placement, staged_time

    sizes = {"x": 1, "y": 1, "z": 1, "data": 4}
    assert group_placement(sizes, ("data",), 2) == (1, 2, 2)              # 2 per node, 2 nodes
    assert group_placement({**sizes, "x": 2, "data": 2}, ("data",), 2) == (2, 1, 2)   # one per node
    assert group_placement({**sizes, "z": 2, "data": 2}, ("z", "data"), 2) == (1, 2, 2)
    m, machine = 3.5e6, _two_by_two(staged=True)
    # Inside: reduce-scatter of m and all-gather of m/2 over 2 ranks at 10 GB/s; across: the m/2 share all-reduced
    # over 2 nodes, the node's link shared by its 2 link rings (0.5 GB/s each).
    assert staged_time("all_reduce", ("data",), sizes, m, machine) == pytest.approx(
        0.5 * m / 10e9 + 1.0 * (m / 2) / 0.5e9 + 1.0 * (m / 2) / 10e9)
    flat = ring_time("all_reduce", 4, m, 1e9)        # Eq 10: one ring crossing the link
    assert flat == pytest.approx(1.5 * m / 1e9)
    assert collective_time("all_reduce", ("data",), sizes, m, 1e9, 0.0, machine) == staged_time(
        "all_reduce", ("data",), sizes, m, machine) < flat
    assert collective_time("all_reduce", ("data",), sizes, m, 1e9, 0.0, _two_by_two(staged=False)) == flat
    assert staged_time("all_reduce", ("data",), {**sizes, "x": 2, "data": 2}, m, machine) is None
    # z's all-gather of a shard s: across the link first (s to the other node), then the node's 2 shards inside.
    s = 1e5
    assert staged_time("all_gather", ("data",), sizes, s, machine) == pytest.approx(s / 0.5e9 + 2 * s / 10e9)


def test_all_gather_and_reduce_scatter_take_their_own_scale_across_nodes():
    """A profile measures each kind's bandwidth inside a node and across: a group that spans nodes prices its
    all-gathers and reduce-scatters at the scale across (relative to beta_inter), one inside at the scale inside;
    without a scale across, the one inside serves both."""
    from par4d.plan.collectives import across_nodes, kind_scale, staged_time
    from par4d.plan.terms import layer_terms

    assert across_nodes({"x": 2, "y": 1, "z": 2, "data": 2}, _two_by_two(staged=False)) == {
        "x": False, "y": False, "z": True, "data": True}
    assert across_nodes({"x": 1, "y": 1, "z": 2, "data": 2, "pipe": 2}, _two_by_two(staged=False))["z"] is False
    both = replace(_two_by_two(staged=False), all_gather_scale=0.5, reduce_scatter_scale=0.25,
                   all_gather_scale_inter=0.8, reduce_scatter_scale_inter=0.4)
    inside_only = replace(both, all_gather_scale_inter=None, reduce_scatter_scale_inter=None)
    assert [kind_scale(k, both, a) for k in ("all_gather", "reduce_scatter", "all_reduce") for a in (False, True)] \
        == [0.5, 0.8, 0.25, 0.4, 1.0, 1.0]
    assert [kind_scale(k, inside_only, True) for k in ("all_gather", "reduce_scatter")] == [0.5, 0.25]
    assert kind_scale("all_gather", None, True) == 1.0
    # z = 4 over 2-device nodes spans both: its gather and reduce-scatter at 0.8 and 0.4 of beta_inter (1 GB/s, one
    # ring: x = y = 1); z = 2 stays inside, at 0.5 and 0.25 of beta_intra (10 GB/s).
    layer = Layer("fc", m=64, k=256, n=512)
    beta = {"x": 10e9, "y": 10e9, "z": 1e9, "data": 1e9}
    far = layer_terms(layer, {"x": 1, "y": 1, "z": 4, "data": 1}, beta, 2, 0.0, both)
    assert far["z", "gather"] == pytest.approx(3 * (256 * 512 / 4 * 2) / (1e9 * 0.8), rel=1e-12)
    assert far["z", "reduce_scatter"] == pytest.approx(3 / 4 * (256 * 512 * 2) / (1e9 * 0.4), rel=1e-12)
    near = layer_terms(layer, {"x": 1, "y": 1, "z": 2, "data": 2}, {**beta, "z": 10e9}, 2, 0.0, both)
    assert near["z", "gather"] == pytest.approx(1 * (256 * 512 / 2 * 2) / (10e9 * 0.5), rel=1e-12)
    # Staged (2 per node, 2 nodes): the link stage at the scale across, the node's at the scale inside.
    staged = replace(both, staged=True)
    s = 1e5
    assert staged_time("all_gather", ("data",), {"x": 1, "y": 1, "z": 1, "data": 4}, s, staged) == pytest.approx(
        s / (0.5e9 * 0.8) + 2 * s / (10e9 * 0.5))


def test_the_planner_prices_staged_sync_and_hidden_xy_sums():
    from par4d.overlap import Overlap
    from par4d.plan.terms import ROLES, exposed_comm

    spec = GPTSpec("t", n_layer=2, hidden=256, heads=4, seq_len=32, global_batch=4, vocab=256)
    sizes = {"x": 1, "y": 1, "z": 1, "data": 4}
    flat, staged = (predict(spec, sizes, _two_by_two(s), "full") for s in (False, True))
    assert staged.t_comm_axes["data"] < flat.t_comm_axes["data"]
    roles = dict.fromkeys(ROLES, 0.0) | {"in_sum": 1.0}
    without, with_xy = (exposed_comm(roles, 100.0, Overlap.parse(names), 0, 0, False) for names in ("oar", "oar,xy"))
    assert without == 1.0 and with_xy == pytest.approx(0.5)     # 2 row chunks: the first chunk's sum hidden


def test_ties_go_to_the_grid_that_communicates_least():
    from par4d.measure.choose import settle_ties, why
    from par4d.plan.cost import Prediction

    fast = Prediction({"x": 1, "y": 1, "z": 2, "data": 2}, t_iter=1.000, t_comm=0.30, t_compute=0.9, t_exposed=0.1)
    quiet = Prediction({"x": 1, "y": 1, "z": 1, "data": 4}, t_iter=1.015, t_comm=0.10, t_compute=0.9, t_exposed=0.1)
    slow = Prediction({"x": 2, "y": 1, "z": 2, "data": 1}, t_iter=1.100, t_comm=0.05, t_compute=0.9, t_exposed=0.2)
    assert settle_ties([fast, quiet, slow]) == [quiet, fast, slow]       # within 2%: the quieter first; 10%: not a tie
    assert "a tie: 0.100 s of communication against 0.300 s" in why([quiet, fast, slow])
    assert "a tie" not in why([fast, slow])
