"""Which communication overlaps a run uses: the policy, as data.

The four overlaps of the 4D paper (Section IV; docs/architecture.md, "Overlap") plus
par4d's overlapped data-parallel sync. Each reorders *waits* only, never arithmetic:
every combination trains bit for bit as the synchronous path does (tested).

* ``all_reduce`` (OAR): the backward all-reduce of dL/dI runs while the weight
  gradient is computed.
* ``reduce_scatter`` (ORS): weight-gradient reduce-scatters over z are waited for
  only when the whole backward pass is done.
* ``all_gather`` (OAG): the next ``prefetch`` layers' weight all-gathers over z are
  issued while the current layer computes, in the layers' execution order recorded
  on the first iteration; a change of order is detected and re-recorded.
* ``cache_layers``: under activation recomputation the recomputed forward reuses the
  weights gathered by the first forward, for up to this many layers (None: all; 0: off).
* ``data_parallel``: gradient buckets of ``bucket_mb`` MB are all-reduced over their
  partial axes from gradient hooks, as each bucket becomes ready during backward.
* ``xy``: the all-reduces over x and y (the forward one of every layer over its in-axis, the
  backward one over its out-axis) go in ``row_chunks`` chunks of the activation's rows, each
  waited for after the next chunk's matmul (as DeepSpeed's Domino splits a layer's batch).
  Cutting rows changes arithmetic (which rounding a ring gives an element depends on where it
  sits in the message), so ``row_chunks`` is a setting of its own: ``--overlap`` with ``xy`` sets
  it to XY_CHUNKS, without ``xy`` to 1, and every combination trains bit for bit as the
  synchronous path with the same ``row_chunks`` does.
* ``experts`` (``ep``): a mixture's dispatch all-to-all is waited for after its shared experts' GEMMs,
  which need none of the rows that travel (par4d.nn.moe; a mixture without shared experts has nothing to
  hide it behind).
* ``context`` (``cp``): on a context axis, each block of keys and values travels around the ring while the
  attention of the block before is computed (par4d.nn.ring); without it every transfer is waited for where
  it is issued.

No torch here: the CLI parses and checks these before any rank starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

NAMES = ("oar", "ors", "oag", "cache", "dp", "xy", "ep", "cp")
"""The switches of ``par4d train --overlap LIST``: the paper's Fig. 3 order, then par4d's own."""

_FIELD = {"oar": "all_reduce", "ors": "reduce_scatter", "oag": "all_gather", "dp": "data_parallel", "xy": "xy",
          "ep": "experts", "cp": "context"}
XY_CHUNKS = 2      # row chunks of the x/y all-reduces under ``xy``
BUCKET_MB = 25.0   # DDP's default bucket size


def check_bucket_mb(size: float, name: str = "--bucket-mb") -> float:
    """``size``, a bucket's MB: at least one byte, and as bytes a finite number (1e308 MB is not); else a
    ValueError naming ``name``, the flag or field it came from."""
    if not (math.isfinite(size * 2**20) and size * 2**20 >= 1):     # (nan and inf fail the first)
        raise ValueError(f"{name} must be a finite size of at least one byte (2**-20 MB), got {size}")
    return size


@dataclass(frozen=True)
class Overlap:
    """The overlap switches (every one on by default) and their settings."""

    all_reduce: bool = True
    reduce_scatter: bool = True
    all_gather: bool = True
    prefetch: int = 2
    cache_layers: int | None = None
    data_parallel: bool = True
    bucket_mb: float = BUCKET_MB
    xy: bool = True
    row_chunks: int = XY_CHUNKS
    experts: bool = True
    context: bool = True

    def __post_init__(self) -> None:
        if self.prefetch < 1:
            raise ValueError(f"Overlap(prefetch={self.prefetch}): prefetch depth must be >= 1 layer")
        if self.cache_layers is not None and self.cache_layers < 0:
            raise ValueError(f"Overlap(cache_layers={self.cache_layers}): must be >= 0 (None: every layer)")
        check_bucket_mb(self.bucket_mb, "Overlap(bucket_mb=)")
        if self.row_chunks < 1:
            raise ValueError(f"Overlap(row_chunks={self.row_chunks}): must be >= 1 (1: rows not cut)")

    @classmethod
    def none(cls) -> Overlap:
        """The synchronous path: every collective waited for where it is issued."""
        return cls(**{field: False for field in _FIELD.values()}, cache_layers=0, row_chunks=1)

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """``all``, ``none``, or a comma list of :data:`NAMES` (the CLI's ``--overlap``)."""
        text = text.strip().lower()
        if text == "all":
            return cls()
        if text == "none":
            return cls.none()
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in NAMES]
        if unknown or not names:
            raise ValueError(f"--overlap {text!r}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                             f"give all, none, or a comma list of {', '.join(NAMES)}")
        return cls(**{_FIELD[n]: n in names for n in _FIELD}, cache_layers=None if "cache" in names else 0,
                   row_chunks=XY_CHUNKS if "xy" in names else 1)

    @cached_property
    def names(self) -> tuple[str, ...]:
        """The switches that are on, as :data:`NAMES` (computed once: the planner asks it thousands of times)."""
        return tuple(n for n in NAMES if (self.cache if n == "cache" else getattr(self, _FIELD[n])))

    @property
    def cache(self) -> bool:
        return self.cache_layers != 0

    def in_pipeline(self) -> Overlap:
        """The switches that act on a grid with pipe > 1: OAR, xy, ep, cp and the cache (inside each layer's own forward
        and backward). Pipeline stages run outside the model's forward (no recorded gather order: no OAG) and
        outside the training step's own backward (no ORS, no buckets launched during backward)."""
        return replace(self, reduce_scatter=False, all_gather=False, data_parallel=False)

    def describe(self) -> str:
        on = self.names
        if on == NAMES:
            return "all"
        return ",".join(on) if on else "none"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)
