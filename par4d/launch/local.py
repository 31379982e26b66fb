"""par4d's local launcher: ``--nproc N`` ranks on this machine under torchrun's elastic agent (restarts, a
failed rank's one line), the ranks meeting at 127.0.0.1 with gloo bound to loopback."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from types import MappingProxyType


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A launched rank raised an error or was killed (after the restarts allowed). ``signum``: the signal
    that killed it, or that it exited on (status 128 + N without an error: par4d's worker does so once it
    has saved its step, ``stopped``); the command then exits 128 + N, as a shell reports a killed process."""

    def __init__(self, rank: int, cause: str, signum: int | None = None, stopped: bool = False):
        super().__init__(f"rank {rank} failed: {cause}")
        self.rank, self.cause, self.signum, self.stopped = rank, cause, signum, stopped


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
        with _agent_quiet(), environment({**_loopback_gloo(), **allocator_settings(os.environ)}):
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        rank, failure = first_failure(error.failures)
        signum, stopped = failure_signal(failure)
        raise RankFailed(rank, failure_cause(failure), signum, stopped) from None
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


# What a rank's collective raises when a peer's process is gone (gloo's words): an echo of the peer's failure.
# Such a rank waits ECHO_GRACE_S before it exits (par4d.train.loop.worker), so that the agent, which reports
# the first rank to exit and stops the others, finds the peer's own failure first.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
ECHO_GRACE_S = 2.0


def first_failure(failures: dict[int, object]) -> tuple[int, object]:
    """(rank, failure) to report: the first to fail (torch's timestamps are whole seconds: ties by rank), unless
    it only echoes rank 0's failure (``par4d.rank0.Rank0Failed``, raised on the others when rank 0's own work
    fails): then rank 0's; and not a rank whose collective only found a peer gone (:data:`PEER_GONE`) where
    another failed of its own."""
    from par4d.rank0 import Rank0Failed

    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    rank, failure = next(((r, f) for r, f in ordered if not any(w in (_message(f) or "") for w in PEER_GONE)),
                         ordered[0])
    echo = (_message(failure) or "").startswith(Rank0Failed.__name__)
    return (0, failures[0]) if echo and 0 in failures else (rank, failure)


def _message(failure) -> str | None:
    """The exception a rank recorded (torch's error file), or None: torch says "<NONE>" where it has none."""
    message = failure.error_file_data.get("message") if failure.error_file_data else None
    if isinstance(message, dict):
        message = message.get("message")
    return message.strip() if isinstance(message, str) and message.strip() not in ("", "<NONE>") else None


def failure_signal(failure) -> tuple[int | None, bool]:
    """(the signal that ended a failed rank, or None; whether it exited on it by itself, 128 + N)."""
    code = failure.exitcode
    if code < 0:
        return -code, False
    if code > 128 and code - 128 in signal.Signals._value2member_map_ and _message(failure) is None:
        return code - 128, True
    return None, False


def failure_cause(failure) -> str:
    """One line for a failed rank: its exception, the signal that killed it, or its exit status."""
    code = failure.exitcode
    if code < 0:
        return f"killed by {failure.signal_name()}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    message = _message(failure)
    if message is not None:
        return message
    signum, _ = failure_signal(failure)   # no error: it exited on its own (os._exit), after a signal sent to it
    return f"exit status {code}" + (f" (on {signal.Signals(signum).name})" if signum else "")


def _loopback_gloo() -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for ranks on this machine alone: its loopback interface (``lo``, ``lo0``), unless
    the user set one. Without it gloo looks the hostname up for every process group, and where the resolver
    does not answer each lookup waits out its timeout (measured: 10 s each, 90 s to build a 2 x 2 grid)."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    return {} if "GLOO_SOCKET_IFNAME" in os.environ or loopback is None else {"GLOO_SOCKET_IFNAME": loopback}


# glibc's malloc hands freed blocks above its (moving) thresholds back to the system, and a training step frees and
# takes again the same memory every step: each page comes back as a page fault (3.3 us each on this project's
# machine; the demo's data=4 step took 2,600-4,000 over its four ranks, 70-93 with these: docs/benchmarks.md). Its
# memory returns to the same high mark every step anyway. Other C libraries ignore the variables.
ALLOCATOR = MappingProxyType({"MALLOC_MMAP_THRESHOLD_": str(2**28), "MALLOC_TRIM_THRESHOLD_": str(2**30)})


def allocator_settings(environ) -> dict[str, str]:
    """:data:`ALLOCATOR` for the ranks, unless the user set either variable (then theirs, alone)."""
    return {} if any(key in environ for key in ALLOCATOR) else dict(ALLOCATOR)


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
