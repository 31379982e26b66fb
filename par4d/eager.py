"""What a compiled block (par4d.compiled) leaves eager: par4d's collectives and the waits on them, each a graph
break with nothing in it traced, as ``torch.compiler.disable`` makes it.

That decorator imports torch._dynamo where it is applied: 0.9 s for every process that imports par4d's
collectives (a launcher, ``par4d inspect``), compiling or not. :func:`eager` costs nothing where nothing
compiles: it marks the function as dynamo's own decorator does (a compiled block stops at the call instead of
tracing into it), and where a compiled block runs (dynamo's frame callback is set) it calls the function
through ``torch.compiler.disable`` (nothing inside traced). A process that compiles calls :func:`skip_wrappers`
first. tests/test_compile.py counts the graphs and breaks it gives: those of ``torch.compiler.disable``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """``fn`` run eagerly where a compiled block calls it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        # Imported is not compiling: torch.optim imports dynamo with the first optimizer. Only where a compiled
        # block runs is dynamo's frame callback set (disable's wrapper, built anew each call, costs 3 us).
        if dynamo is None or sys.modules["torch._C._dynamo.eval_frame"].get_eval_frame_callback() is None:
            return fn(*args, **kwargs)
        return dynamo.disable(fn)(*args, **kwargs)

    run._torchdynamo_disable = True     # dynamo's mark (torch/_dynamo/decorators.py): a break here, not inlined
    return run      # type: ignore[return-value]


def skip_wrappers() -> None:
    """Tell dynamo (imported: the process compiles) never to compile the frames of :func:`eager`'s wrappers (they
    share one code object), called as they are after the break: else each counts a second break."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(_WRAPPER)


_WRAPPER = eager(len).__code__      # every wrapper's code
