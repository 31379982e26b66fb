"""Where the ranks come from, and joining their job: :func:`init` builds a Grid over it.

* torchrun (and par4d's launcher, which uses torchrun's elastic agent) sets
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
* Slurm's ``srun`` sets ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_STEP_ID``;
  the rendezvous address comes from ``MASTER_ADDR`` or the first host of
  ``SLURM_STEP_NODELIST`` (expanded with ``scontrol``), the port from
  ``MASTER_PORT`` or the job id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported where a rank joins a job: `par4d plan` needs none
    import torch

    from par4d.grid import Grid

JOIN_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0]


def _slurm_tasks_per_node(env) -> int:
    """This node's task count: SLURM_STEP_TASKS_PER_NODE looks like ``4(x2),3``."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "1"
    return int(text.split(",")[0].split("(")[0])


def distributed_env(environ: dict[str, str] | None = None) -> DistEnv | None:
    """The job this process belongs to, or ``None`` when it was started alone."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=_slurm_tasks_per_node(env),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(),
            # One port per job, so two jobs sharing a node do not collide.
            master_port=int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000),
            launcher="srun",
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A launched rank raised an error or was killed (after the restarts allowed)."""

    def __init__(self, rank: int, cause: str):
        super().__init__(f"rank {rank} failed: {cause}")
        self.rank, self.cause = rank, cause


class Interrupted(RuntimeError):
    """The launcher itself was sent a signal (a scheduler's SIGTERM, Ctrl-C); its ranks were told."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def launch_local(nproc: int, entrypoint: Callable, args: Sequence, run_id: str = "par4d",
                 max_restarts: int = 0) -> dict[int, object]:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks with torchrun's elastic agent.

    Returns each rank's return value. When a rank fails (an error, a kill, out of memory)
    the agent stops the others and, up to ``max_restarts`` times, starts all ranks again
    (``TORCHELASTIC_RESTART_COUNT`` tells them which attempt this is); after that
    :class:`RankFailed` names the first rank that failed and why, in one line (the agent's
    own multi-line report is silenced). A signal to this process (SIGTERM, SIGINT) is
    passed on to the ranks, which get up to 30 s to finish, and raises :class:`Interrupted`.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        # Else the agent hands the ranks this machine's hostname as MASTER_ADDR: where it does not resolve
        # (a container, a cloud GPU box), they retry it until their 300 s store timeout and fail.
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        with _agent_quiet(), environment(_loopback_gloo()):
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        raise RankFailed(rank, _cause(failure)) from None
    except SignalException as error:
        # A second Ctrl-C makes the agent stop waiting for its ranks, which may still be saving
        # their step: wait for them here, so that what the caller reports is what they saved.
        wait_for_children()
        raise Interrupted(error.sigval) from None


def children() -> list[int]:
    """Live child processes of this one, from /proc (empty where there is none); exited ones not yet
    reaped (zombies) and multiprocessing's resource tracker are left out."""
    parent = os.getpid()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"resource_tracker" not in command:
            found.append(int(entry))
    return found


def wait_for_children(limit: float = 30.0, pids: list[int] | None = None) -> None:
    """Wait up to ``limit`` seconds (torch's agent's own grace period) for this process's children
    (``pids`` of them; default: all, the ranks) to exit; a further signal ends the wait."""
    import time

    deadline = time.monotonic() + limit
    waited = set(children() if pids is None else pids)
    try:
        while waited & set(children()) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:   # the agent's handler raises on a third signal: the user wants out now
        pass


def _cause(failure) -> str:
    """One line for a failed rank: its exception, the signal that killed it, or its exit status."""
    code = failure.exitcode
    if code < 0:
        return f"killed by {failure.signal_name()}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    message = failure.error_file_data.get("message") if failure.error_file_data else None
    if isinstance(message, dict) and message.get("message"):
        return message["message"].strip()
    if isinstance(message, str) and message.strip():
        return message.strip()
    # No error file: the rank exited on its own (os._exit), e.g. after a signal it was sent directly.
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"exit status {code} ({signal.Signals(code - 128).name})"
    return f"exit status {code}"


