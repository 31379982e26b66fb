"""``par4d bench moe``: a mixture of experts in every block, par4d's grids against PyTorch DDP and FSDP2 of
the same model, on the same batch and ranks, one after another in one job. The model: par4d's GPT
(``--model gpt``; the peers train its single-device twin) or transformers' Mixtral (``--model hf-mixtral``;
par4d trains it made parallel by ``par4d.parallelize``, the peers transformers' own model, its experts by
transformers' default kernel, with its load-balancing loss over each rank's tokens). DDP holds every
expert on each rank; FSDP2 shards every parameter (each block, then the root). ``--compile``: every row's
blocks compiled alike (par4d.compiled: par4d's, and the peers' after DDP or FSDP2 wraps them), the compiling
step timed apart and the graphs compiled again after it counted (every step trains on the same batch, so the
experts' loads change only as the routers learn; tests/test_moe.py changes them every step).

par4d's rows: the experts spread over every data rank (``expert`` = ranks), over half of them, not at all
(each rank holds every expert, as DDP), and split over x as well as spread. Each row gives the median
seconds per step, the ratio to the fastest peer's, the bytes of expert parameters and of all parameters a
rank holds (counted from the shards: what a rank's AdamW state and gradients scale with), and the bytes
one step's collectives move on rank 0 (par4d: its ledger, the all-to-alls included; DDP: its gradients,
all-reduced once; FSDP2: c10d's dispatch, counted by the peers' counter).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from par4d.bench.common import check_cluster, in_rounds, launch, link_bytes, pooled
from par4d.compiled import compile_afresh, counted
from par4d.launch import distributed_env, init, join
from par4d.launch.host import threads_per_rank
from par4d.layout import placement_of, shard_batch
from par4d.measure.grids import WARMUP, compile_seconds, time_iterations
from par4d.models import GPTConfig
from par4d.parallel import check_compile

# Experts hold 16 d^2 each per block against attention's 4 d^2: with 8 of them, 97% of the blocks' weights
MOE_CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, mlp="moe", experts=8, top_k=2)
# The same shape as transformers' Mixtral (gated experts: 24 d^2 each against attention's 3 d^2, grouped kv)
MIXTRAL = dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
               output_router_logits=True, bos_token_id=0, eos_token_id=0)
MODELS = ("gpt", "hf-mixtral")
BATCH = 16


@dataclass(frozen=True)
class MoESettings:
    nproc: int
    iters: int
    config: GPTConfig = MOE_CONFIG
    batch: int = BATCH
    model: str = "gpt"
    nodes: int | None = None      # emulated nodes of nproc ranks each (None: local ranks)
    link: str = "1gbit"
    warmup: int = WARMUP          # untimed steps before each row's (a test's rows need none)
    compile: str = "none"         # a backend compiling every row's blocks (par4d.compiled), or none
    rounds: int = 1               # every row timed this many times, in alternating order, its times pooled

    @property
    def world(self) -> int:
        return self.nproc * (self.nodes or 1)


def _mixtral() -> torch.nn.Module:
    """The benchmark's Mixtral, fp32, from seed 0 (the same weights in every row)."""
    from par4d.nn.float8 import quiet_torchao

    with quiet_torchao():     # transformers' model classes import torchao
        from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**MIXTRAL)).float()


