"""Reference models built on par4d.nn, with single-device twins."""

from par4d.models.config import GPTConfig
from par4d.models.gpt import GPT
from par4d.models.reference import ReferenceGPT

__all__ = ["GPT", "GPTConfig", "ReferenceGPT"]