def _loopback_gloo() -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for ranks on this machine alone: its loopback interface (``lo``, ``lo0``), unless
    the user set one. Without it gloo looks the hostname up for every process group, and where the resolver
    does not answer each lookup waits out its timeout (measured: 10 s each, 90 s to build a 2 x 2 grid)."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    return {} if "GLOO_SOCKET_IFNAME" in os.environ or loopback is None else {"GLOO_SOCKET_IFNAME": loopback}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """``variables`` set in this process's environment (which the ranks it spawns inherit) while it runs."""
    before = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _agent_quiet():
    """Silence the elastic agent's loggers (each has its own level) while it runs: its report
    of a failure is a traceback of 70+ lines, which RankFailed says in one."""
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def device(env: DistEnv | None) -> torch.device:
    """This rank's device: its node-local GPU where CUDA is present, else the CPU."""
    import torch

    if torch.cuda.is_available():
        local = env.local_rank if env is not None else 0
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join(env: DistEnv | None) -> None:
    """Join the torch.distributed job of ``env`` (torchrun, srun, par4d's launcher), or
    start a one-rank job when there is none; nothing when this process is in a job already.

    torchrun's variables go through ``env://``, so workers reuse the agent's store;
    srun's are passed as a ``tcp://`` address (no environment writes). Each join gets
    its own key prefix in the store: ``destroy_process_group()`` restarts torch's group
    numbering, and a second join on a store that still holds the first join's keys
    would connect to stale peers (pytorch/pytorch#55967). The count of joins is kept
    in the store itself (one counter per rank), not in this process.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # NCCL bound to this rank's GPU from the start (else its first barrier guesses the device, and warns)
    bound = device(env) if backend == "nccl" else None
    if env is None:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                device_id=bound)
        return
    url = ("env://" if env.launcher == "torchrun" else
           f"tcp://{env.master_addr}:{env.master_port}?rank={env.rank}&world_size={env.world_size}")
    store, rank, world = next(dist.rendezvous(url, timeout=JOIN_TIMEOUT))
    joins = store.add(f"par4d/joins/rank{rank}", 1)
    store = dist.PrefixStore(f"par4d/join{joins}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=JOIN_TIMEOUT,
                            device_id=bound)


def init(x: int = 1, y: int = 1, z: int = 1, data: int = 1, pipe: int = 1, hierarchical: str = "auto") -> Grid:
    """Build the grid ``x * y * z * data * pipe`` over the current job. A model's overlaps are
    its own (``par4d.overlap.set_overlap``; par4d's GPT and U-Net take ``overlap=``).

    Joins an existing torch.distributed job or initializes one from the
    environment (torchrun, srun, or par4d's launcher): gloo on CPU, NCCL where CUDA
    is present. The shape is validated on every rank before any collective. Every rank
    tells its node (host and network namespace); collectives over groups that span nodes
    go in stages as ``hierarchical`` says (par4d.hierarchy.MODES).
    """
    import torch.distributed as dist

    from par4d.grid import build_grid, validate_sizes
    from par4d.hierarchy import check_mode, node_indices, node_key

    check_mode(hierarchical)
    requested = {"x": x, "y": y, "z": z, "data": data, "pipe": pipe}
    env = distributed_env()
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = env.world_size if env is not None else 1
    sizes = validate_sizes(requested, world)
    join(env)
    keys = _check_same_on_every_rank(sizes, hierarchical, node_key())
    grid = build_grid(sizes, device(env), node_indices(keys), hierarchical)
    if hierarchical == "auto":
        _measure_stages(grid)
    return grid


PROBE_ELEMENTS = 1 << 18      # 1 MB of fp32: enough for the link's rate to show (~10 ms a try at 1 Gbit/s)
PROBE_TRIES = 5
PROBE_MARGIN = 1.1    # staged is kept unless measured 10% slower than flat: a probe on busy cores is noisy, and
                      # where staging loses (fast links) it lost by 1.5x and more here


def _measure_stages(grid: Grid) -> None:
    """Under ``--hierarchical auto``, keep staging a group's collectives only where a staged all-reduce
    of PROBE_ELEMENTS was not slower than the flat one (by PROBE_MARGIN) on this job: fast links and busy
    cores can make the node stages cost more than the link bytes they save. Each side's best of
    PROBE_TRIES; the slowest rank's times decide, so every rank decides alike. The probes stay out of
    the grid's ledger."""
    import dataclasses
    import functools
    import time

    import torch
    import torch.distributed as dist

    from par4d import staged
    from par4d.ledger import Ledger

    ledger, grid.ledger = grid.ledger, Ledger()
    decided: dict[int, bool] = {}      # by link group: ("z",) and ("z", "data") at data=1 share their stages
    try:
        for key, stages in sorted(grid._stages.items()):
            if id(stages.link) in decided:
                grid._stages[key] = dataclasses.replace(stages, pays=decided[id(stages.link)])
                continue
            tensor, group = torch.ones(PROBE_ELEMENTS, device=grid.device), grid.group(*key)
            seconds = []
            flat = functools.partial(dist.all_reduce, tensor, group=group)
            for run in (flat, functools.partial(staged.all_reduce, grid, stages, tensor, key, False)):
                best = float("inf")
                for _ in range(PROBE_TRIES):
                    start = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - start)
                seconds.append(best)
            slowest = torch.tensor(seconds, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            decided[id(stages.link)] = bool(slowest[1] < PROBE_MARGIN * slowest[0])
            grid._stages[key] = dataclasses.replace(stages, pays=decided[id(stages.link)])
    finally:
        grid.ledger = ledger


def _check_same_on_every_rank(sizes: dict[str, int], hierarchical: str, node: str) -> list[str]:
    """Ranks that ask for different grids would build mismatched groups and hang. Returns every
    rank's ``node``, gathered in the same collective."""
    import torch.distributed as dist

    from par4d.grid import describe

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sizes, hierarchical, node))
    modes = {mode for _, mode, _ in every}
    if len(modes) > 1:
        raise ValueError(f"ranks asked par4d.init for different --hierarchical settings: {sorted(modes)}")
    every, keys = [s for s, _, _ in every], [k for _, _, k in every]
    if any(other != sizes for other in every):
        shapes: dict[str, list[int]] = {}
        for rank, other in enumerate(every):
            shapes.setdefault(describe(other), []).append(rank)
        listing = "; ".join(f"ranks {ranks}: {shape}" for shape, ranks in shapes.items())
        raise ValueError(f"ranks asked par4d.init for different grids ({listing})")
    return keys
