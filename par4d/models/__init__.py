"""Reference models built on par4d.nn, with single-device twins (imported on first use)."""

from importlib import import_module

__all__ = ["GPT", "GPTConfig", "ReferenceGPT", "ReferenceUNet", "UNet", "UNetConfig"]

_LAZY = {"GPT": "par4d.models.gpt", "GPTConfig": "par4d.models.config", "ReferenceGPT": "par4d.models.reference",
         "UNet": "par4d.models.unet", "UNetConfig": "par4d.models.unet", "ReferenceUNet": "par4d.models.unet"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'par4d.models' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
