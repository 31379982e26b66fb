"""``par4d generate``: text sampled from a run's newest intact checkpoint, in one process.

The checkpoint's model is assembled whole as ``transformers`` would load its export (par4d's GPT as the
GPT-2 it maps to, a ``--model hf-*`` run as its own model: :func:`par4d.train.recipes.hf_state`), and
``transformers``' ``generate`` samples from it with its key/value cache: each new token costs one
position's forward, not the whole sequence's. The prompt and the output go through the run's tokenizer
(the one it recorded, checked by SHA-256), or are UTF-8 bytes for a byte-level run.

Sampling: ``temperature`` 0 is greedy (the most likely token each time); otherwise the logits are divided
by it and the ``top_k`` most likely tokens (0: all) are drawn from, by torch's generator seeded with
``seed``, so a seed gives the same text every time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens {self.max_tokens}: give at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature {self.temperature}: give 0 (greedy) or more")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: give 0 (every token) or more")


def load_model(source: Path, report: Callable[[str], None] | None = None):
    """(the ``transformers`` model of the run or checkpoint ``source``, in eval mode, fp32; the run's
    settings as saved; the step)."""
    from par4d.nn.float8 import quiet_torchao

    with quiet_torchao():     # transformers' model classes import torchao
        from transformers import AutoConfig, AutoModelForCausalLM

    from par4d.adopt.load import compute_buffers
    from par4d.train.recipes import hf_state

    chosen, tensors, text = hf_state(Path(source), report)
    settings = json.loads(text)
    settings.pop("architectures", None)
    settings.pop("dtype", None)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = {k: v.float() for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)   # no copy: the tensors
    model.tie_weights()
    left = sorted(n for n, p in model.named_parameters() if p.is_meta)
    if unexpected or left:
        raise ValueError(f"{chosen.path}: its tensors do not make a {type(model).__name__} (missing {left[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")
    compute_buffers(model, torch.device("cpu"))     # what no checkpoint holds (rotary frequencies): computed
    return model.eval(), chosen.meta.get("train_config", {}), chosen.meta.get("step")


class Codec:
    """The run's text and token ids, both ways: its tokenizer, or UTF-8 bytes."""

    def __init__(self, settings: dict):
        self.tokenizer = None
        if settings.get("tokenizer"):
            from par4d.data.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(settings["tokenizer"], settings.get("tokenizer_sha256"))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode([text])[0] if self.tokenizer else list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else bytes(ids).decode("utf-8", errors="replace")


def generate(source: Path, prompt: str, sampling: Sampling, report: Callable[[str], None] | None = None
             ) -> tuple[str, list[int]]:
    """(the text ``sampling`` draws after ``prompt`` from the run ``source``, its token ids)."""
    model, settings, _ = load_model(source, report)
    codec = Codec(settings)
    ids = codec.encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty: give at least one token of text")
    positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if len(ids) + sampling.max_tokens > positions:
        raise ValueError(f"the prompt's {len(ids)} tokens and --max-tokens {sampling.max_tokens} exceed the "
                         f"model's {positions} positions")
    torch.manual_seed(sampling.seed)
    greedy = sampling.temperature == 0
    options = {"do_sample": False} if greedy else {"do_sample": True, "temperature": sampling.temperature,
                                                     "top_k": sampling.top_k or None}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=sampling.max_tokens, min_new_tokens=0,
                             pad_token_id=0, eos_token_id=None, use_cache=True, top_p=None, **options)
    new = out[0, len(ids):].tolist()
    return codec.decode(new), new
