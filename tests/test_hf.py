"""Hugging Face GPT-2 weights: a run exported with ``par4d export --to hf`` loads in ``transformers`` and
computes the same logits; ``load_hf`` puts it back at other grids bit for bit; what cannot be mapped is refused."""

import json
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from par4d import checkpoint
from par4d.adopt.gpt2 import check_hf, expected_tensors, load_hf
from par4d.cli import main
from par4d.layout import placement_of, shard, shard_batch
from par4d.models import GPTConfig, ReferenceGPT
from par4d.train.recipes import export_hf
from par4d.train.recipes.gpt import build_gpt
from par4d.train.step import train_step
from tests import cases
from tests.helpers import sizes_id

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=3)
TOKENS = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(5))


def _train_and_save(sizes: dict, run: str, config: GPTConfig) -> dict | None:
    """Two AdamW steps (weights away from their initial values), a checkpoint as ``par4d train`` writes it;
    rank 0 returns the full parameters."""
    grid = cases.grid(**sizes)
    model = build_gpt(config, grid)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1),
                               generator=torch.Generator().manual_seed(seed))
        train_step(model, optimizer, grid, (shard_batch(grid, tokens[:, :-1]), shard_batch(grid, tokens[:, 1:])))
    checkpoint.save(Path(run), 2, grid, model, optimizer, {"model_config": asdict(config)})
    state = model.reference_state() if config.mlp == "dense" else None
    return state if grid.rank == 0 else None


_EXPORTED: dict = {}


@pytest.fixture
def exported(pool4, tmp_path_factory) -> dict:
    """A run trained on x=2, z=2 and exported through the command line (once for the module)."""
    if not _EXPORTED:
        folder = tmp_path_factory.mktemp("hf")
        run, out = folder / "run", folder / "hf"
        state = pool4.run(_train_and_save, dict(x=2, z=2), str(run), CONFIG)[0]
        assert main(["export", "--run", str(run), "--to", "hf", str(out)]) == 0
        _EXPORTED.update(run=run, out=out, state=state)
    return _EXPORTED


def _hf_model(out: Path):
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def test_an_exported_run_computes_the_same_logits_in_transformers(exported):
    state, out = exported["state"], exported["out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:   # the file holds the weights exactly
        for key, (name, transposed, _) in expected_tensors(CONFIG).items():
            assert torch.equal(f.get_tensor(key), state[name].T if transposed else state[name]), key
    hf = _hf_model(out)
    assert hf.config.activation_function == "gelu" and not hf.config.tie_word_embeddings
    twin = ReferenceGPT(CONFIG, init=False)
    twin.load_state_dict(state)
    idx = TOKENS[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, twin(idx), atol=1e-5, rtol=0)


def _load_and_check(sizes: dict, out: str, state: dict) -> float:
    """load_hf into a differently initialized GPT: every rank's shards are exactly the exported tensors' and
    the model's loss is the global one."""
    from par4d.optim.data_parallel import global_mean

    grid = cases.grid(**sizes)
    model = build_gpt(replace(CONFIG, seed=1), grid)
    assert load_hf(Path(out), grid, model)["model_type"] == "gpt2"
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), shard(grid, state[name], placement_of(param))), (grid.describe(), name)
    x, y = shard_batch(grid, TOKENS[:, :-1]), shard_batch(grid, TOKENS[:, 1:])
    with torch.no_grad():
        return global_mean(model(x, y), grid).item()


@pytest.mark.parametrize("sizes", [dict(y=2, z=2), dict(x=2, y=2)],
                         ids=sizes_id)
def test_load_hf_reproduces_the_weights_at_another_grid(pool4, exported, sizes):
    losses = pool4.run(_load_and_check, sizes, str(exported["out"]), exported["state"])
    with torch.no_grad():
        logits = _hf_model(exported["out"])(TOKENS[:, :-1]).logits
    want = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), TOKENS[:, 1:].reshape(-1)).item()
    assert max(abs(loss - want) for loss in losses) <= 1e-5, (losses, want)


def _load_mismatched(out: str) -> None:
    grid = cases.grid(x=2, y=2)
    load_hf(Path(out), grid, build_gpt(replace(CONFIG, n_layer=1), grid))


