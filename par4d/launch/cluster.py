"""An emulated cluster on one machine: nodes are network namespaces.

Each node is a namespace with one veth link to a switch namespace (a Linux bridge);
every link is rate-limited both ways with ``tc tbf`` (e.g. 1 Gbit/s per node), so
traffic between nodes waits on a slow link as on a real cluster, while ranks of one
node talk over that namespace's loopback. Ranks run as ``ip netns exec`` processes
with ``GLOO_SOCKET_IFNAME=eth0`` and torchrun-style variables, so par4d joins the job
as it would under any launcher. Needs root, ``ip`` and ``tc``; every namespace made
is deleted on exit, on error and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213"   # addresses of our own namespaces only


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (the reason says why)."""


def unavailable_reason() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs the '{tool}' command (iproute2)"
    return None


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    ranks_per_node: int
    link: str = "1gbit"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"--nodes and ranks per node must be >= 1 (got {self.nodes}, {self.ranks_per_node})")
        if self.nodes > 200:
            raise ValueError(f"--nodes {self.nodes}: at most 200 emulated nodes")
        rate = self.link.lower().rstrip("ps").rstrip("/")
        if not any(rate.endswith(u) for u in ("kbit", "mbit", "gbit", "bit")) or not rate[0].isdigit():
            raise ValueError(f"--link {self.link!r}: give a rate like 1gbit or 500mbit")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def link_bits_per_second(link: str) -> float:
    """``1gbit`` -> 1e9 (tc's decimal units, as ClusterSpec accepts them)."""
    rate = link.lower().rstrip("ps").rstrip("/")
    for unit, scale in _UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--link {link!r}: give a rate like 1gbit or 500mbit")


def link_sent_bytes() -> int | None:
    """Bytes this node has sent over its link (eth0's counter, TCP/IP headers included), or None
    outside an emulated cluster."""
    if "PAR4D_CLUSTER_NODES" not in os.environ:
        return None
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


class EmulatedCluster:
    """Context manager: builds the namespaces on enter, removes them on exit."""

    def __init__(self, spec: ClusterSpec):
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self.spec = spec
        self.tag = f"p4d{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.namespaces: list[str] = []
        self._previous_handlers: dict[int, object] = {}

    def node(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i // 250}.{i % 250 + 1}"

    def __enter__(self) -> EmulatedCluster:
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame):
        self.close()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self.namespaces.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.spec.nodes):
            ns = self.node(i)
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth",
                 "peer", "name", f"p{i}", "netns", self.switch)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/16", "dev", "eth0")
            for dev_ns, dev in ((ns, "eth0"), (self.switch, f"p{i}")):
                _run("ip", "-n", dev_ns, "link", "set", dev, "up")
                # Egress limit on both ends: each node's link is R in each direction.
                _run("ip", "netns", "exec", dev_ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", self.spec.link, "burst", "256kb", "latency", "100ms")
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces = []
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def run_command(self, argv: Sequence[str], timeout: float | None = None) -> None:
        """Run ``python <argv...>`` as every rank (torchrun-style environment)."""
        from par4d.launch import free_port

        port, procs = free_port(), []
        try:
            for rank in range(self.spec.world_size):
                node, local = divmod(rank, self.spec.ranks_per_node)
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.spec.world_size),
                           LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(self.spec.ranks_per_node),
                           MASTER_ADDR=self.address(0), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                           PAR4D_CLUSTER_NODES=str(self.spec.nodes))
                cmd = ["ip", "netns", "exec", self.node(node), sys.executable, *argv]
                procs.append(subprocess.Popen(cmd, env=env))
            codes = self._wait(procs, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [r for r, c in enumerate(codes) if c]
        if failed:
            raise RuntimeError(f"emulated cluster: ranks {failed} failed (exit codes "
                               f"{[codes[r] for r in failed]}); see their output above")

    @staticmethod
    def _wait(procs: list[subprocess.Popen], timeout: float | None) -> list[int | None]:
        """Wait for every rank; as soon as one fails (or time runs out), stop the others:
        they would otherwise sit in a collective until gloo's timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c for c in codes if c is not None):
                return codes
            if deadline is not None and time.monotonic() > deadline:
                return [c if c is not None else -9 for c in codes]
            time.sleep(0.1)

    def launch(self, fn: Callable, args: Sequence, timeout: float | None = None) -> object:
        """Run ``fn(*args)`` on every rank of the cluster; return rank 0's result."""
        work = Path(tempfile.mkdtemp(prefix="par4d-cluster-"))
        try:
            payload = work / "payload.pkl"
            payload.write_bytes(pickle.dumps((fn, tuple(args))))
            self.run_command(["-m", "par4d.launch.cluster", str(payload), str(work / "result-{rank}.pkl")], timeout)
            return pickle.loads((work / "result-0.pkl").read_bytes())
        finally:
            shutil.rmtree(work, ignore_errors=True)


def launch_cluster(spec: ClusterSpec, fn: Callable, args: Sequence) -> dict[int, object]:
    """Like :func:`par4d.launch.launch_local`, on an emulated cluster (rank 0's result)."""
    with EmulatedCluster(spec) as cluster:
        return {0: cluster.launch(fn, args)}


def _worker_main(payload: str, result: str) -> None:
    import gc

    import torch.distributed as dist

    fn, args = pickle.loads(Path(payload).read_bytes())
    value = fn(*args)
    Path(result.format(rank=os.environ["RANK"])).write_bytes(pickle.dumps(value))
    # A job ``fn`` joined and left open: its gloo threads, still running at interpreter exit,
    # abort the process ("terminate called without an active exception", exit -6). Leave it first.
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def leftover_namespaces(include_live: bool = False) -> list[str]:
    """Namespaces named like ours whose creating process is gone (killed with SIGKILL);
    with ``include_live``, also those of clusters still running."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith("p4d")]
    if include_live:
        return names

    def dead(name: str) -> bool:
        pid = name[3:].split("-", 1)[0]
        return not pid.isdigit() or not Path(f"/proc/{pid}").exists()

    return [n for n in names if dead(n)]


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
