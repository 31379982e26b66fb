"""Bad input raises ValueError naming the numbers, on every rank, before any collective.

Each case runs on all ranks of a pool with a time limit: a rank that hangs in a
collective instead of raising fails the test.
"""

import pytest
import torch

import par4d
import par4d.cli
from par4d.grid import parse_grid, validate_sizes
from par4d.layout import shard_batch
from par4d.models import GPT, GPTConfig
from par4d.train.recipes.gpt import build_gpt
from tests import cases


def _init(**sizes):
    return par4d.init(**sizes)


@pytest.mark.parametrize("sizes, words", [
    (dict(x=3), ["x=3", "3 ranks", "world size 4"]),
    (dict(x=2, y=2, z=2), ["8 ranks", "world size 4"]),
    (dict(x=0, y=4), ["x=0", ">= 1"]),
    (dict(data=-4), ["data=-4", ">= 1"]),
])
def test_invalid_grid_raises_on_every_rank(pool4, sizes, words):
    messages = pool4.errors(_init, **sizes, timeout=30)
    assert len(messages) == 4
    for message in messages:
        assert message.startswith("ValueError"), message
        for word in words:
            assert word in message, (word, message)


def test_unknown_axis():
    with pytest.raises(ValueError, match="unknown grid axis 'w'; valid axes are x, y, z, data, pipe"):
        parse_grid("x=2,w=2")
    with pytest.raises(ValueError, match="unknown grid axis 'tp'"):
        validate_sizes({"tp": 2}, 2)
    with pytest.raises(ValueError, match="not of the form axis=size"):
        parse_grid("x2")
    assert parse_grid("x=2, z=2") == {"x": 2, "z": 2}


def _unknown_axis_on_grid():
    return cases.grid(x=2, y=2).size("w")


def test_unknown_axis_on_a_grid(pool4):
    for message in pool4.errors(_unknown_axis_on_grid, timeout=30):
        assert "unknown grid axis 'w'" in message


def _linear(k, n, transposed, sizes):
    return par4d.nn.Linear(k, n, transposed=transposed, grid=cases.grid(**sizes), name="blocks.0.mlp.fc")


@pytest.mark.parametrize("k, n, transposed, sizes, words", [
    (10, 8, False, dict(y=4), ["blocks.0.mlp.fc", "in_features=10", "y=4"]),
    (8, 10, False, dict(x=4), ["out_features=10", "x = 1 * 4"]),
    (8, 10, True, dict(y=2, z=2), ["5 out-features per y-block", "z=2"]),
    (6, 8, True, dict(x=4), ["in_features=6", "x=4"]),
])
def test_linear_divisibility(pool4, k, n, transposed, sizes, words):
    for message in pool4.errors(_linear, k, n, transposed, sizes, timeout=30):
        for word in words:
            assert word in message, (word, message)


def _gpt(config_kwargs, sizes):
    return build_gpt(GPTConfig(**config_kwargs), cases.grid(**sizes))


@pytest.mark.parametrize("config, sizes, words", [
    (dict(n_head=2, n_embd=16), dict(x=4), ["n_head=2", "x=4"]),
    (dict(vocab_size=30, n_embd=16), dict(x=4), ["head", "out_features=30", "x = 1 * 4"]),
    (dict(block_size=6, n_embd=16), dict(z=4), ["wpe", "num_embeddings=6", "z=4"]),
    (dict(n_embd=18, n_head=3), dict(y=4), ["wte", "dim=18", "y=4"]),
    (dict(n_embd=16, mlp="phantom", phantom_p=2), dict(x=4), ["phantom_p=2 must equal the grid's x=4"]),
    (dict(n_embd=16, mlp="phantom", phantom_p=2), dict(x=2, y=2), ["phantom MLP runs on x and data only", "y=2"]),
])
def test_gpt_config_errors(pool4, config, sizes, words):
    for message in pool4.errors(_gpt, config, sizes, timeout=30):
        for word in words:
            assert word in message, (word, message)


def _batch(batch):
    return shard_batch(cases.grid(z=2, data=2), torch.zeros(batch, 3))


def test_batch_not_divisible(pool4):
    for message in pool4.errors(_batch, 6, timeout=30):
        assert "global batch of 6 samples is not divisible by data * z = 2 * 2 = 4" in message


def test_gpt_config_validates_itself():
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=4"):
        GPTConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="n_layer=0"):
        GPTConfig(n_layer=0)


