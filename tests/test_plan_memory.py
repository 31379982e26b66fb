"""Memory the planner predicts is memory a step holds: par4d.train.footprint counts what a step keeps (saved
tensors while alive, a recomputed segment's included, the sync's buckets), and the planner's terms
(GPTSpec.memory_terms) land within 10% of it on real grids, with microbatches, recomputation and pipelines."""

import pytest
import torch

from par4d.measure.profile import profile_memory
from par4d.overlap import Overlap
from par4d.plan.cost import memory_bytes
from par4d.plan.workload import MEASURED
from par4d.train.footprint import SavedTensors

ONE = dict(x=1, y=1, z=1, data=1, pipe=1)
CHOICES = [
    dict(sizes=dict(ONE, z=4), microbatches=1, recompute=True),          # the cache keeps every gathered weight
    dict(sizes=dict(ONE, data=4), microbatches=1, recompute=False),
    dict(sizes=dict(ONE, x=2, z=2), microbatches=1, recompute=False),
    dict(sizes=dict(ONE, y=2, z=2), microbatches=2, recompute=True),
    dict(sizes=dict(ONE, x=4), microbatches=1, recompute=True),
    dict(sizes=dict(ONE, z=2, data=2), microbatches=4, recompute=False),
    dict(sizes=dict(ONE, x=2, pipe=2), microbatches=4, recompute=False),
    dict(sizes=dict(ONE, data=2, pipe=2), microbatches=2, recompute=True),
]


def test_saved_tensors_are_counted_while_alive_once_per_storage():
    w = torch.ones(1000, requires_grad=True)
    x = torch.ones(1000, requires_grad=True)
    with SavedTensors(exclude={w.untyped_storage().data_ptr()}) as saved:
        y = x * w                   # saves x (4000 bytes) and w (a parameter: not counted)
        z = y.sin()                 # saves y
        v = x.view(10, 100) * 2.0   # saves nothing of x again (a scalar multiple)
        total = z.sum() + v.sum() + (x * x).sum()   # x * x saves x twice: the same storage, once
        assert saved.live == 8000 and saved.peak == 8000
        total.backward()
        del y, z, v, total
        assert saved.live == 0 and saved.peak == 8000


def test_the_planner_predicts_what_a_step_holds():
    measured = profile_memory(CHOICES)
    for choice, row in zip(CHOICES, measured):
        sizes, micro, rc = choice["sizes"], choice["microbatches"], choice["recompute"]
        overlap = Overlap()        # the measured step's: every overlap on (the cache too, under recomputation)
        predicted = memory_bytes(MEASURED, sizes, 4, rc, micro, overlap.in_pipeline() if sizes["pipe"] > 1 else overlap,
                                 None)
        assert predicted == pytest.approx(row["total"], rel=0.10), (choice, row)
        # What autograd keeps (activations and the gathered weights), as memory_bytes takes them (the first stage
        # holds min(P, M) of M microbatches); with recomputation the segment recomputed in backward is among them
        # (its inputs alone are 40-60% less).
        pipe = sizes["pipe"]
        terms = MEASURED.memory_terms(sizes, 4, rc, share=min(pipe, micro) / micro, overlap=overlap)
        assert row["activations"] + row["cached"] == pytest.approx((terms["activations"] + terms["gathered"]) / pipe,
                                                                  rel=0.10)
