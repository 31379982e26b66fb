"""--compile (par4d.compiled): each block compiled as a region, par4d's collectives graph breaks between fused
regions. Exactness in float64 against the single-device twin on an 8-rank grid (4-rank grids in
tests/test_context.py and tests/test_hf_moe.py); one graph per block and none compiled again over microbatches
and pipeline stages; checkpoints indifferent to it. The tests compile with AOTAutograd's eager backend (no C++
compiler on the machine is assumed); Inductor is measured in docs/benchmarks.md."""

import subprocess
import sys

import pytest
import torch

from par4d.compiled import compile_blocks, counted, regions
from tests import cases
from tests.cases import GPT_CONFIG, compare_gpt_with_twin
from tests.helpers import SMALL, run_losses, train_pooled


def _compiled_twin(sizes: dict) -> tuple[int, int, int]:
    """The compiled GPT against its twin (float64, loss, every gradient, AdamW steps); the blocks compiled and
    the graphs and graph breaks dynamo made for them."""
    torch._dynamo.reset()      # (the pool's ranks live on: no graph from another test's model is reused)
    before = counted()
    with cases.float64():
        compare_gpt_with_twin(cases.grid(**sizes), sizes, GPT_CONFIG, compile="aot_eager")
    graphs, breaks = counted()
    return GPT_CONFIG.n_layer, graphs - before[0], breaks - before[1]


def test_compiled_blocks_are_the_twin_in_float64_8_ranks(pool8):
    """On x=2,z=2,data=2 each block's all-gathers, all-reduces and reduce-scatters are graph breaks: several
    graphs a block, exact all the same. (4 ranks: context=2,data=2 in tests/test_context.py, DeepSeek-V3 on
    data=4,expert=4 in tests/test_hf_moe.py.)"""
    for blocks, graphs, breaks in pool8.run(_compiled_twin, dict(x=2, z=2, data=2), timeout=300):
        assert blocks == 2 and graphs > 1 and breaks > 0


def _train_compiled(pool, tmp_path, name: str, *flags: str) -> dict:
    pool.run(torch._dynamo.reset)
    return train_pooled(pool, *SMALL, "--steps", "3", "--out", str(tmp_path / name), *flags)


def test_par4d_train_compiles_each_block_once_and_its_checkpoints_are_the_eager_models(tmp_path, pool4):
    """data=4 over 2 microbatches: one graph (the blocks share their code), no break, nothing compiled again
    after the first step but the graph evaluation runs without gradients; its first loss is the eager run's to
    round-off (fp32: one forward's sums of at most a few hundred terms, far inside 1e-5 on any CPU); an eager run
    resumes from its checkpoint. On pipe=2 too."""
    grid = ["--grid", "data=4", "--microbatches", "2", "--n-layer", "2", "--eval-every", "2"]
    made = _train_compiled(pool4, tmp_path, "compiled", *grid, "--compile", "aot_eager")["compiled"]
    assert (made["blocks"], made["graphs"], made["graph_breaks_per_block"], made["recompiled_graphs"]) == (2, 1, 0, 0)
    assert made["evaluation_graphs"] == 1       # evaluating after step 2: the blocks without gradients
    eager = _train_compiled(pool4, tmp_path, "eager", *grid)
    assert "compiled" not in eager
    first, plain = run_losses(tmp_path / "compiled")[0], run_losses(tmp_path / "eager")[0]
    assert abs(first - plain) <= 1e-5 * plain
    summary = train_pooled(pool4, "--resume", str(tmp_path / "compiled"), "--steps", "4", "--compile", "none")
    assert summary["start_step"] == 3 and "compiled" not in summary
    made = _train_compiled(pool4, tmp_path, "pipe", "--grid", "pipe=2,data=2", "--n-layer", "2",
                           "--compile", "aot_eager")["compiled"]
    assert made["blocks"] == 1 and made["recompiled_graphs"] == 0


def test_eager_functions_break_a_graph_as_torch_compiler_disable_does():
    """par4d.eager marks its collectives without importing torch._dynamo (0.9 s a process): a compiled function
    stops at the call exactly as ``torch.compiler.disable`` makes it (the same graphs and breaks) and traces
    nothing inside."""
    from par4d.eager import eager, skip_wrappers

    inside = []

    def add_one(t):
        inside.append(torch.compiler.is_compiling())
        return t + 1

    def made(wrap) -> tuple[int, int]:
        torch._dynamo.reset()
        skip_wrappers()
        wrapped = wrap(add_one)
        before = counted()
        out = torch.compile(lambda t: wrapped(t.sin()).cos(), backend="eager")(torch.ones(3))
        assert torch.equal(out, (torch.ones(3).sin() + 1).cos())
        return counted()[0] - before[0], counted()[1] - before[1]

    assert made(eager) == made(torch.compiler.disable) == (2, 1)
    assert inside == [False, False]
    imported = subprocess.run([sys.executable, "-c", "import sys, par4d.comm, par4d.overlap.runtime, par4d.train.job; "
                               "print('torch._dynamo' in sys.modules)"], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "False"


def test_what_cannot_be_compiled_is_refused():
    with pytest.raises(ValueError, match="Linear has no block par4d knows to compile"):
        compile_blocks(torch.nn.Linear(2, 2), "aot_eager")
    with pytest.raises(ValueError, match="--compile 'tvm': give one of inductor, aot_eager or none"):
        compile_blocks(torch.nn.Linear(2, 2), "tvm")


def test_transformers_decoder_layers_are_the_regions():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert [type(m).__name__ for m in regions(model)] == ["LlamaDecoderLayer"] * 3
    layer = model.model.layers[0]       # FSDP2's fully_shard makes a layer an instance of a subclass of its own
    layer.__class__ = type("FSDPLlamaDecoderLayer", (type(layer),), {})
    assert [type(m).__name__ for m in regions(model)] == ["FSDPLlamaDecoderLayer"] + ["LlamaDecoderLayer"] * 2
