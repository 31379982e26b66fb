"""Models nobody here wrote: :func:`parallelize` gives their layers par4d's (parallelize.py),
counts the collectives a step of the result will run (messages.py), and
:func:`load_safetensors` fills one built on the meta device shard by shard (load.py)."""

from par4d.adopt.load import load_safetensors
from par4d.adopt.parallelize import Treatment, parallelize

__all__ = ["Treatment", "load_safetensors", "parallelize"]