def test_load_hf_refuses_another_shape_on_every_rank(pool4, exported):
    messages = pool4.errors(_load_mismatched, str(exported["out"]))
    assert all("n_layer=2 but the par4d model has n_layer 1" in m for m in messages), messages


def test_a_phantom_run_is_refused(pool4, exported, tmp_path, capsys):
    phantom = replace(CONFIG, mlp="phantom", phantom_k=4, phantom_p=2)
    pool4.run(_train_and_save, dict(x=2, data=2), str(tmp_path / "run"), phantom)
    assert main(["export", "--run", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "mlp='phantom'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="mlp='phantom'"):
        check_hf(exported["out"], phantom)


def _copy(exported: dict, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(exported["out"], folder)
    return folder


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in changes or changes[k] is not None}
    config.update({k: v for k, v in changes.items() if v is not None})
    path.write_text(json.dumps(config))
    return folder


def test_check_hf_names_the_file_and_the_numbers(exported, tmp_path):
    out = exported["out"]
    assert check_hf(out, CONFIG)["n_embd"] == 16
    with pytest.raises(ValueError, match=r"n_embd=16 but the par4d model has n_embd 32.*n_inner=64 but .* = 128"):
        check_hf(out, replace(CONFIG, n_embd=32))
    with pytest.raises(ValueError, match=r"n_positions=8 but the par4d model has block_size \(--seq-len\) 16"):
        check_hf(out, replace(CONFIG, block_size=16))
    cases_ = {"llama": (dict(model_type="llama"), "model_type is 'llama', par4d reads 'gpt2'"),
              "tanh": (dict(activation_function="gelu_new"), 'activation_function="gelu_new" but par4d'),
              "tied": (dict(tie_word_embeddings=None), "tie_word_embeddings=true but par4d's head"),  # GPT-2's default
              "vocab": (dict(vocab_size=50257), "vocab_size=50257 but the par4d model has vocab_size 32")}
    for name, (changes, message) in cases_.items():
        folder = _edit_config(_copy(exported, tmp_path, name), **changes)
        with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + ".*" + re.escape(message)):
            check_hf(folder, CONFIG)
    (folder := _copy(exported, tmp_path, "no-config")).joinpath("config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        check_hf(folder, CONFIG)


def test_check_hf_reads_the_weights_header(exported, tmp_path):
    with safe_open(str(exported["out"] / "model.safetensors"), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    folder = _copy(exported, tmp_path, "wrong-shape")
    save_file({**tensors, "transformer.h.1.mlp.c_fc.weight": torch.zeros(64, 16)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"transformer.h.1.mlp.c_fc.weight has shape \(64, 16\), the par4d model "
                                         r"needs \(16, 64\)"):
        check_hf(folder, CONFIG)
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors has no lm_head.weight"):
        check_hf(folder, CONFIG)
    save_file({**tensors, "transformer.h.0.crossattention.c_attn.weight": torch.zeros(16, 32)},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="tensors par4d's GPT lacks: transformer.h.0.crossattention.c_attn.weight"):
        check_hf(folder, CONFIG)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        check_hf(folder, CONFIG)
    # GPT-2's causal-mask buffers, which older transformers saved, are no weights: accepted.
    save_file({**tensors, "transformer.h.0.attn.bias": torch.ones(1, 1, 8, 8)}, str(folder / "model.safetensors"))
    check_hf(folder, CONFIG)


def test_export_refuses_what_it_cannot_write(exported, tmp_path, capsys):
    run, out = exported["run"], exported["out"]
    assert main(["export", "--run", str(run), "--to", "hf", str(out)]) == 2      # out is not empty
    err = capsys.readouterr().err
    assert f"--to hf {out} is not empty" in err and "--force" in err
    step = checkpoint.latest(run)                                                   # a checkpoint folder, --force
    assert main(["export", "--run", str(step), "--to", "hf", str(out), "--force"]) == 0
    assert "(step 2)" in capsys.readouterr().out
    assert main(["export", "--run", str(tmp_path), "--to", "hf", str(tmp_path / "x")]) == 2
    assert "is not a par4d run: it has no checkpoints/ folder" in capsys.readouterr().err
    assert main(["export", "--run", str(run), "--to", "onnx", str(tmp_path / "x")]) == 2
    assert "--to onnx: unknown format" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is a file"):
        export_hf(run, out / "config.json")
    assert not (tmp_path / "x").exists()
