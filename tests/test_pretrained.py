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
                                                     ("gpt2", True, torch.float32, "30KB")])
def test_every_rank_of_a_3d_grid_computes_the_logits_transformers_does(pool8, tmp_path, family, tied, dtype, shard):
    folder = _save(tmp_path / "pretrained", family, tied, dtype, shard)
    assert (folder / "model.safetensors.index.json").is_file() == (shard != "50MB")
    expected = _transformers_logits(folder)
    sizes = dict(x=2, y=2, z=2)
    for rank, logits in enumerate(_grid_logits(pool8, folder, f"hf-{family}", sizes)):
        torch.testing.assert_close(logits, expected[_rows(rank, sizes)], rtol=0, atol=1e-5)


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


def _refused(capsys, folder: Path, *flags: str) -> str:
    out = folder.parent / "run"
    assert main(["train", "--model", "hf-llama", "--init-from", "hf", str(folder), "--nproc", "1", "--steps", "1",
                 "--seq-len", "16", "--batch-size", "4", "--out", str(out), *flags]) == 2
    assert not out.exists()
    return capsys.readouterr().err


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