def par4d_grids(world: int) -> list[dict[str, int]]:
    """The experts spread over every rank, over half, not at all; and split over x=2 while spread."""
    grids = [dict(data=world, expert=world)]
    if world % 4 == 0:
        grids += [dict(data=world, expert=world // 2), dict(x=2, data=world // 2, expert=world // 2)]
    return grids + [dict(data=world)]


def _tokens(settings: MoESettings) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, settings.config.vocab_size, (settings.batch, settings.config.block_size + 1),
                           generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _is_expert(param: torch.Tensor) -> bool:
    placement = placement_of(param)
    return getattr(param, "_bench_expert", False) or (placement is not None and "expert" in placement.sharded)


def _bytes(params, expert: bool) -> int:
    """Bytes of ``params`` (``expert``: the experts' only) as this rank holds them."""
    return sum(p.numel() * p.element_size() for p in params if not expert or _is_expert(p))


def _row(framework: str, name: str, grid: str, times: list[float], comm: int, experts: int, params: int,
         link: float | None) -> dict:
    return {"framework": framework, "name": name, "grid": grid, "s_per_iter": statistics.median(times),
            "comm_bytes_per_iter": comm, "expert_bytes_per_rank": experts, "param_bytes_per_rank": params,
            "times": times, **({} if link is None else {"link_bytes_per_iter": link})}


def _timed(model: torch.nn.Module, step, settings: MoESettings) -> tuple[list[float], dict]:
    """``step``'s times, ``model``'s blocks compiled first where the settings say (its first step, compiling,
    timed apart: its seconds beyond the timed steps' median; the graphs it made, and those made after it)."""
    if compile_afresh(model, settings.compile) is None:
        return time_iterations(step, settings.iters, settings.warmup), {}
    before = counted()[0]
    compiling = time_iterations(step, 1, 0)[0]
    after_first = counted()[0]
    times = time_iterations(step, settings.iters, settings.warmup)
    return times, {"compile": settings.compile, "compile_s": compile_seconds(compiling, times),
                   "graphs": after_first - before, "recompiled_graphs": counted()[0] - after_first}


def _par4d(sizes: dict[str, int], settings: MoESettings) -> dict:
    from par4d.grid import describe
    from par4d.optim.data_parallel import sync_gradients
    from par4d.train.recipes.gpt import build_gpt

    grid = init(**sizes)
    if settings.model == "gpt":
        model = build_gpt(settings.config, grid)
    else:
        from par4d.adopt import parallelize
        from par4d.adopt.causal_lm import CausalLM

        model = CausalLM(parallelize(_mixtral(), grid), 0.0, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _tokens(settings)
    x, y = shard_batch(grid, inputs), shard_batch(grid, targets)

    def step() -> None:
        model(x, y).backward()
        sync_gradients(model, grid)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, compiled = _timed(model, step, settings)
    before = grid.ledger.total_bytes()
    step()
    comm = grid.ledger.total_bytes() - before
    row = _row("par4d", "par4d", describe(grid.sizes), times, comm, _bytes(model.parameters(), True),
               _bytes(model.parameters(), False), link_bytes(step) if settings.nodes else None)
    grid.close()
    return dict(row, **compiled)


def _torch(kind: str, settings: MoESettings) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from par4d.bench.peers import PeerBytes
    from par4d.train.recipes.gpt import build_reference

    world, rank = dist.get_world_size(), dist.get_rank()
    if settings.model == "gpt":
        model = build_reference(settings.config)
        blocks = list(model.blocks)
    else:
        from par4d.adopt.causal_lm import CausalLM

        model = CausalLM(_mixtral(), 0.0, 0)       # transformers' own loss, its balance loss included
        blocks = list(model.lm.model.layers)
    for name, param in model.named_parameters():    # what counts as an expert's, before FSDP2 replaces them
        param._bench_expert = ".experts." in name or name.endswith((".mlp.fc", ".mlp.proj"))
    experts_whole = _bytes(model.parameters(), True)
    if kind == "ddp":
        model = DistributedDataParallel(model)
        name, experts = "torch DDP", experts_whole
    else:
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        name, experts = "torch FSDP2", experts_whole // world     # dim 0 sharded over every rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = _tokens(settings)
    rows = slice(rank * settings.batch // world, (rank + 1) * settings.batch // world)
    x, y = inputs[rows], targets[rows]

    def step() -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, compiled = _timed(model, step, settings)
    link = link_bytes(step) if settings.nodes else None
    params = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                 for p in model.parameters())
    if kind == "ddp":
        comm = params                 # every gradient, all-reduced once
    else:
        counter = PeerBytes()
        with counter:
            step()
        comm = counter.bytes
    return dict(_row("torch", name, f"data={world}", times, comm, experts, params, link), **compiled)


def moe_worker(settings: MoESettings) -> list[dict]:
    join(distributed_env())
    torch.set_num_threads(threads_per_rank(settings.nproc))
    runs = ([lambda sizes=sizes: [_par4d(sizes, settings)] for sizes in par4d_grids(settings.world)]
            + [lambda kind=kind: [_torch(kind, settings)] for kind in ("ddp", "fsdp")])
    rows = [pooled(parts) for parts in in_rounds(runs, settings.rounds)]
    best = min(r["s_per_iter"] for r in rows if r["framework"] == "torch")
    for row in rows:
        row["ratio_to_best_peer"] = row["s_per_iter"] / best
    return rows


def run_bench_moe(nproc: int, iters: int, model: str = "gpt", nodes: int | None = None,
                  link: str = "1gbit", compile: str = "none", rounds: int = 1) -> list[dict]:
    """The rows, on ``nproc`` local ranks or ``nodes`` emulated nodes of ``nproc`` ranks joined by ``link``, each
    timed in ``rounds`` (the order of the rows reversed every other one) and its times pooled."""
    if iters < 1 or rounds < 1:
        raise ValueError(f"--iters and --rounds must be >= 1 (got {iters}, {rounds})")
    if nproc < 1 or nproc * (nodes or 1) < 2 or (nodes is not None and nodes < 2):
        where = f"--nproc {nproc}" if nodes is None else f"--nproc {nproc} per node over --nodes {nodes}"
        raise ValueError(f"the ranks ({where}) must be at least 2, on 2 nodes or more")
    if model not in MODELS:
        raise ValueError(f"--model {model}: give one of {', '.join(MODELS)}")
    check_compile(compile)
    check_cluster(nproc, nodes, link)
    settings = MoESettings(nproc, iters, model=model, nodes=nodes, link=link, compile=compile, rounds=rounds)
    return launch(moe_worker, (settings,), nproc, nodes, link, "par4d-bench-moe")


def table(rows: list[dict]) -> str:
    linked = all("link_bytes_per_iter" in r for r in rows)
    compiled = all("compile_s" in r for r in rows)
    lines = [f"{'name':<12} {'grid':<38} {'s/iter':>8} {'ratio':>6} {'experts MB/rank':>15} {'params MB/rank':>14} "
             f"{'comm MB/iter':>12}" + (f" {'link MB/iter':>12}" if linked else "")
             + (f" {'compiling s':>11} {'recompiled':>10}" if compiled else "")]
    for r in rows:
        lines.append(f"{r['name']:<12} {r['grid']:<38} {r['s_per_iter']:>8.4f} {r['ratio_to_best_peer']:>6.2f} "
                     f"{r['expert_bytes_per_rank'] / 1e6:>15.2f} {r['param_bytes_per_rank'] / 1e6:>14.2f} "
                     f"{r['comm_bytes_per_iter'] / 1e6:>12.2f}"
                     + (f" {r['link_bytes_per_iter'] / 1e6:>12.2f}" if linked else "")
                     + (f" {r['compile_s']:>11.1f} {r['recompiled_graphs']:>10}" if compiled else ""))
    return "\n".join(lines)
