"""par4d in ten lines: a model of one's own trained on a 3D grid, saved, and reloaded on another grid.

    torchrun --standalone --nproc-per-node 4 examples/quickstart.py --grid x=2,z=2 --out runs/quickstart
    torchrun --standalone --nproc-per-node 2 examples/quickstart.py --grid z=2 --out runs/quickstart  # from step 10

Each run trains 10 steps from the newest checkpoint in --out (or from the start) and saves one.
"""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

import par4d

STEPS, BATCH, FEATURES, CLASSES = 10, 32, 12, 10


class Classifier(nn.Module):
    """Three blocks of a Linear and a GELU, and a 10-class head: mean cross-entropy of (x, y)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(FEATURES, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(),
                                    nn.Linear(24, FEATURES), nn.GELU())
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.blocks(x)), y)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank): points, and the class a fixed teacher gives them."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    x = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(1 + step))
    return x, (x @ teacher).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="", help="axis sizes, e.g. x=2,z=2 (the rest 1)")
    parser.add_argument("--out", required=True, help="the folder checkpoints go to and come from")
    args = parser.parse_args()
    sizes = {axis: int(n) for axis, n in (part.split("=") for part in args.grid.split(",") if part)}

    grid = par4d.init(**sizes)                          # joins torchrun's job: gloo on CPUs, NCCL on GPUs
    torch.manual_seed(0)                                # every rank builds the same model, then keeps its shards
    model = par4d.parallelize(Classifier(), grid, report=grid.rank == 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if par4d.has_checkpoint(args.out):                  # saved on any grid: each rank reads the slices it holds
        start = par4d.load_checkpoint(args.out, model, optimizer, grid)["step"]
    for step in range(start, start + STEPS):
        x, y = batch(step)
        loss = par4d.train_step(model, optimizer, grid, (par4d.shard_batch(grid, x), par4d.shard_batch(grid, y)))
        dist.all_reduce(loss)                           # every rank holds a shard's mean: the global mean
        if grid.rank == 0:
            print(f"step {step + 1} loss {loss.item() / grid.world_size:.6f}", flush=True)
    par4d.save_checkpoint(args.out, model, optimizer, grid, step=start + STEPS)
    dist.destroy_process_group()
    # The grid (a reference cycle) holds groups whose gloo threads hold finished work with Python callbacks:
    # freed now, not at interpreter exit, where such a thread taking the GIL can abort the process (SIGABRT).
    del grid, model, optimizer
    gc.collect()


if __name__ == "__main__":
    main()