def _load_wrong_shape():
    from par4d.models import ReferenceGPT

    small = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT(small, grid=cases.grid(x=2, z=2))
    state = ReferenceGPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)).state_dict()
    model.load_reference_state(state)


def test_loading_a_full_state_of_the_wrong_shape(pool4):
    for message in pool4.errors(_load_wrong_shape, timeout=30):
        assert "'wte.weight' has shape (64, 16), the model expects (32, 16)" in message


def test_a_rank_that_exits_on_its_own_is_named_with_its_status():
    """A rank with no error file (it exited after a signal sent to it alone) is reported by its
    exit status, not by torch's "To enable traceback" placeholder."""
    from types import SimpleNamespace

    from par4d.launch.local import failure_cause, failure_signal, first_failure

    def failure(code, data=None):
        return SimpleNamespace(exitcode=code, error_file_data=data or {}, signal_name=lambda: "SIGKILL")

    assert failure_cause(failure(143)) == "exit status 143 (on SIGTERM)"
    assert failure_cause(failure(143, {"message": "<NONE>"})) == "exit status 143 (on SIGTERM)"   # torch's blank
    assert failure_cause(failure(3)) == "exit status 3"
    assert failure_cause(failure(-9)) == "killed by SIGKILL (out of memory?)"
    bad = failure(1, {"message": {"message": "ValueError: bad", "extraInfo": {}}})
    assert failure_cause(bad) == "ValueError: bad"
    # The command's exit status is 128 + the signal (par4d.cli.main), as a shell reports a killed process
    assert failure_signal(failure(-9)) == (9, False) and failure_signal(failure(143)) == (15, True)
    assert failure_signal(failure(3)) == failure_signal(bad) == (None, False)
    assert failure_signal(failure(143, {"message": "RuntimeError: x"})) == (None, False)
    # Rank 1 failing first only to echo rank 0's failed save: rank 0's own error is the one reported
    def at(time, message):
        return SimpleNamespace(exitcode=1, timestamp=time, error_file_data={"message": message})

    echoed = {0: at(5, "OSError: cannot write meta.json"), 1: at(4, "Rank0Failed: rank 0 failed: OSError: ...")}
    assert first_failure(echoed) == (0, echoed[0])
    raised = {0: at(5, "RuntimeError: a"), 1: at(4, "ValueError: b")}
    assert first_failure(raised) == (1, raised[1])
    # Rank 0 exiting in the same second as rank 2 (ties go by rank), only to say its collective found a peer gone
    gone = {0: at(4, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:2435"),
            2: at(4, "RuntimeError: fault injected")}
    assert first_failure(gone) == (2, gone[2])
    assert first_failure({0: gone[0]}) == (0, gone[0])      # the only one there is


def test_the_public_api_names_what_it_was_given(tmp_path):
    """Refused before any collective: a batch that is not tensors, a precision policy made for another model,
    a step count that is not one."""
    grid = par4d.Grid.virtual({"x": 1})
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="train_step: batch is dict; give this rank's tensor or a tuple of them"):
        par4d.train_step(model, optimizer, grid, {"x": torch.zeros(1, 2)})
    policy = par4d.FullPrecision(model, grid, optimizer)
    with pytest.raises(ValueError, match="the precision policy steps another model than the Linear given"):
        par4d.save_checkpoint(tmp_path, other, policy, grid, step=1)
    with pytest.raises(ValueError, match=r"save_checkpoint\(step=-1\): give the step count"):
        par4d.save_checkpoint(tmp_path, model, optimizer, grid, step=-1)
    assert not par4d.has_checkpoint(tmp_path) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--repeats", "0"], "argument --repeats: 0: give 1 or more"),
    (["calibrate", "--nproc", "two"], "argument --nproc: 'two' is not a whole number"),
    (["plan", "--gpus", "8", "--train-tokens", "nan"], "argument --train-tokens: nan: give a finite number above 0"),
    (["plan", "--gpus", "8", "--train-tokens", "-5"], "argument --train-tokens: -5: give a finite number above 0"),
    (["plan", "--gpus", "8", "--train-tokens", "inf"], "argument --train-tokens: inf: give a finite number above 0"),
    (["generate", "--run", "r", "--prompt", "a", "--temperature", "inf"],
     "argument --temperature: inf: give a finite number of at least 0"),
])
def test_numbers_that_make_no_sense_are_usage_errors(capsys, argv, message):
    """Refused where argparse reads them (exit 2, one error line after the usage), before anything is measured."""
    with pytest.raises(SystemExit) as exit_:
        par4d.cli.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
