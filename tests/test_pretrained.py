"""Fine-tuning from a pretrained Hugging Face folder (``par4d train --model hf-llama|hf-gpt2 --init-from hf
DIR``): every rank of a 3D grid reads its slices of a sharded bf16 or single fp32 folder and computes the
logits ``transformers`` computes; a fine-tuned run exports back as the same kind of folder, which
``transformers`` loads; a folder par4d must not read (code, pickles, files outside it) is refused by name
before any rank starts."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from par4d.cli import main
from par4d.grid import Grid
from par4d.layout import shard_batch
from tests import cases
from tests.helpers import checked_config, train_pooled

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(7))
LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
GPT2 = dict(vocab_size=260, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def _save(folder: Path, family: str, tied: bool, dtype: torch.dtype, shard: str) -> Path:
    """A pretrained-shaped model folder, random weights, as ``save_pretrained`` writes it."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=tied))
    else:
        model = GPT2LMHeadModel(GPT2Config(**GPT2, tie_word_embeddings=tied))
    model.to(dtype).save_pretrained(folder, max_shard_size=shard)
    return folder


def _transformers_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _logits_on_grid(config, sizes: dict) -> torch.Tensor:
    """This rank's logits (its samples) of the run's model, its weights read from the pretrained folder."""
    from par4d.train.recipes import build_model

    grid = cases.grid(**sizes)
    model = build_model(config, grid)
    with torch.no_grad():
        return model(shard_batch(grid, TOKENS))


def _grid_logits(pool, folder: Path, model: str, sizes: dict) -> list[torch.Tensor]:
    grid = ",".join(f"{a}={n}" for a, n in sizes.items())
    config = checked_config("--model", model, "--init-from", "hf", str(folder), "--grid", grid, "--seq-len", "16",
                            "--batch-size", "4", world=pool.world)
    return pool.run(_logits_on_grid, config, sizes)


def _rows(rank: int, sizes: dict) -> slice:
    """The samples of ``rank`` on ``sizes`` (z and data split them; par4d's rank order: x fastest)."""
    return shard_batch(Grid.virtual(sizes, rank), torch.arange(len(TOKENS)))


@pytest.mark.parametrize("family,tied,dtype,shard", [("llama", True, torch.bfloat16, "20KB"),
                                                     ("llama", False, torch.float32, "50MB"),
                                                     ("gpt2", True, torch.float32, "30KB"),
                                                     ("gpt2", "in config only", torch.float32, "50MB")])
def test_every_rank_of_a_3d_grid_computes_the_logits_transformers_does(pool8, tmp_path, capsys, family, tied, dtype,
                                                                       shard):
    """"in config only": config.json says tie_word_embeddings, but the weights hold a head of their own. par4d
    follows the weights (tying would drop the head), as transformers does, and says so."""
    folder = _save(tmp_path / "pretrained", family, tied is True, dtype, shard)
    assert (folder / "model.safetensors.index.json").is_file() == (shard != "50MB")
    expected = _transformers_logits(folder)
    if tied == "in config only":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        # transformers too keeps the head (and warns): par4d matches it, whatever the config says
        torch.testing.assert_close(_transformers_logits(folder), expected, rtol=0, atol=0)
    sizes = dict(x=2, y=2, z=2)
    for rank, logits in enumerate(_grid_logits(pool8, folder, f"hf-{family}", sizes)):
        torch.testing.assert_close(logits, expected[_rows(rank, sizes)], rtol=0, atol=1e-5)
    said = "tie_word_embeddings is true, but the folder's weights hold an lm_head.weight of its own"
    assert (said in capsys.readouterr().out) == (tied == "in config only")


