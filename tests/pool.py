"""A pool of ranks kept alive across tests.

Spawning a distributed job per test costs seconds of ``import torch`` per rank; the
pool forks its ranks once from a forkserver that has torch, dynamo, transformers and par4d imported, joins
them in one gloo job, and then runs test bodies on every rank (SPMD). A body that
does not finish within its time limit fails the test and the pool is torn down
(a hang is a failure, never a stuck suite).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class RankFailure(AssertionError):
    pass


def _worker(rank: int, world: int, port: int, conn) -> None:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while True:
        job = conn.recv()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # report everything, keep serving
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int):
        from par4d.launch import free_port

        self.world = world
        ctx = mp.get_context("forkserver")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # What most ranks import anyway, imported once: dynamo (every torch optimizer imports it) and transformers'
        # models cost a second each of CPU per rank, on cores the ranks share.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "transformers.modeling_layers",
                                    "par4d", "par4d.train.loop", "tests.cases", "tests.helpers"])
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        Raises :class:`RankFailure` with the first failing rank's traceback, or
        ``TimeoutError`` (after killing the pool) when a rank does not answer in time.
        """
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        replies = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close(kill=True)
                raise TimeoutError(f"rank {rank} of {self.world} did not finish {fn.__name__} in {timeout:.0f} s")
            replies.append(conn.recv())
        failed = [(rank, r) for rank, r in enumerate(replies) if r[0] == "err"]
        if failed:
            rank, (_, message, tb) = failed[0]
            raise RankFailure(f"rank {rank}/{self.world}: {message}\n{tb}")
        return [r[1] for r in replies]

    def errors(self, fn, *args, timeout: float = 60.0, **kwargs) -> list[str]:
        """Run ``fn`` expecting it to raise on every rank; return each rank's message."""
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        messages = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close(kill=True)
                raise TimeoutError(f"rank {rank} of {self.world} hung in {fn.__name__} instead of raising")
            reply = conn.recv()
            if reply[0] == "ok":
                raise AssertionError(f"rank {rank}: {fn.__name__} returned {reply[1]!r}, expected an error")
            messages.append(reply[1])
        return messages

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if not kill and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []
