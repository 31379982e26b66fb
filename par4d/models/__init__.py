"""Reference models built on par4d.nn, with single-device twins (imported on first use)."""

from importlib import import_module

__all__ = ["GPT", "GPTConfig", "ReferenceGPT"]

_LAZY = {"GPT": "par4d.models.gpt", "GPTConfig": "par4d.models.config", "ReferenceGPT": "par4d.models.reference"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'par4d.models' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
