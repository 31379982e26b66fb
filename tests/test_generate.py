"""``par4d generate`` (docs/data.md): greedy text from a run's checkpoint is what par4d's own model, stepped one
token at a time without a cache, predicts (so the key/value cache and the export's mapping change nothing);
a seed gives the same sample every time; a tokenizer's run speaks its tokens; bad input named."""

import pytest
import torch

from par4d.cli import main
from par4d.cli.generate_run import Codec, Sampling, generate, load_model
from tests.helpers import bpe_tokenizer, checked_config, train_alone

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--batch-size", "8", "--seq-len", "32",
         "--steps", "3", "--no-progress", "--peak-flops", "1e11", "--nproc", "1"]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "run"
    train_alone(checked_config(*SMALL, "--out", str(run), world=1))
    return run


def test_greedy_text_is_what_par4ds_own_model_predicts_token_by_token(gpt_run):
    from par4d.adopt.gpt2 import param_shapes
    from par4d.train.export import find_checkpoint, full_tensors, saved_gpt_config
    from par4d.train.recipes.gpt import build_reference

    prompt = "def main("
    text, ids = generate(gpt_run, prompt, Sampling(max_tokens=12, temperature=0))
    chosen = find_checkpoint(gpt_run)
    config = saved_gpt_config(chosen.path, chosen.meta)
    reference = build_reference(config, init=False)
    reference.load_state_dict(full_tensors(chosen, param_shapes(config)))
    tokens = list(prompt.encode())
    with torch.no_grad():
        for _ in range(12):           # the whole sequence each time: no cache
            tokens.append(int(reference(torch.tensor([tokens]))[0, -1].argmax()))
    assert ids == tokens[len(prompt):] and text == bytes(ids).decode("utf-8", errors="replace")


def test_a_seed_gives_the_same_sample(gpt_run):
    first = generate(gpt_run, "import ", Sampling(max_tokens=16, temperature=1.0, top_k=20, seed=7))
    assert generate(gpt_run, "import ", Sampling(max_tokens=16, temperature=1.0, top_k=20, seed=7)) == first
    assert len(first[1]) == 16 and all(0 <= i < 256 for i in first[1])


def test_the_cli_prints_the_prompt_and_its_continuation_and_names_bad_input(gpt_run, capsys):
    assert main(["generate", "--run", str(gpt_run), "--prompt", "class ", "--max-tokens", "5",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("class ") and out.endswith("\n")
    assert main(["generate", "--run", str(gpt_run), "--prompt", "x" * 30, "--max-tokens", "5"]) == 2
    assert "the prompt's 30 tokens and --max-tokens 5 exceed the model's 32 positions" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:        # a usage error, where argparse reads the number
        main(["generate", "--run", str(gpt_run), "--prompt", "x", "--temperature", "-1"])
    assert exit_.value.code == 2
    assert "argument --temperature: -1: give a finite number of at least 0" in capsys.readouterr().err
    assert main(["generate", "--run", str(gpt_run.parent / "nothing"), "--prompt", "x"]) == 2


def test_a_tokenizers_run_speaks_its_tokens(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tok")
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: word{i % 7} word{i % 5}" for i in range(400)))
    run = tmp_path / "run"
    train_alone(checked_config(*SMALL, "--model", "hf-llama", "--n-head", "4", "--tokenizer", str(tok),
                               "--data", str(text), "--out", str(run), world=1))
    model, settings, step = load_model(run)
    assert step == 3 and model.config.vocab_size == 300 and settings["tokenizer"] == str(tok)
    codec = Codec(settings)
    assert codec.decode(codec.encode("Paragraph 12: word5")) == "Paragraph 12: word5"
    out, ids = generate(run, "Paragraph 3:", Sampling(max_tokens=6, temperature=0))
    assert out == codec.decode(ids) and len(ids) == 6 and max(ids) < 300