def test_a_fine_tuned_run_exports_a_folder_transformers_loads(pool4, tmp_path, capsys):
    """2 steps from a sharded bf16 Llama on x=2,z=2; exported in shards; transformers computes the logits par4d
    computes from the export on another grid (z=2,data=2), and the weights have moved from the pretrained ones."""
    from transformers import AutoModelForCausalLM

    pretrained = _save(tmp_path / "pretrained", "llama", True, torch.bfloat16, "20KB")
    run, out = tmp_path / "run", tmp_path / "exported"
    train_pooled(pool4, "--model", "hf-llama", "--init-from", "hf", str(pretrained), "--grid", "x=2,z=2",
                 "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--lr", "1e-2", "--out", str(run),
                 "--no-progress")
    assert main(["export", "--run", str(run), "--to", "hf", str(out), "--max-shard-mb", "0.03"]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]         # tied: written once, as save_pretrained does
    assert len(set(index["weight_map"].values())) > 1
    expected = _transformers_logits(out)
    sizes = dict(z=2, data=2)
    for rank, logits in enumerate(_grid_logits(pool4, out, "hf-llama", sizes)):
        torch.testing.assert_close(logits, expected[_rows(rank, sizes)], rtol=0, atol=1e-5)
    before = {k: v.float() for f in pretrained.glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(before) == sorted(after)
    assert all(not torch.equal(before[k], after[k]) for k in after if k.endswith("proj.weight"))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    generated = model.generate(TOKENS[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 7)

    # Exported again, into the same folder as one file: the earlier shards and index are removed, nothing else
    (out / "notes.txt").write_text("mine")
    assert main(["export", "--run", str(run), "--to", "hf", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    torch.testing.assert_close(_transformers_logits(out), expected, rtol=0, atol=0)


def _refused(capsys, folder: Path, *flags: str, model: str = "hf-llama") -> str:
    out = folder.parent / "run"
    assert main(["train", "--model", model, "--init-from", "hf", str(folder), "--nproc", "1", "--steps", "1",
                 "--seq-len", "16", "--batch-size", "4", "--out", str(out), *flags]) == 2
    assert not out.exists()
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A good folder per family (Mistral's and Qwen2's configs on Llama's weights: their fields are checked
    before any weight is)."""
    base = tmp_path_factory.mktemp("families")
    found = {family: _save(base / family, family, True, torch.float32, "50MB") for family in ("llama", "gpt2")}
    for family in ("mistral", "qwen2"):
        found[family] = base / family
        found[family].mkdir()
        (found[family] / "model.safetensors").symlink_to(found["llama"] / "model.safetensors")
        config = json.loads((found["llama"] / "config.json").read_text())
        (found[family] / "config.json").write_text(json.dumps({**config, "model_type": family}))
    return found


ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
               "original_max_position_embeddings": 16}
# (family, config.json's changed fields, what the one line says): each rule of par4d.adopt.hf_config's tables
BAD_FIELDS = [
    ("llama", {"num_hidden_layers": "2"}, 'num_hidden_layers is "2" (a string, not an integer >= 1)'),
    ("llama", {"hidden_size": -32}, "hidden_size is -32 (not an integer >= 1)"),
    ("llama", {"intermediate_size": 64.0}, "intermediate_size is 64.0 (float, not an integer >= 1)"),
    ("llama", {"vocab_size": None}, "vocab_size is null (null, not an integer >= 1)"),
    ("llama", {"max_position_embeddings": 0}, "max_position_embeddings is 0 (not an integer >= 1)"),
    ("llama", {"num_attention_heads": 3, "head_dim": None}, "3 attention heads do not divide the hidden size 32"),
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads is 0 (not an integer >= 1)"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("llama", {"head_dim": 7}, "each head is 7 wide, odd: rotary embeddings turn pairs"),
    ("llama", {"hidden_act": "nonexistent_act"}, 'hidden_act is "nonexistent_act" (not one of gelu, '),
    ("llama", {"rms_norm_eps": -1e-06}, "rms_norm_eps is -1e-06 (not a finite number > 0)"),
    ("llama", {"rope_theta": -1}, "rope_theta is -1 (not a finite number > 0)"),
    ("llama", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "par4d reads bf16, fp16 or fp32 weights, not quantized ones"),
    ("llama", {"attention_bias": "no"}, 'attention_bias is "no" (a string, not true or false)'),
    ("llama", {"tie_word_embeddings": 1}, "tie_word_embeddings is 1 (int, not true or false)"),
    ("llama", {"rope_scaling": "yes"}, 'rope_scaling is "yes" (a string, not an object of rope_type'),
    ("llama", {"rope_scaling": {"rope_type": "nonsense"}}, 'of rope_type "nonsense", not one of default, linear'),
    ("llama", {"rope_scaling": {"type": "linear", "factor": -2.0}}, 'with factor -2.0 (not a finite number >= 1)'),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor (it needs factor, "),
    ("llama", {"rope_scaling": ROPE_LLAMA3}, "high_freq_factor not above low_freq_factor"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}},
     "with original_max_position_embeddings 0 (not an integer >= 1)"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": "big"}},
     'with rope_theta "big" (not a finite number > 0)'),
    ("llama", {"bos_token_id": -1}, "bos_token_id is -1 (not a token id"),
    ("llama", {"attention_dropout": 1.5}, "attention_dropout is 1.5 (not a number from 0 up to 1)"),
    ("mistral", {"sliding_window": 0}, "sliding_window is 0 (not an integer >= 1)"),
    ("qwen2", {"use_sliding_window": "on"}, 'use_sliding_window is "on" (a string, not true or false)'),
    ("qwen2", {"max_window_layers": -1}, "max_window_layers is -1 (not an integer >= 0)"),
    ("gpt2", {"n_head": 3}, "3 attention heads do not divide the hidden size 32"),
    ("gpt2", {"n_layer": True}, "n_layer is true (a boolean, not an integer >= 1)"),
    ("gpt2", {"activation_function": "nope"}, 'activation_function is "nope" (not one of gelu'),
    ("gpt2", {"layer_norm_epsilon": 0}, "layer_norm_epsilon is 0 (not a finite number > 0)"),
    ("gpt2", {"n_inner": 0}, "n_inner is 0 (not an integer >= 1)"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention is true (not false: par4d trains decoder-only"),
    # Sizes that pass every rule but make a model no machine holds: refused by the count, nothing built
    ("llama", {"num_hidden_layers": 1000000}, "has 9,280,009,632 parameters; their values, gradients and AdamW"),
    ("gpt2", {"n_embd": 1 << 24}, "has 6,755,405,346,635,776 parameters"),
]


@pytest.mark.parametrize("family,changes,said", BAD_FIELDS, ids=[f"{f}-{next(iter(c))}" for f, c, _ in BAD_FIELDS])
def test_every_field_of_a_config_is_checked_before_any_rank_starts(folders, tmp_path, capsys, family, changes, said):
    """One line naming config.json, the field and its value; no transformers or torch traceback, no run folder.
    A million decoder layers are counted, not built: refused at once."""
    folder = tmp_path / family
    folder.mkdir()
    for path in folders[family].iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path.resolve())
    config = json.loads((folders[family] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    err = _refused(capsys, folder, model="hf-gpt2" if family == "gpt2" else "hf-llama")
    assert said in err and "Traceback" not in err
    assert str(folder / "config.json") in err or "parameters" in err
    assert len(err.strip().splitlines()) == 1


def test_a_folder_par4d_must_not_read_is_refused_before_any_rank_starts(tmp_path, capsys):
    good = _save(tmp_path / "good", "llama", True, torch.bfloat16, "20KB")
    config = json.loads((good / "config.json").read_text())
    index = json.loads((good / "model.safetensors.index.json").read_text())

    def variant(name: str, config_changes: dict | None = None, weight_map: dict | None = None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for path in good.glob("*.safetensors"):
            (folder / path.name).write_bytes(path.read_bytes())
        (folder / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
        (folder / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map
                                                                         or index["weight_map"]}))
        return folder

    code = variant("code", {"auto_map": {"AutoModelForCausalLM": "modeling_evil.Evil"}})
    assert "has auto_map: the model is code shipped in the folder, which par4d never runs" in _refused(capsys, code)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    assert "pytorch_model.bin, a pickle, which par4d never loads" in _refused(capsys, pickled)
    outside = variant("outside", weight_map={**index["weight_map"], "lm_head.weight": "../elsewhere.safetensors"})
    assert "the index may name files by their bare names only" in _refused(capsys, outside)
    gone = variant("gone")
    first = sorted(gone.glob("model-*.safetensors"))[0]
    first.unlink()
    assert f"names {first.name}, which is not in {gone}" in _refused(capsys, gone)
    other = variant("other", {"model_type": "gpt2"})
    assert "model_type is 'gpt2'; --model hf-llama starts from llama, mistral, qwen2" in _refused(capsys, other)
    assert re.search(r"--n-embd 64, but .*config.json gives the model hidden_size 32: a pretrained model keeps its "
                     r"shape", _refused(capsys, good, "--n-embd", "64"))
    assert "--seq-len 128 exceeds the 64 positions of the model in" in _refused(capsys, good, "--seq-len", "128")

    lacking = variant("lacking")
    shard = next(p for p in lacking.glob("model-*.safetensors") if "model.norm.weight" in load_file(p))
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    weight_map = {k: v for k, v in index["weight_map"].items() if k != "model.norm.weight"}
    (lacking / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    assert "model.norm.weight is not in the file" in _refused(capsys, lacking)


@pytest.mark.parametrize("family,sizes", [
    ("llama", dict(LLAMA)),
    ("llama", dict(LLAMA, num_key_value_heads=1, head_dim=12, attention_bias=True, mlp_bias=True,
                   tie_word_embeddings=True)),
    ("mistral", dict(LLAMA, head_dim=6)),
    ("qwen2", dict(LLAMA, tie_word_embeddings=True)),
    ("qwen2", dict(LLAMA, num_key_value_heads=4)),
    ("gpt2", dict(GPT2)),
    ("gpt2", dict(GPT2, n_inner=40, tie_word_embeddings=False)),
    ("mixtral", dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)),
    ("mixtral", dict(LLAMA, num_local_experts=3, tie_word_embeddings=True)),
    ("qwen3_moe", dict(LLAMA, moe_intermediate_size=16, num_experts=4, head_dim=12, mlp_only_layers=[0],
                       attention_bias=True)),
    ("qwen3_moe", dict(LLAMA, num_hidden_layers=4, moe_intermediate_size=16, num_experts=6, decoder_sparse_step=2)),
    ("olmoe", dict(LLAMA, num_experts=6, attention_bias=True)),
])
def test_a_configs_parameter_count_is_the_models(family, sizes):
    """The count the memory check uses (from the config's numbers, nothing built) is exactly the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from par4d.adopt.hf_config import check_hf_config, parameter_count

    check_hf_config({"model_type": family, **sizes}, "config.json")
    hf = AutoConfig.for_model(family, **sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert parameter_count(hf) == sum(p.numel() for p in model.parameters())


def test_a_loss_that_is_not_finite_before_any_update_blames_the_weights_not_the_learning_rate(tmp_path):
    """A pretrained folder whose final norm holds a NaN: the first step's loss is NaN; the one line says the
    folder's weights or config are at fault (no update has happened), not the learning rate."""
    folder = _save(tmp_path / "pretrained", "llama", False, torch.float32, "50MB")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    from par4d.train.loop import worker  # one rank in this process (the launcher's one line is tested apart)

    config = checked_config("--model", "hf-llama", "--init-from", "hf", str(folder), "--seq-len", "16",
                            "--batch-size", "4", "--steps", "2", "--out", str(tmp_path / "run"), "--no-progress",
                            world=1)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(FloatingPointError) as raised:
            worker(config)
    finally:
        torch.set_num_threads(threads)
    said = str(raised.value)
    assert said.startswith(f"the loss is nan at step 1, before any update: the weights or the config.json of {folder} "
                           f"make the model non-finite") and "\n" not in said and "--lr" not in said, said
