"""Where a checked run's ranks come from: this process as one rank of a torchrun or srun job,
or local ranks started here (one run per folder, the machine's peak measured first).
Either way a rank's failure is one line that names its traceback's log.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from par4d.launch import RankFailed, distributed_env, environment, launch_local
from par4d.train.config import TrainConfig
from par4d.train.lock import HELD_ENV, RunLock
from par4d.train.run_files import failure_log


def as_rank(config: TrainConfig) -> dict:
    """Train as this rank of the launcher's job; its summary (rank 0's is whole)."""
    from par4d.train.loop import worker

    rank = distributed_env().rank
    try:
        return worker(config)
    except Exception as error:
        raise RankFailed(rank, _with_log(f"{type(error).__name__}: {error}", rank, config.out)) from None


def local_ranks(config: TrainConfig, world: int, max_restarts: int) -> dict:
    """Start ``world`` local ranks and train; rank 0's summary. Raises ``Interrupted`` when this
    process got a signal (the ranks saved their step before exiting)."""
    import torch

    from par4d.launch.host import cpu_cores
    from par4d.launch.peak import START_SECONDS, measure_matmul_peak

    with RunLock(config.out, new=not config.resume):    # one run per folder, until the ranks are gone
        # The CPU's peak is measured here, before the ranks exist, so nothing competes for the cores; a GPU's by
        # rank 0 on its own device, in the run's compute dtype.
        if config.peak_flops is None and config.matmul_peak is None and not torch.cuda.is_available():
            config = replace(config, peak_flops=measure_matmul_peak(START_SECONDS, threads=cpu_cores()))
        try:
            with environment({HELD_ENV: str(Path(config.out).resolve())}):    # the ranks inherit it
                return launch_local(world, _rank, (config, True), run_id="par4d-train",
                                    max_restarts=max_restarts)[0]
        except RankFailed as error:
            raise RankFailed(error.rank, _with_log(error.cause, error.rank, config.out), error.signum,
                             error.stopped) from None


def _rank(config: TrainConfig, exit_on_stop: bool) -> dict:
    """A local rank's entry point: the training is imported by the ranks alone (the launcher needs none of it,
    and spawned ranks import what they run by name)."""
    from par4d.train.loop import worker

    return worker(config, exit_on_stop)


def _with_log(cause: str, rank: int, out: str | None) -> str:
    log = failure_log(Path(out), rank) if out else None
    return f"{cause} (traceback in {log})" if log is not None and log.is_file() else cause
