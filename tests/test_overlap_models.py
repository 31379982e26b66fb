"""``--overlap`` reaches every model ``par4d train`` trains, not only par4d's GPT.

The Hugging Face GPT-2 and Llama (their layers made par4d's by ``parallelize``) and par4d's
U-Net (its Conv2d layers), built as ``par4d train --model ...`` builds them
(``par4d.train.recipes.build_model``), train bit for bit alike with ``--overlap all`` and
``--overlap none`` (with all's row chunks: xy cuts rows, which is arithmetic) on x=2,y=2,z=2:
losses, every gradient after the data-parallel sync and clipping, every parameter after 3 AdamW
steps (``torch.equal``). The ledger shows the overlaps at work: the same collectives with the
same bytes in both runs, but in the overlapped one the weight-gradient reduce-scatters over z are
issued without a wait (ORS: exactly those the runtime deferred), and so are input-gradient
all-reduces (OAR), weight all-gathers over z (OAG) and the data-parallel buckets during backward;
the synchronous run waits for every layer collective where it is issued.
"""

from collections import Counter
from dataclasses import replace

import pytest
import torch

import par4d
from par4d.layout import shard_batch
from par4d.models.unet import shard_images
from par4d.optim.data_parallel import gradient_sync
from par4d.overlap import Overlap, set_overlap
from par4d.overlap.policy import XY_CHUNKS
from par4d.train.config import VOCAB_BYTES, TrainConfig
from par4d.train.recipes import build_model
from par4d.train.recipes.unet import IMAGE_CHANNELS
from par4d.train.step import train_step
from tests import cases

GRID = dict(x=2, y=2, z=2)
BATCH, STEPS = 8, 3
SIZES = {"hf-gpt2": dict(n_layer=2, n_embd=32, n_head=4, seq_len=8),
         "hf-llama": dict(n_layer=2, n_embd=32, n_head=4, seq_len=8),
         "unet": dict(n_layer=2, n_embd=8, image_size=8)}


def _batches(config: TrainConfig, grid) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    if config.model == "unet":
        side = config.image_size
        images = [torch.randn(2, BATCH, IMAGE_CHANNELS, side, side, generator=gen) for _ in range(STEPS)]
        return [(shard_images(grid, pair[0]), shard_images(grid, pair[1])) for pair in images]
    tokens = [torch.randint(0, VOCAB_BYTES, (BATCH, config.seq_len + 1), generator=gen) for _ in range(STEPS)]
    return [(shard_batch(grid, t[:, :-1]), shard_batch(grid, t[:, 1:])) for t in tokens]


def _train(model_name: str, overlap: str, recompute: str = "none") -> dict:
    grid = cases.grid(**GRID)
    config = TrainConfig(grid=GRID, out=None, model=model_name, batch_size=BATCH, overlap=overlap,
                         recompute=recompute, **SIZES[model_name])
    model = build_model(config, grid)
    if overlap == "none":     # the synchronous path with all's row chunks (xy cuts rows: arithmetic)
        set_overlap(model, replace(Overlap.none(), row_chunks=XY_CHUNKS))
    optimizer = cases.RecordingAdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    with grid.ledger.capture() as entries:
        for x, y in _batches(config, grid):
            losses.append(train_step(model, optimizer, grid, (x, y), grad_clip=0.5))
    runtime = par4d.state(model).runtime
    return {"losses": losses, "grads": optimizer.grads, "params": [p.detach().clone() for p in model.parameters()],
            "collectives": Counter((e.kind, e.axes, e.elements) for e in entries),
            "overlapped": Counter((e.kind, e.axes) for e in entries if e.overlapped),
            "deferred": runtime.deferred.deferred if runtime else 0,
            "prefetched": runtime.gathers.prefetched if runtime else 0,
            "cache_hits": runtime.gathers.cache_hits if runtime else 0,
            "early": gradient_sync(model, grid).early_launches}


def _compare(model_name: str) -> dict:
    base, run = _train(model_name, "none"), _train(model_name, "all")
    for key in ("losses", "grads", "params"):
        cases.assert_bitwise(f"{model_name} --overlap all against none: {key}", run[key], base[key])
    assert run["collectives"] == base["collectives"], f"{model_name}: overlap changed the collectives or their bytes"
    # Synchronous: every layer collective waited for where issued; only the data-parallel buckets, launched
    # together once backward is done, are waited for after each other.
    layers = {key: n for key, n in base["overlapped"].items() if not (key[0] == "all_reduce" and "z" in key[1])}
    assert not layers and base["early"] == 0, f"{model_name} --overlap none left {layers} in flight"
    return {k: run[k] for k in ("overlapped", "deferred", "prefetched", "early")}


@pytest.mark.parametrize("model_name", list(SIZES))
def test_overlap_all_is_bitwise_none_on_x2_y2_z2(pool8, model_name):
    for result in pool8.run(_compare, model_name, timeout=600):
        overlapped = result["overlapped"]
        # ORS: every deferred reduce-scatter is in the ledger, issued without a wait, and only those.
        assert result["deferred"] > 0 and overlapped[("reduce_scatter", ("z",))] == result["deferred"], overlapped
        # OAG: gathers served ahead of their layer; OAR: input-gradient sums over x or y left in flight.
        assert result["prefetched"] > 0 and overlapped[("all_gather", ("z",))] >= result["prefetched"], overlapped
        assert overlapped[("all_reduce", ("x",))] + overlapped[("all_reduce", ("y",))] > 0, overlapped
        # dp: gradient buckets summed over z during backward.
        assert result["early"] > 0 and any(kind == "all_reduce" and "z" in axes for kind, axes in overlapped), \
            overlapped


def _recomputed(model_name: str) -> dict:
    base, run = _train(model_name, "none"), _train(model_name, "all", recompute="auto")
    for key in ("losses", "grads", "params"):
        cases.assert_bitwise(f"{model_name} --recompute auto --overlap all against none: {key}", run[key], base[key])
    gathers = [sum(n for (kind, axes, _), n in r["collectives"].items() if kind == "all_gather" and axes == ("z",))
               for r in (base, run)]
    return {"cache_hits": run["cache_hits"], "gathers": gathers}


@pytest.mark.parametrize("model_name", ["hf-gpt2", "hf-llama"])
def test_recomputed_hugging_face_layers_train_bit_for_bit_with_the_cache(pool8, model_name):
    """``--recompute auto`` on a Hugging Face model: transformers' gradient checkpointing of every decoder
    layer, the gathered weights of each layer's first forward kept for its recomputation (the cache, in
    ``all`` with recomputation): the same bits as without either, and no weight gathered twice over z (the
    recomputed forward sums its outputs over x and y again)."""
    for result in pool8.run(_recomputed, model_name, timeout=600):
        assert result["cache_hits"] > 0 and result["gathers"][0] == result["gathers"][1] > 0, result
